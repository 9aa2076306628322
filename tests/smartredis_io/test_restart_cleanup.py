"""A restart removes the chunks of SmartRedis saves killed in the middle, and never a live save's.

Real processes and real signals on a real redis-server: children save checkpoints through
``SmartRedisCheckpointIO`` over and over; one is killed with SIGKILL in the middle of a save, the
other stopped with SIGSTOP (alive, its save unfinished) while a Trainer starts on the directory.
Their chunks would expire by themselves only a minute after the save's 30-minute deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable

import pytest
import redis
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from smartredis_io import SmartRedisCheckpointIO, SmartRedisModelCheckpoint
from smartredis_io._client import wire
from smartredis_io.error import RedisInternalError
from tests.support.processes import wait_for
from tests.support.redis_faults import deaths

SAVER = """
import sys, torch
from smartredis_io import SmartRedisCheckpointIO
io = SmartRedisCheckpointIO(sys.argv[1], cluster=False, chunk_bytes=4096)
print("saving", flush=True)
while True:
    io.save_checkpoint({"w": torch.zeros(1 << 18)}, sys.argv[2])
"""


def _owned(plain: redis.Redis, pid: int) -> set[bytes]:
    """The owner keys of saves by process ``pid`` now in the database."""
    return {name for name in plain.scan_iter(match=wire.OWNER_KEY_PATTERN)
            if f".p{pid}.".encode() in (plain.get(name) or b"").replace(b"\n", b".\n")}


def _unpublished_chunks(plain: redis.Redis, key: str) -> set[bytes]:
    """The chunk keys of ``key`` that its published header does not name."""
    raw = plain.getrange(key, 0, wire.HEADER_MAX_BYTES - 1)
    published = set(wire.decode_header(raw, key).chunk_keys(key)) if raw else set()
    return {name for name in plain.scan_iter(match=f"{{{key}}}.chunk.*")
            if name.decode() not in published and not name.endswith(wire.OWNER_SUFFIX.encode())}


def _saver(address: str, key: str) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", SAVER, address, key], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "saving"
    return child


def _stop_inside_a_save(plain: redis.Redis, child: subprocess.Popen[str]) -> None:
    """Stop ``child`` (SIGSTOP) at a moment when it is inside a save: its owner record is stored."""
    for _ in range(100):
        wait_for(lambda: _owned(plain, child.pid), "a save in progress", child=child)
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: _state(child.pid) == "T", "the saver stopped")
        if _owned(plain, child.pid):
            return
        os.kill(child.pid, signal.SIGCONT)  # stopped between two saves: try again
    raise AssertionError("the saver was never stopped inside a save")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


class KeysAtStart(Callback):
    """Records, when training starts (after the preflight, before any save), what a probe returns."""

    def __init__(self, probe: Callable[[], object]) -> None:
        self.probe, self.found = probe, None

    def on_train_start(self, trainer: Trainer, pl_module: BoringModel) -> None:
        self.found = self.probe()


@pytest.mark.slow
def test_a_trainer_start_removes_a_killed_saves_chunks_and_keeps_a_stopped_saves(
        redis_server, monkeypatch, caplog) -> None:
    monkeypatch.setenv("SSDB", redis_server.address)  # how Lightning's redis:// filesystem finds the database
    run = f"run-{uuid.uuid4().hex[:8]}"
    killed_key, stopped_key = f"{run}/last.ckpt", f"{run}/epoch=1.ckpt"
    plain = redis.Redis(host=redis_server.host, port=redis_server.port)
    killed, stopped = _saver(redis_server.address, killed_key), _saver(redis_server.address, stopped_key)
    try:
        _stop_inside_a_save(plain, killed)
        killed.kill()
        killed.wait(30)
        left = _owned(plain, killed.pid) | _unpublished_chunks(plain, killed_key)
        assert _owned(plain, killed.pid), "the killed save left its owner record"
        assert all(0 < plain.pttl(name) for name in left), "they would expire only after the save's deadline"

        _stop_inside_a_save(plain, stopped)
        try:
            stopped_owner, stopped_chunks = _owned(plain, stopped.pid), _unpublished_chunks(plain, stopped_key)
            start = KeysAtStart(lambda: (_owned(plain, killed.pid), _unpublished_chunks(plain, killed_key),
                                         _owned(plain, stopped.pid), _unpublished_chunks(plain, stopped_key)))
            trainer = Trainer(max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                              enable_model_summary=False, accelerator="cpu", devices=1,
                              plugins=[SmartRedisCheckpointIO(redis_server.address, cluster=False)],
                              callbacks=[start, SmartRedisModelCheckpoint(dirpath=f"redis://{run}", save_last=True)])
            trainer.fit(BoringModel())
            assert start.found == (set(), set(), stopped_owner, stopped_chunks)
            assert f"its process (pid {killed.pid}) on this machine has exited" in caplog.text
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        # Let go, the stopped save finishes what it was writing: a whole checkpoint. The saver then
        # saves again at once, in a loop; it is killed so that no later save overwrites the value
        # while it is read (a kill in the middle of a save leaves the published value as it was).
        wait_for(lambda: not (_owned(plain, stopped.pid) & stopped_owner), "the stopped save's publish")
        stopped.kill()
        stopped.wait(30)
        assert torch.equal(SmartRedisCheckpointIO(redis_server.address, cluster=False)
                           .load_checkpoint(f"redis://{stopped_key}")["w"], torch.zeros(1 << 18))
    finally:
        for child in (killed, stopped):
            child.kill()
            child.wait(30)
        plain.close()


def test_a_writer_whose_chunks_were_removed_publishes_nothing(redis_server) -> None:
    """A clean-up that took a live writer for a dead one (a straggler of an earlier Slurm attempt):
    that writer's publish finds its chunks gone and fails, and the previous value stays."""
    key = f"straggler-{uuid.uuid4().hex[:8]}/last.ckpt"
    io = SmartRedisCheckpointIO(redis_server.address, cluster=False, chunk_bytes=4096)
    io.save_checkpoint({"w": torch.ones(4)}, f"redis://{key}")
    plain = redis.Redis(host=redis_server.host, port=redis_server.port)
    with pytest.raises(RedisInternalError, match="removed before the value was published"):
        with io.db.operation(30), wire.ChunkedWriter(io.db, key, 4096, owner="p1") as writer:
            writer.write(b"x" * 20000)
            records = [wire.read_owner_key(io.db, name.decode()) for name in plain.scan_iter(match=wire.OWNER_KEY_PATTERN)]
            (version,) = [record[1] for record in records if record is not None and record[0] == key]
            assert wire.delete_unpublished(io.db, key, version) == 4
    assert torch.equal(io.load_checkpoint(f"redis://{key}")["w"], torch.ones(4))
    assert not _unpublished_chunks(plain, key) and not list(plain.scan_iter(match=f"{{{key}}}.chunk.*.owner"))
    plain.close()
    io.teardown()


