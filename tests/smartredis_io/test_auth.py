"""Authenticated and encrypted databases: passwords, ACL users with roles, TLS, refused open binds."""

from __future__ import annotations

import subprocess
import tempfile
import threading

import numpy as np
import pytest
import redis
import torch

from lightning_storage_plugins.services import ServiceStartError
from smartredis_io import (
    AclUser,
    Client,
    ConfigOptions,
    Orchestrator,
    RedisCluster,
    RedisServer,
    SmartRedisCheckpointIO,
    TlsFiles,
)
from smartredis_io.error import RedisConnectionError, RedisReplyError
from tests.support.ports import is_free
from tests.support.srio_models import PUBLISHED_SKIP, SCRIPT, linear, torchscript_bytes
from tests.support.srio_workers import busy_worker, protocol_client, registry

X = np.ones((2, 4), dtype=np.float32)


def _options(address: str, **strings: str) -> ConfigOptions:
    options = ConfigOptions.create_from_environment("")
    options.override_string_option("SSDB", address)
    options.override_integer_option("SR_CONN_TIMEOUT", 2)
    options.override_integer_option("SR_CONN_INTERVAL", 100)
    for name, value in strings.items():
        options.override_string_option(name, value)
    return options


@pytest.mark.parametrize("launcher", [
    lambda: RedisServer(host="0.0.0.0"),
    lambda: RedisCluster(3, host="0.0.0.0"),
    lambda: Orchestrator(host="0.0.0.0"),
])
def test_an_open_bind_without_authentication_is_refused(launcher) -> None:
    with pytest.raises(ValueError, match="refusing to start redis-server on 0.0.0.0.*password="):
        launcher()


def test_a_failed_start_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ServiceStartError):
        RedisServer(password="pw", extra_args=("--no-such-option", "1")).start()
    assert list(tmp_path.iterdir()) == []


def test_a_cluster_node_starts_above_port_55535() -> None:
    """redis-server's default cluster bus port is its own + 10000, which does not exist up there."""
    port = next(port for port in range(65535, 55535, -1) if is_free(port))
    with RedisServer(port=port, extra_args=("--cluster-enabled", "yes"), module=False) as server:
        with redis.Redis(host=server.host, port=server.port) as client:
            assert client.cluster("info")["cluster_state"] == "fail"  # up, and no slots assigned yet


def test_a_password_protected_server(uid: str, monkeypatch) -> None:
    with RedisServer(host="0.0.0.0", password="s3cret:@/pw") as server:
        with pytest.raises(RedisConnectionError, match="requires a password"):
            Client(_options(server.address))
        with pytest.raises(RedisConnectionError, match="authenticate"):
            Client(_options(server.address, SR_PASSWORD="wrong"))
        with Client(_options(server.address, SR_PASSWORD="s3cret:@/pw")) as client:
            client.put_tensor(uid, X)
        with Client(False, f"redis://:{'s3cret%3A%40%2Fpw'}@{server.address}") as client:
            np.testing.assert_array_equal(client.get_tensor(uid), X)
        monkeypatch.setenv("SR_PASSWORD", "s3cret:@/pw")
        io = SmartRedisCheckpointIO(server.address, cluster=False)
        io.save_checkpoint({"w": torch.ones(3)}, f"{uid}.ckpt")
        torch.testing.assert_close(io.load_checkpoint(f"{uid}.ckpt")["w"], torch.ones(3))
        io.teardown()


