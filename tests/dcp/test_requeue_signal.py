"""Lightning's Slurm requeue handler firing on every rank inside a sharded (DCP) save, through the
FastPersist (NVMe) and Dataflux (gs://) storages, with FSDP and ModelParallel on two real gloo ranks.

``SLURMEnvironment(auto_requeue=True)`` saves ``hpc_ckpt_N.ckpt`` from its signal handler, on every
rank the signal reaches, wherever that rank then is. Here each rank gets SIGUSR1 while both ranks
are seen writing their shards of a ``ModelCheckpoint`` save (their shard files, or the part objects
of their shard uploads, are there), as Slurm signals every task of a step. The strategy makes the
handler's save once the interrupted one has ended, on each rank, so that the collectives of the two
saves never mix: both checkpoints load whole on one rank and on two, at the same step, with the same
model and optimizer state, and nothing else is left under the run's root.
"""

from __future__ import annotations

import io
import os
import re
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_storage_plugins.sharded import LIGHTNING_STATE_KEY
from tests.support.dcp_ranks import Ranks
from tests.support.dcp_requeue import (
    JOB_ID,
    STEPS,
    checkpoint_names,
    checkpoint_reader,
    load_items,
    stored_names,
)

# A rank's shard being written: FastPersist's temporary file, or a part object of a Dataflux upload.
_WRITING = {"nvme": re.compile(r"^\.__(\d+)_0\.[0-9a-f]+\.distcp\..*\.fastpersist\.tmp$"),
            "gs": re.compile(r"/__(\d+)_0\.[0-9a-f]+\.distcp\.dataflux-parts/")}
WORLD = 2


def _writing(storage: str, root: str, client: Any) -> set[int]:
    """The ranks seen writing a shard under ``root`` now."""
    if storage == "nvme":
        found = set()
        for directory in Path(root, "checkpoints").glob("*"):
            try:
                names = os.listdir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            found |= {int(m.group(1)) for m in map(_WRITING["nvme"].match, names) if m}
        return found
    return {int(m.group(1)) for m in map(_WRITING["gs"].search, stored_names(storage, root, client)) if m}


class _RequeueSignals:
    """Sends SIGUSR1 to every rank, once per run root, the first time all ranks are seen writing
    their shards under that root at once (so each handler runs inside the same collective save)."""

    def __init__(self, ranks: Ranks, roots: list[tuple[str, str]]) -> None:
        self._ranks, self._roots = ranks, roots
        self._stop = threading.Event()
        self.sent: list[str] = []
        self._thread = threading.Thread(target=self._watch, name="requeue-signals", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from google.cloud import storage as gcs

        client = gcs.Client()
        for storage, root in self._roots:
            while not self._stop.is_set():
                if _writing(storage, root, client) == set(range(WORLD)):
                    for pid in self._ranks.pids():
                        os.kill(pid, signal.SIGUSR1)
                    self.sent.append(root)
                    break
                self._stop.wait(0.001)  # a listing: there is nothing to wait on

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _scontrol(bin_dir: Path) -> Path:
    """A stand-in ``scontrol`` in ``bin_dir`` that records its arguments (Slurm itself is not needed
    to see what the handler asks of it); where it records them."""
    bin_dir.mkdir(parents=True)
    record = bin_dir / "scontrol.log"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    return record


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_the_slurm_handler_firing_on_every_rank_inside_a_sharded_save_leaves_both_checkpoints_whole(
    kind: str, gs_root: str, nvme_root: Path, tmp_path: Path
) -> None:
    if kind == "model_parallel" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7):
        pytest.skip("FSDP2 (fully_shard) cannot train on CPU before torch 2.7 (CPU streams lack record_event)")
    roots = [("nvme", str(nvme_root / kind)), ("gs", f"{gs_root}/{kind}")]
    records = {root: _scontrol(tmp_path / f"bin-{storage}") for storage, root in roots}
    steps = [{"op": "lightning_requeue", "kind": kind, "storage": storage, "root": root,
              "bin": str(tmp_path / f"bin-{storage}")} for storage, root in roots]
    with Ranks(steps, WORLD, tmp_path, timeout_s=600) as ranks:
        signals = _RequeueSignals(ranks, roots)
        try:
            reports = ranks.join()
        finally:
            signals.stop()
    assert signals.sent == [root for _, root in roots]
    for index, (storage, root) in enumerate(roots):
        outcomes = [report["steps"][index] for report in reports if report is not None]
        hpc = f"{root}/hpc_ckpt_1.ckpt"
        for rank, outcome in enumerate(outcomes):
            assert outcome.get("hpc") == hpc, f"{storage} rank {rank}: {outcome['log']}"
            assert f"saving {hpc} done" in " ".join(outcome["log"])
        outer = outcomes[0]["outer"]
        assert [outcome["outer"] for outcome in outcomes] == [outer] * WORLD
        step = int(re.search(r"step=(\d+)", outer).group(1))
        assert os.path.dirname(outer) == f"{root}/checkpoints"
        assert records[root].read_text().split() == ["requeue", JOB_ID]

        # On two ranks: Trainers resumed from either start from the same step, model and optimizer.
        for outcome in outcomes:
            assert outcome["resumed_at"] == [step, step], storage
            assert outcome["same_model"] and outcome["same_optimizer"], storage

        # On one rank: every item of both, whole (on gs://, checked against its crc32c), the same.
        whole = [load_items(checkpoint_reader(storage, path)) for path in (outer, hpc)]
        assert whole[0].keys() == whole[1].keys()
        tensors = [key for key, value in whole[0].items() if isinstance(value, torch.Tensor)]
        assert len(tensors) >= 6, storage  # the model's and the optimizer's states are there
        assert all(torch.equal(whole[0][key], whole[1][key]) for key in tensors), storage
        states = [torch.load(io.BytesIO(state[LIGHTNING_STATE_KEY]), weights_only=True) for state in whole]
        assert [state["global_step"] for state in states] == [step, step]

        # Nothing else under the root: each checkpoint holds its .metadata, the files it names and, on
        # gs://, its commit record.
        checkpoints = [f"checkpoints/epoch=0-step={n}.ckpt" for n in range(1, STEPS + 1)] + ["hpc_ckpt_1.ckpt"]
        assert stored_names(storage, root) == checkpoint_names(storage, root, checkpoints), storage