def _save(address: str, key: str, value: torch.Tensor) -> None:
    io = SmartRedisCheckpointIO(address, cluster=False, chunk_bytes=4096)
    try:
        io.save_checkpoint({"w": value}, f"redis://{key}")
    finally:
        io.teardown()


def test_a_save_killed_before_any_of_its_commands_leaves_the_old_or_new_value_and_only_keys_that_expire(
        redis_server, monkeypatch) -> None:
    """A save that replaces a chunked checkpoint dies before its n-th command, for every n: the key
    loads the old checkpoint or the new one, whole, and every other key it wrote or replaced expires."""
    plain = redis.Redis(host=redis_server.host, port=redis_server.port)
    old, new = torch.full((3000,), 1.0), torch.full((3000,), 2.0)
    key = f"killed-{uuid.uuid4().hex[:8]}/last.ckpt"
    killed = 0
    for where in deaths(monkeypatch, lambda: _save(redis_server.address, key, new),
                        lambda: _save(redis_server.address, key, old)):
        killed += 1
        loaded = SmartRedisCheckpointIO(redis_server.address, cluster=False).load_checkpoint(f"redis://{key}")["w"]
        assert torch.equal(loaded, old) or torch.equal(loaded, new), where
        header = wire.decode_header(plain.getrange(key, 0, wire.HEADER_MAX_BYTES - 1), key)
        kept = {name.encode() for name in header.chunk_keys(key)} | {key.encode()}
        lasting = [name for name in plain.scan_iter(match=f"*{key}*") if name not in kept and plain.pttl(name) < 0]
        assert not lasting, f"{where}: these never expire"
    assert killed > 8, "the save sends its chunks, its owner record and its publish"
    plain.close()
