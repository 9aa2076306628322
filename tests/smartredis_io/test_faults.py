"""Deadlines and dead processes: a stopped (SIGSTOP) or killed (SIGKILL) redis-server or worker.

Every case runs under a deadline of its own (``call_within``), well under a minute, so a hang fails
the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis
import torch

from smartredis_io import Client, ConfigOptions, Orchestrator, RedisServer, SmartRedisCheckpointIO
from smartredis_io._client import wire
from smartredis_io.error import RedisConnectionError, RedisReplyError, RedisTimeoutError
from tests.support.processes import alive, call_within, paused
from tests.support.srio_models import SCRIPT
from tests.support.srio_workers import WORKER_START_S, busy_worker, protocol_client, registry, wait_until

X = np.ones((2, 4), dtype=np.float32)


def _options(address: str, **integers: int) -> ConfigOptions:
    options = ConfigOptions.create_from_environment("")
    options.override_string_option("SSDB", address)
    for name, value in integers.items():
        options.override_integer_option(name, value)
    return options


@pytest.fixture
def server():
    """A redis-server of the test's own, to stop and kill."""
    with RedisServer() as own:
        yield own


def test_tensor_calls_to_a_stopped_server_time_out_naming_call_and_key(server, uid: str) -> None:
    client = Client(_options(server.address, SR_CMD_TIMEOUT=1))
    out = np.empty_like(X)
    client.put_tensor(uid, X)
    with paused(server.pids[0]):
        for call in (lambda: client.put_tensor(uid, X), lambda: client.unpack_tensor(uid, out),
                     lambda: client.tensor_exists(uid)):
            elapsed, error = call_within(10, call)
            assert isinstance(error, RedisTimeoutError), error
            assert uid in str(error) and server.address in str(error)
            assert elapsed < 3
    client.put_tensor(uid, X * 2)  # the client works again once the server does
    client.unpack_tensor(uid, out)
    np.testing.assert_array_equal(out, X * 2)
    client.close()


def test_connecting_to_a_stopped_server_ends_at_sr_conn_timeout(server) -> None:
    with paused(server.pids[0]):
        elapsed, error = call_within(15, lambda: Client(_options(server.address, SR_CONN_TIMEOUT=2,
                                                                 SR_CONN_INTERVAL=100)))
    assert isinstance(error, RedisConnectionError) and server.address in str(error), error
    assert 1.5 < elapsed < 5


def test_a_checkpoint_save_to_a_stopped_server_fails_within_its_deadline(server, uid: str) -> None:
    io = SmartRedisCheckpointIO(server.address, cluster=False, chunk_bytes=4096,
                                config_options=_options(server.address, SR_CMD_TIMEOUT=1))
    io.save_checkpoint({"w": torch.ones(10)}, f"{uid}.ckpt")
    with paused(server.pids[0]):
        elapsed, error = call_within(15, lambda: io.save_checkpoint({"w": torch.zeros(5000)}, f"{uid}.ckpt"))
        assert isinstance(error, RedisTimeoutError) and f"{uid}.ckpt" in str(error), error
        assert "save_checkpoint" in str(error) and elapsed < 5
        elapsed, error = call_within(15, lambda: io.load_checkpoint(f"{uid}.ckpt"))
        assert isinstance(error, RedisTimeoutError) and "load_checkpoint" in str(error), error
    torch.testing.assert_close(io.load_checkpoint(f"{uid}.ckpt")["w"], torch.ones(10))  # the old one survived
    io.teardown()


def test_a_save_that_outlives_its_overall_deadline_is_abandoned(server, uid: str) -> None:
    io = SmartRedisCheckpointIO(server.address, cluster=False, chunk_bytes=4096, timeout_s=0.5)
    saving = threading.Event()
    saving.set()

    def stall() -> None:
        # The server stalls for 0.6 s at a time in the middle of saves of many chunks, until one gives
        # up: a stall over a save's last reply (its publish) only makes that save late, not abandoned.
        time.sleep(0.2)
        while saving.is_set():
            os.kill(server.pids[0], signal.SIGSTOP)
            time.sleep(0.6)
            os.kill(server.pids[0], signal.SIGCONT)
            time.sleep(0.1)

    slow = threading.Thread(target=stall)
    slow.start()
    try:
        elapsed, error = call_within(30, lambda: [io.save_checkpoint({"w": torch.zeros(50_000)}, f"{uid}-{i}.ckpt")
                                                  for i in range(1000)])
    finally:
        saving.clear()
        slow.join()
    assert isinstance(error, RedisTimeoutError) and "0.5 s" in str(error), error
    io.teardown()


def test_run_model_on_a_stopped_server_ends_at_sr_model_timeout(server, uid: str) -> None:
    client = Client(_options(server.address, SR_MODEL_TIMEOUT=2000, SR_CMD_TIMEOUT=1))
    with paused(server.pids[0]):
        elapsed, error = call_within(20, lambda: client.run_script(uid, "double", [uid], [uid + "y"]))
    assert isinstance(error, (RedisTimeoutError, RedisConnectionError)) and uid in str(error), error
    assert elapsed < 5
    client.close()