@pytest.mark.slow
def test_a_signal_that_reaches_one_rank_alone_ends_the_run_within_the_collectives_timeout(
    nvme_root: Path, tmp_path: Path
) -> None:
    """What the strategy cannot make safe, bounded: the signal reaches rank 0 alone, inside a sharded
    save (as ``--signal=B:USR1`` forwarded to one task would). Lightning's handler on rank 0 starts
    its own collectives there, which meet rank 1's save collectives; the backend fails them (gloo
    detects the mismatch and ends that rank, or they time out), so the run ends within the process
    group's timeout, not later, and no checkpoint is left half written under its name."""
    root, timeout_s = str(nvme_root / "one-rank"), 15.0
    _scontrol(tmp_path / "bin")
    steps = [{"op": "lightning_requeue", "kind": "fsdp", "storage": "nvme", "root": root, "bin": str(tmp_path / "bin"),
              "options": {"timeout_s": timeout_s}}]
    sent_at: list[float] = []
    with Ranks(steps, WORLD, tmp_path, timeout_s=600) as ranks:

        def signal_rank_zero() -> None:
            while not ranks.exited():
                if 0 in _writing("nvme", root, None):
                    os.kill(ranks.pids()[0], signal.SIGUSR1)
                    sent_at.append(time.monotonic())
                    return
                threading.Event().wait(0.001)  # a listing: there is nothing to wait on

        watcher = threading.Thread(target=signal_rank_zero, daemon=True)
        watcher.start()
        reports = ranks.finish()
        ended_at = time.monotonic()
        watcher.join()
    assert sent_at, "rank 0 was never seen writing its shard"
    # A few timeouts: the handler's collectives, then what the failed save and Lightning's clean-up wait for.
    assert ended_at - sent_at[0] < 8 * timeout_s
    outcomes = [report["steps"][0] if report else None for report in reports]
    # Each rank failed (a report naming its error), or was ended by the backend; none trained on as
    # if nothing had happened.
    for rank, outcome in enumerate(outcomes):
        assert outcome is None or "error" in outcome, f"rank {rank} trained on: {outcome}"
    # Whatever is stored under a checkpoint's name is whole: a checkpoint with its .metadata loads.
    for directory in sorted(Path(root).glob("**/*.ckpt")):
        if (directory / ".metadata").exists():
            load_items(checkpoint_reader("nvme", str(directory)))
