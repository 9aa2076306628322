"""The process supervisor behind every embedded service launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from lightning_storage_plugins.services import (
    ManagedProcess,
    MissingBinaryError,
    ServiceStartError,
    find_binary,
)
from smartredis_io import RedisServer
from tests.support.processes import foreground_sigint


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_missing_binary_says_how_to_get_it(monkeypatch):
    monkeypatch.delenv("NO_SUCH_SERVICE_BIN", raising=False)
    with pytest.raises(MissingBinaryError, match=r"(?s)NO_SUCH_SERVICE_BIN.*PATH.*apt-get install no-such"):
        find_binary("no-such-service-binary", "NO_SUCH_SERVICE_BIN", install_hint="apt-get install no-such")


def test_env_var_pointing_nowhere_is_reported(monkeypatch):
    monkeypatch.setenv("NO_SUCH_SERVICE_BIN", "/nonexistent/service")
    with pytest.raises(MissingBinaryError, match="NO_SUCH_SERVICE_BIN"):
        find_binary("service", "NO_SUCH_SERVICE_BIN", install_hint="")


def _executable(path, name: str) -> str:
    binary = path / name
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return str(binary)


def test_lookup_order_is_env_var_then_path_then_providers(tmp_path, monkeypatch):
    (tmp_path / "env").mkdir()
    (tmp_path / "path").mkdir()
    (tmp_path / "extra").mkdir()
    from_env = _executable(tmp_path / "env", "svc")
    on_path = _executable(tmp_path / "path", "svc")
    provided = _executable(tmp_path / "extra", "svc")
    monkeypatch.setenv("PATH", str(tmp_path / "path"))

    monkeypatch.setenv("SVC_BIN", from_env)
    assert find_binary("svc", "SVC_BIN", install_hint="", providers=[lambda: provided]) == from_env
    monkeypatch.delenv("SVC_BIN")
    assert find_binary("svc", "SVC_BIN", install_hint="", providers=[lambda: provided]) == on_path
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert find_binary("svc", "SVC_BIN", install_hint="", providers=[lambda: None, lambda: provided]) == provided


def test_fake_gcs_server_error_tells_a_pip_user_what_to_do(monkeypatch, tmp_path):
    from dataflux_ckpt.testing import find_fake_gcs_server

    monkeypatch.delenv("FAKE_GCS_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # the optional extra is absent
    with pytest.raises(MissingBinaryError) as caught:
        find_fake_gcs_server()
    message = str(caught.value)
    assert "go install github.com/fsouza/fake-gcs-server@" in message
    assert "lightning-storage-plugins[emulator]" in message
    assert "FAKE_GCS_SERVER_BIN" in message
    assert ".tools" not in message.split("In a source checkout")[0]


def test_early_exit_reports_the_log_tail():
    proc = ManagedProcess(
        "failing", [sys.executable, "-c", "import sys; print('bad config line 7'); sys.exit(3)"],
        ready=lambda: False,
    )
    with pytest.raises(ServiceStartError, match=r"(?s)code 3.*bad config line 7"):
        proc.start()
    assert proc.pid is None


def test_service_that_never_answers_times_out_and_is_stopped():
    proc = ManagedProcess(
        "silent", [sys.executable, "-c", "import time; print('listening soon', flush=True); time.sleep(60)"],
        ready=lambda: False, startup_timeout_s=1.0,
    )
    started = time.monotonic()
    with pytest.raises(ServiceStartError, match=r"(?s)did not answer within 1 s.*listening soon"):
        proc.start()
    assert time.monotonic() - started < 10
    assert not proc.is_running()


def test_stop_is_idempotent_and_removes_the_log():
    with ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], ready=lambda: True) as proc:
        pid, log_path = proc.pid, proc.log_path
        assert proc.is_running()
    assert _gone(pid)
    assert not os.path.exists(log_path)
    proc.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_services_die_with_their_parent(sig, tmp_path):
    """Even when the Python process is killed outright, its services do not outlive it."""
    script = textwrap.dedent(
        """
        import faulthandler, signal, sys, time
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        from smartredis_io import RedisServer
        from dataflux_ckpt.testing import FakeGcsServer
        with RedisServer() as redis, FakeGcsServer() as gcs:
            print(redis.pids[0], gcs.pid, gcs.emulator_pid, flush=True)
            time.sleep(120)
        """
    )
    stderr_path = tmp_path / "parent.stderr"
    with open(stderr_path, "wb") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True,
                                  preexec_fn=foreground_sigint)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        # redis-server, FakeGcsServer's front and the fake-gcs-server behind it: three processes
        assert len(set(pids)) == 3 and all(psutil.pid_exists(p) for p in pids)
        parent.send_signal(sig)
        try:
            parent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the parent did not exit within 30 s of {sig!r}; {_stuck(parent.pid, pids, stderr_path)}")
        assert all(_gone(pid) for pid in pids), f"orphans left after {sig!r}: {pids}"
    finally:
        parent.kill()


def _stuck(parent: int, services: list[int], stderr_path: Path) -> str:
    """Where a parent that does not exit is stuck: its services' states, and its threads' stacks
    (faulthandler, on SIGUSR1)."""
    states = []
    for pid in services:
        try:
            states.append(f"{pid}: {psutil.Process(pid).status()}")
        except psutil.NoSuchProcess:
            states.append(f"{pid}: gone")
    os.kill(parent, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "File " not in stderr_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.1)
    return f"services {', '.join(states)}; its stderr:\n{stderr_path.read_text(errors='replace')[-4000:]}"


def test_redis_server_answers_and_stops(redis_server):
    import redis

    assert redis.Redis(host=redis_server.host, port=redis_server.port).ping()


def test_cluster_spreads_slots_over_three_primaries(redis_cluster):
    import redis

    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    try:
        primaries = {n.port for n in client.get_primaries()}
        assert primaries == set(redis_cluster.ports)
        for i in range(30):
            client.set(f"key-{i}", i)
        per_shard = [redis.Redis(port=port).dbsize() for port in redis_cluster.ports]
        assert sum(per_shard) == 30 and all(per_shard), per_shard
    finally:
        client.close()


def test_port_in_use_reports_the_log_tail(redis_server):
    with pytest.raises(ServiceStartError, match="(?i)address already in use|exited"):
        RedisServer(port=redis_server.port).start()


def test_emulator_bucket_round_trip(gcs_emulator, gcs_bucket):
    from google.cloud import storage

    client = storage.Client(project="test-project")
    blob = client.bucket(gcs_bucket).blob("hello.txt")
    blob.upload_from_string(b"hello")
    assert blob.download_as_bytes() == b"hello"
