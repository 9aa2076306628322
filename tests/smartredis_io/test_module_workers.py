"""The Redis module's own execution workers, through real processes: a redis-server with the module
and nothing else runs models; its workers leave with it, even when it is killed with SIGKILL; a
killed worker is replaced; a runaway script is stopped at its deadline; and where no worker can run
a request, the published client's run_model fails at once with the module's message."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
import torch

from smartredis_io import Client, RedisServer
from smartredis_io.error import RedisTimeoutError
from tests.support.processes import call_within
from tests.support.srio_models import PUBLISHED_SKIP, SCRIPT, linear, torchscript_bytes
from tests.support.srio_workers import (
    WORKER_START_S,
    busy_worker,
    protocol_client,
    registry,
    run_client,
    wait_until,
)

X = np.ones((2, 4), dtype=np.float32)
#: as root, the module starts workers only for a named user
AS_USER = ("WORKER_USER", "nobody") if os.geteuid() == 0 else ()


def _module_args(workers: int = 1) -> tuple[str, ...]:
    return ("WORKERS", str(workers), "WORKER_PYTHON", sys.executable, *AS_USER)


def _workers(plain: redis.Redis) -> dict[str, int]:
    """Name -> pid of every worker registered on the server."""
    return {name: entry.pid for name, entry in registry(plain).items()}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _still_running(pids: list[int], seconds: float) -> list[int]:
    """The processes of ``pids`` still running after ``seconds`` (woken by each exit: pidfds)."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + seconds
    try:
        while fds and (left := deadline - time.monotonic()) > 0:
            for fd in select.select(list(fds), [], [], left)[0]:
                os.close(fd)
                del fds[fd]
        return list(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture(scope="module")
def module_server() -> Iterator[RedisServer]:
    """A redis-server whose module started one worker, and nothing else."""
    with RedisServer(module_args=_module_args()) as server:
        plain = protocol_client(server)
        wait_until(lambda: _workers(plain), WORKER_START_S, "the module's worker registers")
        plain.close()
        yield server


def _client(server: RedisServer, timeout_ms: int = 60_000) -> Client:
    return run_client(server.address, timeout_ms)


def test_the_module_alone_runs_models_and_scripts(module_server: RedisServer, uid: str) -> None:
    module = linear(0)
    with _client(module_server) as client:
        client.put_tensor(uid + "x", X)
        client.set_model(uid + "m", torchscript_bytes(module, torch.from_numpy(X)))
        client.run_model(uid + "m", [uid + "x"], [uid + "y"])
        with torch.no_grad():
            np.testing.assert_allclose(client.get_tensor(uid + "y"), module(torch.from_numpy(X)).numpy(), rtol=1e-6)
        client.set_script(uid + "s", SCRIPT)
        client.run_script(uid + "s", "double", [uid + "x"], [uid + "2x"])
        np.testing.assert_array_equal(client.get_tensor(uid + "2x"), 2 * X)


def test_a_killed_worker_is_replaced(module_server: RedisServer, uid: str) -> None:
    plain = protocol_client(module_server)
    (victim,) = _workers(plain).values()
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: _workers(plain) and victim not in _workers(plain).values(), WORKER_START_S,
               "the module's supervisor starts a new worker")
    with _client(module_server) as client:
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        client.run_script(uid, "double", [uid + "x"], [uid + "y"])
        np.testing.assert_array_equal(client.get_tensor(uid + "y"), 2 * X)
    plain.close()


def test_a_runaway_script_is_stopped_at_its_deadline(module_server: RedisServer, uid: str) -> None:
    plain = protocol_client(module_server)
    before = set(_workers(plain).values())
    with _client(module_server, 1000) as runaway:
        runaway.set_script(uid, SCRIPT)
        runaway.put_tensor(uid + "x", X)
        elapsed, error = call_within(30, lambda: runaway.run_script(uid, "forever", [uid + "x"], [uid + "y"]))
    assert isinstance(error, RedisTimeoutError) and "TIMEDOUT" in str(error), (error, elapsed)
    assert elapsed < 3, "the caller gets its timeout at the deadline"
    after = wait_until(lambda: set(_workers(plain).values()) - before, WORKER_START_S,
                       "the runaway's worker is stopped and replaced")
    assert after and not before & set(_workers(plain).values())
    with _client(module_server) as client:
        client.run_script(uid, "double", [uid + "x"], [uid + "z"])
        np.testing.assert_array_equal(client.get_tensor(uid + "z"), 2 * X)
    plain.close()


def test_a_sigkill_of_the_server_leaves_no_worker(uid: str) -> None:
    """One worker idle, one inside a run that never returns: both leave with the server."""
    with RedisServer(module_args=_module_args(2)) as server, _client(server) as client:
        plain = protocol_client(server)
        workers = list(wait_until(lambda: len(_workers(plain)) == 2 and _workers(plain), WORKER_START_S,
                                  "both of the module's workers register").values())
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        stuck = threading.Thread(target=call_within, daemon=True,
                                 args=(90, lambda: client.run_script(uid, "forever", [uid + "x"], [uid + "y"])))
        stuck.start()
        busy_worker(plain)
        plain.close()
        supervisors = {_parent(pid) for pid in workers}
        (redis_pid,) = server.pids
        assert redis_pid not in supervisors, "the workers have a supervisor of their own"
        os.kill(redis_pid, signal.SIGKILL)
        left = _still_running([*supervisors, *workers], 5.0)
        assert not left, f"processes of the module's workers still running 5 s after SIGKILL: {left}"
        stuck.join(30)


@pytest.mark.parametrize("why", ["WORKERS 0", "root with no worker user"])
def test_with_no_worker_run_model_fails_at_once(why: str, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    smartredis = pytest.importorskip("smartredis", reason=PUBLISHED_SKIP, exc_type=ImportError)
    if why == "WORKERS 0":
        args = ("WORKERS", "0")
    else:
        if os.geteuid() != 0:
            pytest.skip("the module refuses to start workers as root only when it runs as root")
        monkeypatch.delenv("SRIO_WORKER_USER", raising=False)
        args = ("WORKERS", "1", "WORKER_PYTHON", sys.executable)
    monkeypatch.setenv("SR_LOG_LEVEL", "QUIET")  # the published client logs to stdout otherwise
    with RedisServer(module_args=args) as server:
        published = smartredis.Client(address=server.address, cluster=False)
        published.put_tensor(uid + "x", X)
        published.set_model(uid, torchscript_bytes(linear(0), torch.from_numpy(X)), "TORCH", "CPU")
        elapsed, error = call_within(60, lambda: published.run_model(uid, [uid + "x"], [uid + "y"]))
    assert error is not None and "no execution worker" in str(error), error
    assert elapsed < 10, f"run_model took {elapsed:.1f} s to fail"
