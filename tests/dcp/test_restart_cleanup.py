"""A restart under the sharded strategies removes what a killed sharded (DCP) save left, and never what a
live save is writing: FastPersist's DCP storage (NVMe) and Dataflux's (gs://), on two real gloo ranks.

Two ranks train with a ``ModelCheckpoint`` saving after every step (each checkpoint its own directory or
prefix) until the test sees a shard being written into a checkpoint after the first (FastPersist's
temporary file, or a part object of a Dataflux upload) and SIGKILLs both ranks. Meanwhile another
process saves into the same directory and is held in the middle of its save. A new Trainer under the
same strategy then resumes from the newest whole checkpoint: when training starts, the killed save's
files, temporaries, part objects and save lock are gone, every checkpoint holds exactly what its
``.metadata`` names, the live save's temporaries and lock are still there (it then publishes whole),
and the run trains on from the checkpoint's step.

In one process, with precise leftovers (no kill needed to make a file): what a restart removes and
what it leaves (torch's ``FileSystemWriter`` files, a checkpoint whose metadata it cannot read), and
the names it counts as its saves' (hypothesis).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from lightning_storage_plugins.dcp import LOCK_NAME, METADATA_NAME, is_leftover, shard_name
from lightning_storage_plugins.services import die_with_parent
from tests.support.dcp_ranks import Ranks, load_whole
from tests.support.dcp_requeue import checkpoint_reader, referenced_files
from tests.support.dcp_restart import (
    CHECKPOINTS,
    LIVE,
    checkpoints,
    newest_whole,
    stored_names,
    writing_after,
)
from tests.support.processes import wait_for

WORLD = 2
CASES = [("nvme", "fsdp"), ("gs", "fsdp"), ("nvme", "model_parallel")]
FSDP2_ON_CPU = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7)
# Temporaries of a save in progress, relative to its checkpoint.
_TEMPORARY = {"nvme": lambda name: name.endswith(".fastpersist.tmp"), "gs": lambda name: ".dataflux-parts/" in name}


class _LiveSave:
    """A save into ``path`` by another process, held in the middle until :meth:`finish`."""

    def __init__(self, storage: str, path: str, workdir: Path) -> None:
        token = uuid.uuid4().hex[:6]
        self.held, self.go, self.report = (workdir / f"{what}-{token}" for what in ("held", "go", "report"))
        spec = {"storage": storage, "path": path, "seed": 7, "held": str(self.held), "go": str(self.go),
                "report": str(self.report)}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.support.dcp_restart", json.dumps(spec)],
                                        preexec_fn=die_with_parent)

    def finish(self) -> bool:
        """Let the save go on; whether it published."""
        self.go.touch()
        self.process.wait(timeout=120)
        return self.report.exists() and json.loads(self.report.read_text())["saved"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _kill_in_a_save(ranks: Ranks, storage: str, root: str) -> None:
    """SIGKILL every rank the first time a shard is seen being written into a checkpoint after step 1
    (so that a whole one is there to resume from)."""
    def writing() -> bool:
        return writing_after(storage, stored_names(storage, root), 1)

    wait_for(writing, "a rank writing its shard of a checkpoint after step 1", timeout_s=400,
             child=ranks._launcher)
    for rank in range(WORLD):
        ranks.kill(rank)


def _whole_and_clean(storage: str, root: str, name: str, files: list[str]) -> bool:
    """Whether a checkpoint holds its ``.metadata`` and exactly the files that names."""
    if METADATA_NAME not in files:
        return False
    return set(files) == {METADATA_NAME} | referenced_files(checkpoint_reader(storage, f"{root}/{CHECKPOINTS}/{name}"))


@pytest.mark.slow
@pytest.mark.parametrize(("storage", "kind"), CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_a_restart_removes_what_a_killed_sharded_save_left_and_keeps_a_live_save(
    storage: str, kind: str, gs_root: str, nvme_root: Path, tmp_path: Path
) -> None:
    if kind == "model_parallel" and not FSDP2_ON_CPU:
        pytest.skip("FSDP2 (fully_shard) cannot train on CPU before torch 2.7 (CPU streams lack record_event)")
    root = gs_root if storage == "gs" else str(nvme_root)
    live = _LiveSave(storage, f"{root}/{CHECKPOINTS}/{LIVE}", tmp_path)
    try:
        train = {"op": "lightning_restart", "kind": kind, "storage": storage, "root": root, "phase": "train"}
        with Ranks([train], WORLD, tmp_path, timeout_s=600) as ranks:
            _kill_in_a_save(ranks, storage, root)
            ranks.finish()
        wait_for(lambda: live.held.exists() and any(
            _TEMPORARY[storage](name) for name in checkpoints(stored_names(storage, root)).get(LIVE, [])),
            "the live save holding its temporaries", timeout_s=300, child=live.process)

        before = checkpoints(stored_names(storage, root))
        killed = {name: files for name, files in before.items()
                  if name != LIVE and not _whole_and_clean(storage, root, name, files)}
        assert killed, f"the kill left nothing to remove (the save finished first): {sorted(before)}"
        resume = newest_whole(stored_names(storage, root))
        assert resume is not None, before
        step = int(resume.split("step=")[1].split(".")[0])

        restart = {**train, "phase": "restart", "ckpt_path": f"{root}/{CHECKPOINTS}/{resume}"}
        with Ranks([restart], WORLD, tmp_path, timeout_s=600) as ranks:
            reports = [report["steps"][0] for report in ranks.join() if report is not None]
        assert [report["resumed_at"] for report in reports] == [step] * WORLD, reports
        assert [report["ended_at"] for report in reports] == [step + 1] * WORLD, reports
        at_start = checkpoints(reports[0]["names_at_start"])
        log = "\n".join(reports[0]["log"])
        print(f"killed saves left {killed}; resumed from {resume}; the sweep logged:\n{log}")

        for name, files in at_start.items():
            if name != LIVE:
                assert _whole_and_clean(storage, root, name, files), (
                    f"{name} held {sorted(files)} when training started; before the restart it held "
                    f"{sorted(before.get(name, []))}\n{log}")
        for name, files in killed.items():
            if METADATA_NAME not in files:
                assert name not in at_start, f"{name} was left: {at_start[name]}\n{log}"
                assert name in log, f"the sweep did not say it removed {name}:\n{log}"
        live_files = at_start[LIVE]
        assert any(name.endswith(LOCK_NAME) for name in live_files) and any(
            _TEMPORARY[storage](name) for name in live_files), (
            f"the live save's lock and temporaries were not kept: {sorted(live_files)}\n{log}")

        assert live.finish(), "the live save did not publish"
        live_path = f"{root}/{CHECKPOINTS}/{LIVE}"
        assert load_whole(checkpoint_reader(storage, live_path), 7) == []
        assert _whole_and_clean(storage, root, LIVE, checkpoints(stored_names(storage, root))[LIVE])
    finally:
        live.kill()


# One process, precise leftovers ---------------------------------------------------------------------
def _writer(storage: str, path: str) -> Any:
    if storage == "gs":
        from dataflux_ckpt import DatafluxStorageWriter

        return DatafluxStorageWriter(path, chunk_size=64 * 1024, max_workers=2)
    from fastpersist import FastPersistStorageWriter

    return FastPersistStorageWriter(path, io_buffer_mb=1)


def _put(storage: str, path: str, name: str, data: bytes = b"x") -> None:
    if storage == "gs":
        from google.cloud import storage as gcs

        from dataflux_ckpt import parse_gcs_path

        bucket, key = parse_gcs_path(path)
        gcs.Client().bucket(bucket).blob(f"{key}/{name}").upload_from_string(data)
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    Path(path, name).write_bytes(data)


@pytest.mark.parametrize("storage", ["nvme", "gs"])
def test_a_restart_removes_only_our_saves_files_that_no_checkpoint_references(
    storage: str, gs_root: str, nvme_root: Path
) -> None:
    root = gs_root if storage == "gs" else str(nvme_root)
    state = {"w": torch.randn(64, 32), "meta": {"step": 3}}
    dcp.save(state, storage_writer=_writer(storage, f"{root}/whole"))
    dead = "0123456789ab"
    _put(storage, f"{root}/whole", shard_name(0, dead))           # a later save to it, killed
    _put(storage, f"{root}/killed", shard_name(1, dead))          # a save to a new path, killed
    _put(storage, f"{root}/killed", METADATA_NAME + ".1a2b3c4d.tmp")
    _put(storage, f"{root}/torch", "__0_0.distcp")                # torch's FileSystemWriter, killed
    _put(storage, f"{root}/torch", METADATA_NAME + ".tmp")
    _put(storage, f"{root}/unreadable", shard_name(0, dead))
    _put(storage, f"{root}/unreadable", METADATA_NAME, pickle.dumps({"not": "metadata"}))
    _put(storage, f"{root}/unreadable", shard_name(1, dead))

    directory = _writer(storage, root)
    found = directory.leftover_checkpoints()
    assert found == sorted(f"{directory.checkpoint_id}/{name}" for name in ("killed", "unreadable", "whole"))
    removed = {path.rsplit("/", 1)[1]: _writer(storage, path).remove_leftovers() for path in found}
    assert removed == {"killed": 2, "unreadable": 0, "whole": 1}

    left = checkpoints([f"{CHECKPOINTS}/{name}" for name in stored_names(storage, root)])
    assert "killed" not in left
    assert sorted(left["torch"]) == [METADATA_NAME + ".tmp", "__0_0.distcp"]
    assert sorted(left["unreadable"]) == sorted([METADATA_NAME, shard_name(0, dead), shard_name(1, dead)])
    assert len(left["whole"]) == 2 and shard_name(0, dead) not in left["whole"]
    loaded = {"w": torch.zeros(64, 32), "meta": {"step": -1}}
    dcp.load(loaded, storage_reader=checkpoint_reader(storage, f"{root}/whole"))
    assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"step": 3}


@pytest.mark.parametrize("left", ["shards and commit record", "commit record", "nothing", "a full checkpoint"])
def test_a_checkpoint_a_killed_removal_left_in_part_is_removed_by_the_strategy_after_gcsfs_listed_it(
    left: str, gs_root: str
) -> None:
    """ModelCheckpoint removes its older checkpoints through the strategy. A rank killed inside such a
    removal (after ``.metadata``), and the restart's sweep, leave part of the checkpoint or none of it;
    the resumed run removes it again (the top-k it loaded still names it) after Lightning listed the
    directory through fsspec's gcsfs at the start of fit. Whatever is left goes, a full checkpoint's
    object at the name too, and nothing left is no error (as Lightning's own strategies)."""
    from fsspec.core import url_to_fs
    from google.cloud import storage as gcs

    from dataflux_ckpt import DatafluxFSDPStrategy, parse_gcs_path

    path = f"{gs_root}/epoch=0-step=1.ckpt"
    strategy = DatafluxFSDPStrategy(state_dict_type="sharded", writer_options={"chunk_size": 64 * 1024})
    bucket_name, key = parse_gcs_path(path)
    bucket = gcs.Client().bucket(bucket_name)
    if left == "a full checkpoint":
        bucket.blob(key).upload_from_string(pickle.dumps({"state_dict": {}}))
    else:
        dcp.save({"w": torch.randn(64, 32)}, storage_writer=_writer("gs", path))
    filesystem, stripped = url_to_fs(gs_root)
    assert filesystem.find(stripped), "gcsfs listed the directory (and keeps that listing)"
    keep = {"shards and commit record": lambda name: name != f"{key}/{METADATA_NAME}",
            "commit record": lambda name: name == key, "nothing": lambda name: False,
            "a full checkpoint": lambda name: True}[left]
    for blob in list(bucket.list_blobs(prefix=key)):
        if not keep(blob.name):
            blob.delete()

    strategy.remove_checkpoint(path)
    assert stored_names("gs", gs_root) == []
    strategy.remove_checkpoint(path)  # nothing there: nothing to do


def test_a_restart_leaves_a_checkpoint_whose_save_lock_another_writer_holds(nvme_root: Path) -> None:
    """The save lock is what tells a live save: held (here by a writer of this process, through
    another open file, as another process would hold it), nothing under it is touched."""
    from fastpersist.dcp import _lock_directory

    path = str(nvme_root / "busy")
    _put("nvme", path, shard_name(0, "0123456789ab"))
    lock = _lock_directory(path)
    try:
        assert _writer("nvme", path).remove_leftovers() == 0
        assert shard_name(0, "0123456789ab") in os.listdir(path)
    finally:
        lock.release()
    assert _writer("nvme", path).remove_leftovers() == 1
    assert not os.path.exists(path)


def test_a_restart_keeps_within_its_time(nvme_root: Path) -> None:
    """A sweep whose time has run out removes nothing more, and says so."""
    path = str(nvme_root / "late")
    _put("nvme", path, shard_name(0, "0123456789ab"))
    assert _writer("nvme", path).remove_leftovers(timeout_s=1e-9) == 0
    assert shard_name(0, "0123456789ab") in os.listdir(path)


_TOKENS = st.text("0123456789abcdef", min_size=12, max_size=12)


@given(rank=st.integers(0, 10_000), index=st.integers(0, 9), token=_TOKENS,
       suffix=st.sampled_from(["", ".1234-abcd0123.fastpersist.tmp", ".uploaded",
                               ".dataflux-parts/" + "a" * 32 + "-30s-p1/000001.dataflux-part"]))
def test_our_saves_files_are_leftovers_and_torchs_are_not(rank: int, index: int, token: str, suffix: str) -> None:
    name = shard_name(rank, token, index) + suffix
    assert is_leftover(("." + name) if suffix.endswith(".fastpersist.tmp") else name)
    assert not is_leftover(f"__{rank}_{index}.distcp" + suffix)  # torch's FileSystemWriter: no token
    assert not is_leftover(shard_name(rank, token[:-1], index) + suffix)  # not a token of our saves
    assert not is_leftover(METADATA_NAME) and not is_leftover(LOCK_NAME)
    assert not is_leftover(METADATA_NAME + ".tmp")  # FileSystemWriter's temporary of .metadata

