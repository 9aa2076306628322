"""Execution safety with real workers: a runaway script is stopped at its deadline while other users
are served, two SIGTERMs stop a worker inside a long C++ loop, runs do not see each other's memory
or random state, forged tensor headers cost what is stored, and dead workers are started again."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import redis
import torch

from lightning_storage_plugins.services import ManagedProcess
from smartredis_io import Client, ConfigOptions, Orchestrator
from smartredis_io._client import wire
from smartredis_io.error import RedisInternalError, RedisReplyError, RedisTimeoutError
from tests.support.processes import alive, call_within
from tests.support.srio_models import SCRIPT
from tests.support.srio_workers import (
    WORKER_START_S,
    busy_worker,
    protocol_client,
    registry,
    running_its_request,
    wait_until,
    worker_env,
)

X = np.ones((2, 4), dtype=np.float32)
SECRET = 12345.0


def _client(address: str, timeout_ms: int, cluster: bool = False) -> Client:
    options = ConfigOptions.create_from_environment("")
    options.override_string_option("SSDB", address)
    options.override_string_option("SR_DB_TYPE", "Clustered" if cluster else "Standalone")
    options.override_integer_option("SR_MODEL_TIMEOUT", timeout_ms)
    return Client(options)


def _plain(orch: Orchestrator) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=orch.database.port, password=orch.settings().password)


def _nodes(orch: Orchestrator) -> list[redis.Redis]:
    """A client of every server of the database, speaking the worker protocol."""
    ports = orch.database.ports if orch.cluster else [orch.database.port]
    return [protocol_client(orch.database, port) for port in ports]


class _Call(threading.Thread):
    """A client call on a thread of its own, with a deadline of its own (``call_within``)."""

    def __init__(self, seconds: float, fn) -> None:
        super().__init__(daemon=True)
        self._seconds, self._fn = seconds, fn
        self.elapsed: float = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        self.elapsed, self.error = call_within(self._seconds, self._fn)


@pytest.fixture(scope="module")
def one_worker():
    """An Orchestrator with a single worker: its tests replace that worker and see its memory."""
    with Orchestrator(workers=1) as orch:
        yield orch


def _runaway_is_stopped(orch: Orchestrator, uid: str) -> None:
    nodes = _nodes(orch)
    before = set(orch.worker_pids)
    runaway, other = _client(orch.address, 1000, orch.cluster), _client(orch.address, 20_000, orch.cluster)
    runaway.set_script(uid, SCRIPT)
    runaway.put_tensor(uid + "x", X)
    stuck = _Call(30, lambda: runaway.run_script(uid, "forever", [uid + "x"], [uid + "y"]))
    stuck.start()
    busy_worker(nodes)
    served = _Call(30, lambda: other.run_script(uid, "double", [uid + "x"], [uid + "z"]))
    served.start()  # another user's request, queued behind the runaway on the only worker
    stuck.join()
    served.join()
    assert isinstance(stuck.error, RedisTimeoutError) and "TIMEDOUT" in str(stuck.error), (stuck.error, stuck.elapsed)
    assert stuck.elapsed < 3, "the caller gets its timeout at the deadline"
    # within the other user's own 20 s deadline, by the worker started in the runaway's place
    assert served.error is None, (served.error, served.elapsed)
    np.testing.assert_array_equal(other.get_tensor(uid + "z"), 2 * X)
    assert not runaway.tensor_exists(uid + "y")
    now = set(wait_until(lambda: orch.worker_pids, WORKER_START_S, "a worker is registered"))
    assert now and now.isdisjoint(before), "the runaway's worker was stopped and replaced"
    runaway.close()
    other.close()
    for node in nodes:
        node.close()


def test_a_runaway_script_is_stopped_at_its_deadline_and_others_are_served(one_worker: Orchestrator,
                                                                           uid: str) -> None:
    _runaway_is_stopped(one_worker, uid)


@pytest.mark.slow
def test_a_runaway_script_is_stopped_in_a_cluster(uid: str) -> None:
    with Orchestrator(shards=3, workers=1) as orch:
        _runaway_is_stopped(orch, uid)


def test_a_killed_worker_is_started_again_by_the_orchestrator(one_worker: Orchestrator, uid: str) -> None:
    plain = _plain(one_worker)
    (victim,) = one_worker.worker_pids
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: one_worker.worker_pids and victim not in one_worker.worker_pids, WORKER_START_S, "a new worker")
    with _client(one_worker.address, 30_000) as client:
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        client.run_script(uid, "double", [uid + "x"], [uid + "y"])
        np.testing.assert_array_equal(client.get_tensor(uid + "y"), 2 * X)
    plain.close()


def test_runs_see_no_memory_or_random_state_of_earlier_runs(one_worker: Orchestrator, uid: str) -> None:
    with _client(one_worker.address, 30_000) as owner, _client(one_worker.address, 30_000) as other:
        owner.set_script(uid, SCRIPT)
        for n in (1024, 4096, 16384):  # sizes the allocator reuses rather than returns to the system
            owner.put_tensor(uid + "secret", np.full(n, SECRET, np.float32))
            for _ in range(3):
                owner.run_script(uid, "double", [uid + "secret"], [uid + "copy"])  # a freed tensor of the owner's
                other.run_script(uid, "uninitialized", [uid + "secret"], [uid + "out"])
                out = other.get_tensor(uid + "out")
                assert not np.isin(out, [SECRET, 2 * SECRET]).any(), "an output carried another run's bytes"
                assert np.isnan(out).all(), "memory nobody wrote reads as NaN"
        owner.run_script(uid, "seed", [uid + "secret"], [uid + "ignored"])  # torch.manual_seed(7)
        other.run_script(uid, "draw", [uid + "secret"], [uid + "first"])
        other.run_script(uid, "draw", [uid + "secret"], [uid + "second"])
        torch.manual_seed(7)
        predictable = torch.rand(16384).numpy()
        first, second = other.get_tensor(uid + "first"), other.get_tensor(uid + "second")
        assert not np.allclose(first, predictable), "one user's seed made another's draws predictable"
        assert not np.allclose(first, second)


def test_a_forged_tensor_header_costs_what_is_stored(one_worker: Orchestrator, uid: str) -> None:
    """A 48-byte header that claims 2**20 chunks: refused after reading what is stored, on every path."""
    forged = wire.encode_header(2, (1 << 20,), chunks=1 << 20, crc=0, payload=4 << 20, version="0" * 32)
    assert len(forged) == 48
    with _client(one_worker.address, 30_000) as client, _plain(one_worker) as plain:
        plain.set(uid + "forged", forged)
        pids = set(one_worker.worker_pids)
        start = time.monotonic()
        with pytest.raises(RedisInternalError, match="chunks"):
            client.get_tensor(uid + "forged")
        with pytest.raises(RedisInternalError, match="chunks"):
            client.unpack_tensor(uid + "forged", np.empty(1 << 20, np.float32))
        client.set_script(uid, SCRIPT)
        with pytest.raises(RedisReplyError, match="chunks"):
            client.run_script(uid, "double", [uid + "forged"], [uid + "y"])  # the worker's read
        client.delete_tensor(uid + "forged")
        assert time.monotonic() - start < 2.0, "the forged header cost what it claims"
        assert set(one_worker.worker_pids) == pids, "no worker died of it"


def test_two_sigterms_stop_a_worker_inside_a_long_run(redis_server, uid: str) -> None:
    """The first SIGTERM lets the run go on; the second stops the worker although it never returns to
    Python (a TorchScript loop), and the module hands its request to the next worker."""
    name = f"sig-{uid}"
    plain = protocol_client(redis_server)  # it stands in for the next worker
    cli = ManagedProcess(
        "worker-cli",
        [sys.executable, "-m", "smartredis_io.worker", "--address", redis_server.address, "--name", name,
         *(["--user", "nobody"] if os.geteuid() == 0 else [])],
        ready=lambda: any(n.startswith(name) for n in registry(plain)),
        startup_timeout_s=90,
        env=worker_env(redis_server),
    )
    with cli, _client(redis_server.address, 60_000) as client:
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        stuck = _Call(90, lambda: client.run_script(uid, "forever", [uid + "x"], [uid + "y"]))
        stuck.start()
        worker = busy_worker(plain)
        pid = registry(plain)[worker].pid
        running_its_request(pid)
        os.kill(cli.pid, signal.SIGTERM)
        wait_until(lambda: "finishing it" in cli.log_tail(), 15, "the worker takes the first SIGTERM")
        assert alive(pid) and registry(plain)[worker].running, "the first SIGTERM lets the run go on"
        os.kill(cli.pid, signal.SIGTERM)
        wait_until(lambda: not alive(pid) and not cli.is_running(), 15, "the second SIGTERM stops the worker")
        # The request went back to the queue: a worker (here the test, as the worker role would) gets it again.
        request = plain.execute_command("SRIO.POP", f"{name}-next", 10_000)
        assert request is not None and request[2] == uid.encode() and request[5] == 1, request
        plain.execute_command("SRIO.REPLY", f"{name}-next", request[0], 0, 0, 0, "ERROR", "ERR stopped by the test")
        stuck.join()
        assert isinstance(stuck.error, RedisReplyError) and "stopped by the test" in str(stuck.error)
    plain.close()