def test_acl_users_write_only_their_keys_and_cannot_replace_a_model(uid: str) -> None:
    users = [AclUser("alice", "alice-pw", write_keys=(f"{uid}alice.*",)), AclUser("runner", "runner-pw", role="worker")]
    with Orchestrator(workers=1, users=users) as orch:
        admin = Client(_options(orch.address, SR_PASSWORD=orch.settings().password))
        alice = Client(_options(orch.address, SR_USERNAME="alice", SR_PASSWORD="alice-pw", SSKEYOUT=f"{uid}alice",
                                SSKEYIN=f"{uid}alice"))
        module = linear(0)
        admin.set_model(f"{uid}shared", torchscript_bytes(module, torch.from_numpy(X)))

        alice.put_tensor("x", X)  # alice writes under her prefix
        alice.run_model(f"{uid}shared", "x", "y")  # and runs the shared model through the worker
        np.testing.assert_allclose(alice.get_tensor("y"), module(torch.from_numpy(X)).detach().numpy(), rtol=1e-6)
        with pytest.raises(RedisReplyError, match="permission denied to user .alice."):
            alice.set_model(f"{uid}shared", torchscript_bytes(linear(1), torch.from_numpy(X)))
        alice.use_tensor_ensemble_prefix(False)
        with pytest.raises(RedisReplyError, match="permission denied to user .alice."):
            alice.put_tensor(f"{uid}elsewhere", X)
        with pytest.raises(RedisReplyError, match="NOPERM.*write output key"):
            alice.run_model(f"{uid}shared", f"{uid}alice.x", f"{uid}shared")  # the worker is no way round
        admin.put_tensor(uid + "x", X)
        admin.run_model(f"{uid}shared", uid + "x", uid + "y")  # the model is intact
        np.testing.assert_allclose(admin.get_tensor(uid + "y"), module(torch.from_numpy(X)).detach().numpy(),
                                   rtol=1e-6)
        with redis.Redis(host="127.0.0.1", port=orch.database.port, password=orch.settings().password) as plain:
            assert {entry["user"] for entry in plain.client_list()} >= {"runner", "alice", "default"}
        admin.close()
        alice.close()


