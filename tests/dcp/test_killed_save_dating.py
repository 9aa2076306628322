"""A sharded save killed before its commit never makes an older checkpoint look newest to Lightning.

``ckpt_path="last"`` takes the candidate whose modification time (as fsspec gives it) is the latest:
``last.ckpt`` and ``OnExceptionCheckpoint``'s ``on_exception.ckpt``. Each run here, under the recovery
job (Lightning's ``FSDPStrategy`` on one rank through the plugin's DCP storage, ``ModelCheckpoint(
save_last=True)`` and ``OnExceptionCheckpoint``): a whole ``last.ckpt``; a SIGTERM, on which Lightning
saves a newer ``on_exception.ckpt`` and exits; a restart from it; a SIGKILL in the next save of
``last.ckpt``, once a file of that save is in the storage and before it commits; and a restart that
must resume from ``on_exception.ckpt``, the newest whole checkpoint, not from the older ``last.ckpt``.

Before, the killed save's files dated the ``last.ckpt`` directory on a local disk (the restart resumed
from it, steps older), and on gs:// Lightning could not date a sharded checkpoint at all
(``KeyError: 'mtime'``: the restart died).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.recovery.events import ForkServer, of_process, preempt
from benchmarks.recovery.job import CHECKPOINT_SUBDIR
from lightning_storage_plugins.dcp import LOCK_NAME, METADATA_NAME
from tests.support.direct_io import o_direct_dir
from tests.support.recovery import Rounds, Storage

# A checkpoint large enough that its save lasts well beyond the storage's polling below.
JOB = {"size_mb": 24.0, "every_n_steps": 4, "save_top_k": 0, "strategy": "fsdp"}
# Tries at a kill that lands between a file of the save appearing and its commit.
ATTEMPTS = 4
POLL_S = 0.005


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ForkServer]:
    """A process that has imported torch, Lightning and the plugins, forking every start of the job."""
    with ForkServer() as server:
        yield server


@pytest.fixture
def storage(plugin: str, request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    run = f"run-{uuid.uuid4().hex[:8]}"
    if plugin == "dataflux-dcp":
        bucket = request.getfixturevalue("gcs_bucket")
        return Storage(plugin, f"gs://{bucket}/{run}", gcs_url=request.getfixturevalue("gcs_emulator").url)
    return Storage(plugin, str(o_direct_dir(tmp_path) / run))


def committed(storage: Storage, name: str) -> bytes | None:
    """The ``.metadata`` of the checkpoint ``name`` in the run's checkpoint directory (None: none)."""
    relative = f"{CHECKPOINT_SUBDIR}/{name}/{METADATA_NAME}"
    if storage.root.startswith("gs://"):
        bucket, prefix = storage._bucket()
        blob = bucket.get_blob(f"{prefix}/{relative}")
        return None if blob is None else blob.download_as_bytes()
    path = Path(storage.root) / relative
    return path.read_bytes() if path.exists() else None


def kill_when_written(rounds: Rounds, job: Any, name: str) -> bool:
    """SIGKILL ``job`` as soon as a file of its next save of ``name`` is in the storage (not its save
    lock); whether the kill landed before that save committed."""
    pid = job.pid
    rounds.follower.wait_for(lambda e: e["event"] == "save_start" and e["pid"] == pid
                             and e["path"].endswith(f"/{name}"), 120, f"a save of {name}", job=job)
    before_names = set(rounds.storage.names())
    before = committed(rounds.storage, name)
    deadline = time.monotonic() + 120
    while not any(not n.endswith(LOCK_NAME) and n not in before_names for n in rounds.storage.names()):
        assert job.poll() is None and time.monotonic() < deadline, f"no file of the save of {name} appeared"
        time.sleep(POLL_S)
    os.kill(pid, signal.SIGKILL)
    job.wait(60)
    rounds.follower.poll()
    return committed(rounds.storage, name) == before


@pytest.mark.recovery
@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["fastpersist-dcp", "dataflux-dcp"])
def test_a_save_killed_before_its_commit_leaves_the_newer_checkpoint_newest(
        plugin: str, storage: Storage, fork_server: ForkServer, tmp_path: Path) -> None:
    rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=1)
    config = storage.config(rounds.log_path, **JOB)
    current = rounds.start(config)
    landed = 0
    for _ in range(ATTEMPTS):
        pid = current.job.pid
        whole = rounds.follower.wait_for(lambda e, pid=pid: e["event"] == "save_end" and e["pid"] == pid
                                         and e["path"].endswith("/last.ckpt"), 120, "a whole last.ckpt",
                                         job=current.job, since=0)
        rounds.follower.wait_for(lambda e, pid=pid, step=whole["step"]: of_process(pid, "step")(e)
                                 and e["step"] > step, 120, "a step after it", job=current.job, since=0)
        preempt(current.job, rounds.follower, grace_s=120, log=rounds.log)
        assert any(e["event"] == "save_end" and e["pid"] == pid and e["path"].endswith("/on_exception.ckpt")
                   for e in rounds.follower.events), "Lightning saved no on_exception.ckpt on SIGTERM"
        current = rounds.start(config)
        rounds.assert_resumed(current)
        before_kill = current.started
        landed += kill_when_written(rounds, current.job, "last.ckpt")
        current = rounds.start(config)
        rounds.assert_resumed(current)
        if landed:
            assert current.started["ckpt_path"].endswith("on_exception.ckpt"), current.started
            assert current.started["step"] == before_kill["step"], rounds.summary()
            break
    current.job.send(signal.SIGKILL)
    current.job.wait(60)
    assert landed, f"no kill landed before its save committed in {ATTEMPTS} tries:\n{rounds.summary()}"