def test_a_killed_server_fails_calls_at_once(uid: str) -> None:
    with RedisServer() as own:
        client = Client(_options(own.address))
        client.put_tensor(uid, X)
        os.kill(own.pids[0], signal.SIGKILL)
        elapsed, error = call_within(15, lambda: client.get_tensor(uid))
        assert isinstance(error, RedisConnectionError) and "get_tensor" in str(error), error
        assert elapsed < 2


def _plain(orch: Orchestrator) -> redis.Redis:
    return protocol_client(orch.database)


class _Run:
    """A run_script call in a thread of its own, on an Orchestrator with two workers."""

    def __init__(self, orch: Orchestrator, uid: str, function: str) -> None:
        self.client = Client(_options(orch.address, SR_MODEL_TIMEOUT=60_000))
        self.client.set_script(uid, SCRIPT)
        self.client.put_tensor(uid + "x", X)
        self.elapsed: float = 0.0
        self.error: BaseException | None = None

        def run() -> None:
            self.elapsed, self.error = call_within(
                50, lambda: self.client.run_script(uid, function, [uid + "x"], [uid + "y"]))

        self._thread = threading.Thread(target=run)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_replaced_and_unregistered(uid: str) -> None:
    with Orchestrator(workers=2) as orch:
        plain = _plain(orch)
        run = _Run(orch, uid, "slow")
        victim = busy_worker(plain)
        os.kill(registry(plain)[victim].pid, signal.SIGKILL)
        run.join()
        assert run.error is None, run.error
        assert run.elapsed < 20, "retried on the live worker within seconds, not SR_MODEL_TIMEOUT"
        np.testing.assert_allclose(run.client.get_tensor(uid + "y"), X)
        wait_until(lambda: victim not in registry(plain), 10, "the dead worker is unregistered")
        wait_until(lambda: len(registry(plain)) == 2, WORKER_START_S, "a new worker replaces it")
        run.client.close()
        plain.close()


@pytest.mark.slow
def test_a_request_whose_workers_die_twice_fails_fast(uid: str) -> None:
    with Orchestrator(workers=2) as orch:
        plain = _plain(orch)
        run = _Run(orch, uid, "spin")
        first = busy_worker(plain)
        pids = {name: entry.pid for name, entry in registry(plain).items()}
        os.kill(pids[first], signal.SIGKILL)
        second = busy_worker(plain, seconds=15, exclude=frozenset({first}))
        os.kill(registry(plain)[second].pid, signal.SIGKILL)
        run.join()
        assert isinstance(run.error, RedisReplyError), run.error
        assert "died" in str(run.error) and "retried once" in str(run.error)
        assert run.elapsed < 30
        assert not any(entry.running for entry in registry(plain).values())
        run.client.close()
        plain.close()


@pytest.mark.slow
def test_workers_stop_on_sigterm_while_the_database_is_stopped(uid: str) -> None:
    with Orchestrator(workers=1) as orch:
        worker = orch.workers[0]
        with paused(orch.database.pids[0]):
            time.sleep(1.5)  # the worker is blocked on the stopped server
            os.kill(worker.pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while worker.is_running() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not worker.is_running(), "the worker ignored SIGTERM while blocked"


_SAVER = """
import sys, torch
from smartredis_io import SmartRedisCheckpointIO
io = SmartRedisCheckpointIO(sys.argv[1], cluster=False, chunk_bytes=4096)
print("saving", flush=True)
while True:
    io.save_checkpoint({"w": torch.zeros(1 << 20)}, sys.argv[2])
"""


@pytest.mark.slow
def test_a_saver_killed_mid_save_leaves_only_expiring_chunks(server, uid: str) -> None:
    path = f"{uid}.ckpt"
    io = SmartRedisCheckpointIO(server.address, cluster=False, chunk_bytes=4096)
    io.save_checkpoint({"w": torch.ones(8)}, path)
    plain = redis.Redis(host=server.host, port=server.port)
    published = set(plain.keys(f"{{{path}}}.chunk.*"))
    saver = subprocess.Popen([sys.executable, "-c", _SAVER, server.address, path], stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 30
        while len(set(plain.keys(f"{{{path}}}.chunk.*")) - published) < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        saver.kill()
        saver.wait()
    current = wire.decode_header(plain.getrange(path, 0, wire.HEADER_MAX_BYTES - 1), path)
    live = set(k.encode() for k in current.chunk_keys(path))
    leftovers = set(plain.keys(f"{{{path}}}.chunk.*")) - live
    assert leftovers, "the kill happened mid-save"
    assert all(0 < plain.pttl(k) for k in leftovers), "an unpublished chunk would never go away"
    assert all(plain.pttl(k) == -1 for k in live), "published chunks are permanent"
    assert io.load_checkpoint(path)["w"].shape in ((8,), (1 << 20,))  # a whole checkpoint, old or new
    plain.close()
    io.teardown()


_PARENT = """
import json, sys, time
from smartredis_io import Orchestrator
orch = Orchestrator(workers=1).start()
print(json.dumps(orch.database.pids + orch.worker_pids), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_nothing_outlives_a_killed_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "redis-server or a worker outlived its parent"
