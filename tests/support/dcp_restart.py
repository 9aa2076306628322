"""A sharded (DCP) Lightning run killed in a save, and its restart, on two real gloo ranks started by
:mod:`tests.support.dcp_ranks` with torchrun's environment; and a save left running beside them.

``train``: a Trainer with a plugin's sharded strategy saves a checkpoint after every step (each its
own directory or prefix) until the test SIGKILLs every rank in the middle of a save.

``restart``: a new Trainer under the same strategy resumes from the checkpoint the test names. When
training starts, rank zero records what the storage holds (the strategy's sweep has run then) and the
log lines of the sweep; it trains one more step, which saves.

``python -m tests.support.dcp_restart SPEC``: a save of its own, in this process alone, into the same
checkpoint directory, held in the middle (its temporary file or part objects there, its save lock
held) until the test lets it go: the save of a live process, which a restart must leave alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

#: Transfer options of the gs:// runs: parts small enough that each shard goes up in many of them.
GS_WRITER_OPTIONS = {"chunk_size": 256 * 1024, "max_workers": 2}
#: Width of the model's hidden layers: shards large enough that writing them takes a while.
HIDDEN = {"gs": 1024, "nvme": 1536}
#: Where the ModelCheckpoint of every run saves, under the run's root.
CHECKPOINTS = "checkpoints"
#: The live save's checkpoint, in the same directory.
LIVE = "live.ckpt"
#: Loggers whose lines say what the sweep removed.
SWEEP_LOGGERS = ("lightning_storage_plugins.dcp", "fastpersist.dcp", "fastpersist.writer", "dataflux_ckpt.upload",
                 "dataflux_ckpt.dcp", "dataflux_ckpt.dcp_objects")
# A rank's shard being written: FastPersist's temporary file, or a part object of a Dataflux upload.
_WRITING = {"nvme": re.compile(r"^\.__\d+_0\.[0-9a-f]{12}\.distcp\..*\.fastpersist\.tmp$"),
            "gs": re.compile(r"^__\d+_0\.[0-9a-f]{12}\.distcp\.dataflux-parts/")}
_STEP = re.compile(r"step=(\d+)")
_BESIDE = re.compile(r"^\.(?P<checkpoint>.+?)\.(?:[0-9a-f]{12}\.dcp-save|dcp-save\.lock)$")


def _strategy(kind: str, storage: str) -> Any:
    if storage == "gs":
        from dataflux_ckpt import DatafluxFSDPStrategy as FSDP
        from dataflux_ckpt import DatafluxModelParallelStrategy as ModelParallel

        options: dict[str, Any] = {"writer_options": dict(GS_WRITER_OPTIONS)}
    else:
        from fastpersist import FastPersistFSDPStrategy as FSDP
        from fastpersist import FastPersistModelParallelStrategy as ModelParallel

        options = {"writer_options": {"io_buffer_mb": 4}}
    if kind == "fsdp":
        return FSDP(state_dict_type="sharded", **options)
    return ModelParallel(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1, **options)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def run_phase(kind: str, storage: str, root: str, phase: str, ckpt_path: str | None = None) -> dict[str, Any]:
    """One rank's ``train`` (until killed) or ``restart`` (from ``ckpt_path``): see the module."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from tests.support.dcp_lightning import model_class

    Model = model_class(kind, (HIDDEN[storage], HIDDEN[storage]))
    report: dict[str, Any] = {}
    lines = _Lines()
    for name in SWEEP_LOGGERS:
        logging.getLogger(name).addHandler(lines)
        logging.getLogger(name).setLevel(logging.INFO)

    class AtStart(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            report["resumed_at"] = trainer.global_step
            if trainer.is_global_zero:
                report["names_at_start"] = stored_names(storage, root)
                report["log"] = list(lines.lines)

    checkpoint = ModelCheckpoint(dirpath=f"{root}/{CHECKPOINTS}", every_n_train_steps=1, save_top_k=-1)
    torch.manual_seed(0)
    model = Model()
    if phase == "train":
        max_steps = 1000  # until the test kills the ranks
    else:
        assert ckpt_path is not None
        max_steps = int(_STEP.search(ckpt_path).group(1)) + 1
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=_strategy(kind, storage),
                        max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, callbacks=[checkpoint, AtStart()])
    trainer.fit(model, ckpt_path=ckpt_path)
    report["ended_at"] = trainer.global_step
    return report


# The live save ---------------------------------------------------------------------------------------
def live_save(spec: dict[str, Any]) -> None:
    """Save :func:`~tests.support.dcp_ranks.full_state` of ``seed`` to ``path`` in this process alone,
    held in the middle (see the module); writes ``{"saved": true}`` to ``report`` once it published."""
    import warnings

    warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
    import torch.distributed.checkpoint as dcp

    from tests.support.dcp_ranks import full_state, stalling_planner

    if spec["storage"] == "gs":
        from dataflux_ckpt import DatafluxStorageWriter

        writer: Any = DatafluxStorageWriter(spec["path"], chunk_size=64 * 1024, max_workers=2)
    else:
        from fastpersist import FastPersistStorageWriter

        writer = FastPersistStorageWriter(spec["path"], io_buffer_mb=1)
    planner = stalling_planner(spec["held"], 1, release=spec["go"])
    dcp.save(full_state(spec["seed"]), storage_writer=writer, planner=planner)
    Path(spec["report"]).write_text(json.dumps({"saved": True}))


# Checks in the test process ------------------------------------------------------------------------
def stored_names(storage: str, root: str) -> list[str]:
    """Every file (relative to ``root``) or object (relative to its prefix) under ``root``."""
    from tests.support.dcp_requeue import stored_names as names

    return names(storage, root)


def writing_after(storage: str, names: list[str], step: int) -> bool:
    """Whether ``names`` (under a run's root) show a shard being written into the checkpoint of a
    step after ``step`` (not the live save's)."""
    pattern = _WRITING[storage]
    for name in names:
        parts = name.split("/")
        if len(parts) < 3 or parts[0] != CHECKPOINTS or parts[1] == LIVE:
            continue
        found = _STEP.search(parts[1])
        if found and int(found.group(1)) > step and pattern.match("/".join(parts[2:])):
            return True
    return False


def checkpoints(names: list[str]) -> dict[str, list[str]]:
    """The names under each checkpoint of the run's ``ModelCheckpoint`` directory, with what its saves
    put beside it on a local filesystem (their save lock, and the directory their ranks write in until
    they commit), named from that directory."""
    found: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("/", 2)
        if len(parts) < 2 or parts[0] != CHECKPOINTS:
            continue
        if beside := _BESIDE.match(parts[1]):
            found.setdefault(beside["checkpoint"], []).append("/".join(parts[1:]))
        elif len(parts) == 3:
            found.setdefault(parts[1], []).append(parts[2])
    return found


def newest_whole(names: list[str]) -> str | None:
    """The checkpoint of the highest step that has its ``.metadata``."""
    whole = [(int(_STEP.search(name).group(1)), name) for name, files in checkpoints(names).items()
             if ".metadata" in files and _STEP.search(name)]
    return max(whole)[1] if whole else None


if __name__ == "__main__":
    live_save(json.loads(sys.argv[1]))
