"""run_model / run_script through real execution workers: results, batching, errors, dead workers."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smartredis_io import Client, Orchestrator, RedisServer
from smartredis_io._client import protocol, wire
from smartredis_io.error import RedisKeyError, RedisReplyError
from tests.support.srio_models import SCRIPT, BatchRows, Failing, linear, torchscript_bytes
from tests.support.srio_workers import (
    WORKER_START_S,
    WorkerEntry,
    protocol_client,
    registry,
    wait_until,
    worker_env,
)

X = np.random.default_rng(1).random((3, 4), dtype=np.float32)


def _expected(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def test_run_model(orch_client: Client, uid: str) -> None:
    module = linear(0)
    orch_client.set_model(uid, torchscript_bytes(module, torch.from_numpy(X)), "TORCH", "CPU", tag="v1")
    assert orch_client.model_exists(uid) and orch_client.poll_model(uid, 10, 1)
    orch_client.put_tensor(uid + "x", X)
    orch_client.run_model(uid, inputs=[uid + "x"], outputs=[uid + "y"])
    np.testing.assert_allclose(orch_client.get_tensor(uid + "y"), _expected(module, X), rtol=1e-6)
    assert orch_client.get_model(uid)[:2] == b"PK"  # TorchScript archives are zip files


def test_a_new_model_version_is_picked_up(orch_client: Client, orch_raw, uid: str) -> None:
    orch_client.put_tensor(uid + "x", X)
    for seed in (1, 2, 3):  # two workers, each must notice every new version
        module = linear(seed)
        orch_client.set_model(uid, torchscript_bytes(module, torch.from_numpy(X)))
        for _ in range(2):
            orch_client.run_model(uid, uid + "x", uid + "y")
            np.testing.assert_allclose(orch_client.get_tensor(uid + "y"), _expected(module, X), rtol=1e-6)
    assert len(orch_raw.keys(f"{{{uid}}}.blob.*")) == 1  # old versions' blobs are gone


_BOUNDARY = protocol.EMBED_MAX_BYTES // 4  # float32 elements of an input the request can carry


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=st.sampled_from([1, 7, _BOUNDARY - 1, _BOUNDARY, _BOUNDARY + 1, 300_000]),
    second=st.integers(1, 2 * _BOUNDARY),
    chunked=st.booleans(),
)
def test_script_inputs_and_outputs_of_every_size(orch_client: Client, uid: str, monkeypatch, first: int,
                                                 second: int, chunked: bool) -> None:
    """Inputs the request carries, ones the worker reads (larger, or stored in chunks), and outputs
    stored with the reply or on their own, in one call."""
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, str(64 * 1024 if chunked else wire.BULK_LIMIT_BYTES))
    rng = np.random.default_rng(first + second)
    a, b = rng.random(first, dtype=np.float32), rng.random(second, dtype=np.float32)
    orch_client.set_script(uid, SCRIPT)
    orch_client.put_tensor(uid + "a", a)
    orch_client.put_tensor(uid + "b", b)
    orch_client.run_script(uid, "double", [uid + "a"], [uid + "2a"])
    np.testing.assert_array_equal(orch_client.get_tensor(uid + "2a"), 2 * a)
    orch_client.run_script(uid, "add_and_sub", [uid + "b", uid + "b"], [uid + "sum", uid + "diff"])
    np.testing.assert_array_equal(orch_client.get_tensor(uid + "sum"), b + b)
    np.testing.assert_array_equal(orch_client.get_tensor(uid + "diff"), np.zeros_like(b))


@pytest.mark.parametrize("elements", [4, 300_000])  # outputs stored with the reply, and on their own
def test_an_output_never_replaces_a_model(orch_client: Client, uid: str, elements: int) -> None:
    module = linear(0)
    orch_client.set_model(uid + "m", torchscript_bytes(module, torch.from_numpy(X)))
    orch_client.set_script(uid, SCRIPT)
    orch_client.put_tensor(uid + "a", np.ones(elements, np.float32))
    with pytest.raises(RedisReplyError, match="holds a model"):
        orch_client.run_script(uid, "add_and_sub", [uid + "a", uid + "a"], [uid + "sum", uid + "m"])
    assert not orch_client.key_exists(uid + "sum"), "no output is stored when one is refused"
    orch_client.put_tensor(uid + "x", X)
    orch_client.run_model(uid + "m", uid + "x", uid + "y")
    np.testing.assert_allclose(orch_client.get_tensor(uid + "y"), _expected(module, X), rtol=1e-6)


def test_a_refused_request_fails_at_once(orch_client: Client, orch_raw, uid: str) -> None:
    """A request the server does not queue (here: out of memory) fails without waiting for a reply."""
    orch_client.set_model(uid, torchscript_bytes(linear(0), torch.from_numpy(X)))
    orch_client.put_tensor(uid + "x", X)
    orch_client.run_model(uid, uid + "x", uid + "y")
    policy = orch_raw.config_get("maxmemory-policy")["maxmemory-policy"]
    orch_raw.config_set("maxmemory-policy", "noeviction")
    orch_raw.config_set("maxmemory", "1")
    try:
        start = time.monotonic()
        with pytest.raises(RedisReplyError, match="maxmemory"):
            orch_client.run_model(uid, uid + "x", uid + "y")
        assert time.monotonic() - start < 0.5, "the refusal was not waited for"
    finally:
        orch_raw.config_set("maxmemory", "0")
        orch_raw.config_set("maxmemory-policy", policy)
    orch_client.run_model(uid, uid + "x", uid + "y")


def test_set_model_from_file_and_delete(orch_client: Client, uid: str, tmp_path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(torchscript_bytes(linear(0), torch.from_numpy(X)))
    orch_client.set_model_from_file(uid, str(path), "torch")
    orch_client.delete_model(uid)
    assert not orch_client.model_exists(uid)
    with pytest.raises(RedisKeyError):
        orch_client.get_model(uid)
    with pytest.raises(FileNotFoundError):
        orch_client.set_model_from_file(uid, str(tmp_path / "missing.pt"), "TORCH")


def test_run_script(orch_client: Client, uid: str, tmp_path) -> None:
    orch_client.set_script(uid, SCRIPT)
    assert orch_client.get_script(uid) == SCRIPT
    a, b = X, np.ones_like(X)
    orch_client.put_tensor(uid + "a", a)
    orch_client.put_tensor(uid + "b", b)
    orch_client.run_script(uid, "double", [uid + "a"], [uid + "2a"])
    np.testing.assert_allclose(orch_client.get_tensor(uid + "2a"), 2 * a)
    orch_client.run_script(uid, "add_and_sub", [uid + "a", uid + "b"], [uid + "sum", uid + "diff"])
    np.testing.assert_allclose(orch_client.get_tensor(uid + "sum"), a + b)
    np.testing.assert_allclose(orch_client.get_tensor(uid + "diff"), a - b)

    def triple(x):
        return x * 3

    orch_client.set_function(uid + "fn", triple)
    orch_client.run_script(uid + "fn", "triple", uid + "a", uid + "3a")
    np.testing.assert_allclose(orch_client.get_tensor(uid + "3a"), 3 * a)
    path = tmp_path / "script.txt"
    path.write_text(SCRIPT)
    orch_client.set_script_from_file(uid + "file", str(path))
    orch_client.run_script(uid + "file", "double", [uid + "b"], [uid + "2b"])
    np.testing.assert_allclose(orch_client.get_tensor(uid + "2b"), 2 * b)
    orch_client.delete_script(uid)
    with pytest.raises(RedisKeyError):
        orch_client.get_script(uid)


def test_errors_come_back_as_reply_errors(orchestrator: Orchestrator, orch_client: Client, orch_raw,
                                          uid: str) -> None:
    orch_client.put_tensor(uid + "x", X)
    orch_client.set_model(uid, torchscript_bytes(Failing()))
    with pytest.raises(RedisReplyError, match="view"):
        orch_client.run_model(uid, [uid + "x"], [uid + "y"])
    with pytest.raises(RedisReplyError, match="is empty"):
        orch_client.run_model(uid + "missing", [uid + "x"], [uid + "y"])
    orch_client.set_model(uid + "ok", torchscript_bytes(linear(0), torch.from_numpy(X)))
    with pytest.raises(RedisReplyError, match="tensor key is empty"):
        orch_client.run_model(uid + "ok", [uid + "nothing"], [uid + "y"])
    with pytest.raises(RedisReplyError, match="outputs"):
        orch_client.run_model(uid + "ok", [uid + "x"], [uid + "y", uid + "z"])
    orch_client.set_script(uid + "s", SCRIPT)
    with pytest.raises(RedisReplyError, match="does not exist"):
        orch_client.run_script(uid + "s", "nope", [uid + "x"], [uid + "y"])
    orch_raw.hset(uid + "hash", "f", "v")
    with pytest.raises(RedisReplyError, match="WRONGTYPE"):
        orch_client.run_model(uid + "ok", [uid + "hash"], [uid + "y"])
    pids = set(orchestrator.worker_pids)
    # Foreign values where a worker reads: each request fails with an error, no worker dies.
    orch_raw.set(uid + "garbage", b"not a tensor")
    with pytest.raises(RedisReplyError, match="not a tensor"):
        orch_client.run_model(uid + "ok", [uid + "garbage"], [uid + "y"])
    orch_raw.set(uid + "bad", b'{"kind": "model", "version": ')  # looks like a manifest, is not one
    with pytest.raises(RedisReplyError, match="WRONGTYPE"):  # as AI.MODELGET says
        orch_client.run_model(uid + "bad", [uid + "x"], [uid + "y"])
    orch_client.run_model(uid + "ok", [uid + "x"], [uid + "y"])  # the workers are still fine
    assert set(orchestrator.worker_pids) == pids
    assert all(worker.is_running() for worker in orchestrator.workers)


def test_set_model_rejects_what_smartredis_rejects(orch_client: Client, uid: str) -> None:
    blob = torchscript_bytes(linear(0), torch.from_numpy(X))
    with pytest.raises(RedisReplyError, match="batch_size must be non-zero"):
        orch_client.set_model(uid, blob, "TORCH", min_batch_size=2)
    with pytest.raises(RedisReplyError, match="min_batch_size must be non-zero"):
        orch_client.set_model(uid, blob, "TORCH", batch_size=4, min_batch_timeout=10)
    with pytest.raises(TypeError, match="Backend"):
        orch_client.set_model(uid, blob, "PYTORCH")
    with pytest.raises(TypeError, match="Device"):
        orch_client.set_model(uid, blob, "TORCH", device="TPU")
    with pytest.raises(TypeError):
        orch_client.set_model(uid, blob, "TORCH", batch_size="4")
    with pytest.raises(RedisReplyError, match="unsupported backend"):
        orch_client.set_model(uid, blob, "ONNX")
    assert not orch_client.model_exists(uid)


def test_batching(orchestrator: Orchestrator, orch_client: Client, uid: str) -> None:
    orch_client.set_model(uid, torchscript_bytes(BatchRows()), "TORCH", batch_size=8, min_batch_size=4,
                          min_batch_timeout=5000)
    seen: dict[int, np.ndarray] = {}

    def call(i: int) -> None:
        with Client(False, orchestrator.address) as client:
            client.put_tensor(f"{uid}x{i}", np.full((1, 4), i, np.float32))
            client.run_model(uid, [f"{uid}x{i}"], [f"{uid}y{i}"])
            seen[i] = client.get_tensor(f"{uid}y{i}")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start < 5.0, "min_batch_size was reached: no waiting for the timeout"
    assert [seen[i].tolist() for i in range(4)] == [[[4.0]]] * 4, "all four ran as one batch of four rows"

    # Fewer than min_batch_size requests run once min_batch_timeout has passed.
    orch_client.set_model(uid, torchscript_bytes(BatchRows()), "TORCH", batch_size=8, min_batch_size=4,
                          min_batch_timeout=300)
    orch_client.put_tensor(uid + "two", np.zeros((2, 4), np.float32))
    start = time.monotonic()
    orch_client.run_model(uid, [uid + "two"], [uid + "out"])
    assert time.monotonic() - start >= 0.3
    assert orch_client.get_tensor(uid + "out").tolist() == [[2.0], [2.0]]


def test_run_model_without_workers_fails_at_once(uid: str) -> None:
    """No worker is registered and none is starting: the module says so at once, not at the deadline.
    A server of its own: on one where a worker has left, requests wait WORKER_STARTUP_MS for its
    replacement."""
    with RedisServer(module_args=("WORKERS", "0")) as server, Client(False, server.address) as client:
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        start = time.monotonic()
        with pytest.raises(RedisReplyError, match="no execution worker is registered on this server"):
            client.run_script(uid, "double", [uid + "x"], [uid + "y"])
        assert time.monotonic() - start < 2.0
        assert not client.tensor_exists(uid + "y")


@pytest.mark.slow
def test_cluster_orchestrator_runs_models() -> None:
    with Orchestrator(shards=3, workers=1) as orch, Client(True, orch.address) as client:
        module = linear(5)
        client.set_model("m", torchscript_bytes(module, torch.from_numpy(X)))
        for i in range(6):  # input and output keys spread over the shards
            client.put_tensor(f"x{i}", X + i)
            client.run_model("m", [f"x{i}"], [f"y{i}"])
            np.testing.assert_allclose(client.get_tensor(f"y{i}"), _expected(module, X + i), rtol=1e-6)
        pids = orch.worker_pids + orch.database.pids
    assert all(not _alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_worker_cli_with_several_processes(redis_server, uid: str) -> None:
    """``python -m smartredis_io.worker --workers 2``: a supervisor and two worker processes that share
    the requests; a worker that dies is started again; everything stops together."""
    import sys

    from lightning_storage_plugins.services import ManagedProcess

    name = f"cli-{uid}"
    plain = protocol_client(redis_server)

    def workers() -> dict[str, WorkerEntry]:
        return {n: e for n, e in registry(plain).items() if n.startswith(name)}

    cli = ManagedProcess(
        "worker-cli",
        [sys.executable, "-m", "smartredis_io.worker", "--address", redis_server.address, "--workers", "2",
         "--name", name, *(["--user", "nobody"] if os.geteuid() == 0 else [])],
        ready=lambda: len(workers()) == 2,
        startup_timeout_s=90,
        env=worker_env(redis_server),
    )
    with cli, Client(False, redis_server.address) as client:
        pids = {entry.pid for entry in workers().values()}
        assert len(pids) == 2 and all(_parent_of(pid) == cli.pid for pid in pids)
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        for i in range(4):
            client.run_script(uid, "double", [uid + "x"], [f"{uid}y{i}"])
            np.testing.assert_allclose(client.get_tensor(f"{uid}y{i}"), 2 * X)
        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: len(workers()) == 2 and victim not in {e.pid for e in workers().values()},
                   WORKER_START_S, "the supervisor starts a new worker")
        client.run_script(uid, "double", [uid + "x"], [uid + "z"])
        pids = {entry.pid for entry in workers().values()}
    wait_until(lambda: not any(_alive(pid) for pid in pids), 10, "the workers stop with their supervisor")
    assert not workers(), "they unregistered"
    plain.close()


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("Uid:")).split()[1])


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the worker's root policy applies to workers started as root")


@needs_root
def test_a_worker_started_as_root_refuses_without_a_user_or_override(redis_server) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "smartredis_io.worker", "--address", redis_server.address],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "refusing to run stored models as root" in result.stderr and "--user" in result.stderr


@needs_root
def test_workers_started_by_root_drop_to_an_unprivileged_user(orchestrator: Orchestrator, orch_client: Client,
                                                               uid: str) -> None:
    assert {_uid_of(pid) for pid in orchestrator.worker_pids} == {65534}  # nobody
    orch_client.set_script(uid, SCRIPT)
    orch_client.put_tensor(uid + "x", X)
    orch_client.run_script(uid, "double", [uid + "x"], [uid + "y"])
    np.testing.assert_allclose(orch_client.get_tensor(uid + "y"), 2 * X)


@needs_root
def test_allow_root_workers_is_an_explicit_choice(uid: str) -> None:
    with Orchestrator(workers=1, allow_root_workers=True) as orch, Client(False, orch.address) as client:
        assert [_uid_of(pid) for pid in orch.worker_pids] == [0]
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        client.run_script(uid, "double", [uid + "x"], [uid + "y"])
        np.testing.assert_allclose(client.get_tensor(uid + "y"), 2 * X)


@pytest.mark.slow
def test_cluster_runs_models_and_scripts_under_keys_that_are_not_utf8() -> None:
    """The published client's cluster copies of models and scripts sit under binary hash-tag prefixes
    (``{\\x8a\\xff}.name``): the worker answers with those keys as the bytes they were sent as, whether
    the output is stored by the module (same shard), by the worker (another shard), or the model batches."""
    with Orchestrator(shards=3, workers=1) as orch:
        host, port = orch.address.split(",")[0].rsplit(":", 1)
        db = redis.RedisCluster(host=host, port=int(port))
        tag = b"{\x8a\xff}"
        far = next(key for key in (b"far\xfe%d" % i for i in range(64))
                   if db.get_node_from_key(key) != db.get_node_from_key(tag))

        def put(key: bytes, array: np.ndarray) -> None:
            db.execute_command("AI.TENSORSET", key, "FLOAT", *array.shape, "BLOB", array.tobytes())

        def get(key: bytes, shape: tuple[int, ...] = X.shape) -> np.ndarray:
            return np.frombuffer(db.execute_command("AI.TENSORGET", key, "BLOB"), np.float32).reshape(shape)

        put(tag + b".a", X)
        put(tag + b".b", X + 1)
        db.execute_command("AI.SCRIPTSET", tag + b".s", "CPU", "SOURCE", SCRIPT)
        assert db.execute_command("AI.SCRIPTRUN", tag + b".s", "add_and_sub", "INPUTS", tag + b".a", tag + b".b",
                                  "OUTPUTS", tag + b".sum", far) == b"OK"
        np.testing.assert_allclose(get(tag + b".sum"), 2 * X + 1)
        np.testing.assert_allclose(get(far), -np.ones_like(X))

        module = linear(5)
        db.execute_command("AI.MODELSTORE", tag + b".m", "TORCH", "CPU", "BATCHSIZE", 4,
                           "BLOB", torchscript_bytes(module, torch.from_numpy(X)))
        assert db.execute_command("AI.MODELEXECUTE", tag + b".m", "INPUTS", 1, tag + b".a",
                                  "OUTPUTS", 1, tag + b".y", "TIMEOUT", 60_000) == b"OK"
        expected = _expected(module, X)
        np.testing.assert_allclose(get(tag + b".y", expected.shape), expected, rtol=1e-6)