def test_a_client_user_cannot_reach_the_protocol_or_write_beyond_its_keys(uid: str) -> None:
    """A ``client`` user against real workers: it cannot stop them, forge or take requests, delete
    another user's request, or freeze the server with a script; a run whose output it may not
    write is refused with NOPERM and writes nothing (RedisAI's command as smartredis_io's run_script)."""
    users = [AclUser("alice", "alice-pw", write_keys=("alice.*",)), AclUser("bob", "bob-pw", write_keys=("bob.*",)),
             AclUser("runner", "runner-pw", role="worker")]
    with Orchestrator(workers=1, users=users) as orch:
        admin = protocol_client(orch.database)  # the default user, on a worker's connection
        alice = redis.Redis(host="127.0.0.1", port=orch.database.port, username="alice", password="alice-pw")
        bob = Client(_options(orch.address, SR_USERNAME="bob", SR_PASSWORD="bob-pw"))
        script, model = f"{uid}script", f"{uid}model"
        with Client(_options(orch.address, SR_PASSWORD=orch.settings().password)) as owner:
            owner.set_script(script, SCRIPT)
            owner.set_model(model, torchscript_bytes(linear(0), torch.from_numpy(X)))
        bob.put_tensor("bob.x", X)
        (worker,) = registry(admin)
        pids = set(orch.worker_pids)

        slow = threading.Thread(target=bob.run_script, args=(script, "slow", ["bob.x"], ["bob.y"]))
        slow.start()  # bob's request is in flight while alice tries
        busy_worker(admin)
        attempts = [
            ("SRIO.UNREGISTER", worker), ("SRIO.PAUSE", worker), ("SRIO.HEARTBEAT", worker, 1),  # stop a worker
            ("SRIO.POP", "alice", 100), ("SRIO.TAKE", "alice", script, 1, 1, 100),  # take others' requests
            ("SRIO.REPLY", worker, 1, 0, 0, 0, "OK"), ("SRIO.RETURN", worker, 1),  # forge or hand back a reply
            ("SRIO.WORKERS",),
            ("DEL", "bob.x"), ("SET", "bob.y", "forged"),  # another user's keys
            ("EVAL", "while true do end", 0), ("FUNCTION", "LOAD", "#!lua name=spin\nwhile true do end"),
        ]
        for command in attempts:
            with pytest.raises(redis.exceptions.NoPermissionError):
                alice.execute_command(*command)
        slow.join()
        np.testing.assert_array_equal(bob.get_tensor("bob.y"), X)  # bob's run was untouched

        with pytest.raises(redis.exceptions.NoPermissionError, match="write output key 'bob.z'"):
            alice.execute_command("AI.SCRIPTEXECUTE", script, "double", "INPUTS", 1, "bob.x", "OUTPUTS", 1, "bob.z")
        with pytest.raises(redis.exceptions.NoPermissionError, match="write output key 'bob.z'"):
            alice.execute_command("AI.SCRIPTRUN", script, "double", "INPUTS", "bob.x", "OUTPUTS", "alice.ok", "bob.z")
        with pytest.raises(redis.exceptions.NoPermissionError, match="write output key 'bob.z'"):
            alice.execute_command("AI.MODELEXECUTE", model, "INPUTS", 1, "bob.x", "OUTPUTS", 1, "bob.z")
        with Client(_options(orch.address, SR_USERNAME="alice", SR_PASSWORD="alice-pw")) as client:
            with pytest.raises(RedisReplyError, match="NOPERM.*write output key 'bob.z'"):
                client.run_model(model, ["bob.x"], ["bob.z"])
            with pytest.raises(RedisReplyError, match="NOPERM.*write output key 'bob.z'"):
                client.run_script(script, "double", ["bob.x"], ["bob.z"])
            client.run_script(script, "double", ["bob.x"], ["alice.z"])  # reading others' tensors is allowed
            np.testing.assert_array_equal(client.get_tensor("alice.z"), 2 * X)
        assert not admin.exists("bob.z", "alice.ok"), "a refused run writes nothing"
        assert set(orch.worker_pids) == pids, "no worker was stopped"
        assert not [k for k in admin.keys("*") if k.startswith(b"{srio}")], "no protocol key exists to reach"
        bob.close()
        alice.close()
        admin.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 signed by it."""
    d = tmp_path_factory.mktemp("tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=srio test CA")
    openssl("req", *key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
    return TlsFiles(str(d / "server.crt"), str(d / "server.key"), str(d / "ca.crt"))


def test_tls(tls_files: TlsFiles, uid: str) -> None:
    with Orchestrator(workers=1, password="pw", tls=tls_files) as orch:
        with pytest.raises(RedisConnectionError):
            Client(_options(orch.address, SR_PASSWORD="pw"))  # plain TCP to a TLS port
        secure = _options(orch.address, SR_PASSWORD="pw", SR_TLS="1", SR_TLS_CA_CERT=tls_files.ca_cert_file)
        with Client(secure) as client:
            client.set_script(uid, SCRIPT)
            client.put_tensor(uid + "x", X)
            client.run_script(uid, "double", uid + "x", uid + "y")  # the worker connects with TLS too
            np.testing.assert_allclose(client.get_tensor(uid + "y"), 2 * X)
        with Client(_options(f"rediss://:pw@{orch.address}", SR_TLS_CA_CERT=tls_files.ca_cert_file)) as client:
            np.testing.assert_allclose(client.get_tensor(uid + "y"), 2 * X)


def test_the_published_smartredis_client_gets_noperm_for_an_output_it_may_not_write(uid: str) -> None:
    """SmartRedis 0.6.1 cannot authenticate: it runs as the default user, here narrowed to a client's rights."""
    smartredis = pytest.importorskip("smartredis", reason=PUBLISHED_SKIP, exc_type=ImportError)
    users = [AclUser("root", "root-pw", role="admin"), AclUser("runner", "runner-pw", role="worker")]
    with Orchestrator(workers=1, users=users) as orch:
        admin = redis.Redis(host="127.0.0.1", port=orch.database.port, username="root", password="root-pw")
        narrowed = AclUser("sim", "unused", write_keys=("sim.*",)).rule(module=True)[5:]  # the client role's rights
        admin.execute_command("ACL", "SETUSER", "default", "reset", "on", "nopass", "resetchannels", *narrowed)
        with Client(_options(orch.address, SR_USERNAME="root", SR_PASSWORD="root-pw")) as owner:
            owner.set_model(f"{uid}model", torchscript_bytes(linear(0), torch.from_numpy(X)))
        client = smartredis.Client(address=orch.address, cluster=False)
        client.put_tensor("sim.x", X)
        client.run_model(f"{uid}model", ["sim.x"], ["sim.y"])  # its own keys: runs
        assert client.tensor_exists("sim.y")
        with pytest.raises(smartredis.error.RedisReplyError, match="NOPERM"):
            client.run_model(f"{uid}model", ["sim.x"], [f"{uid}elsewhere"])
        assert not admin.exists(f"{uid}elsewhere")
        admin.close()
