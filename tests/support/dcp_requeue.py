"""One rank of a real Lightning run whose Slurm requeue handler fires inside a sharded save, started by
:mod:`tests.support.dcp_ranks` with the environment Slurm gives each task of a job step.

The run trains with ``SLURMEnvironment(auto_requeue=True)`` and a ``ModelCheckpoint`` saving after
every step through a plugin's sharded strategy (FSDP or ModelParallel, on the CPU). The test sends
each rank SIGUSR1 while the ranks write their shard files (see ``tests/dcp/test_requeue_signal.py``);
Lightning's handler then saves ``hpc_ckpt_1.ckpt`` through the strategy and asks a stand-in
``scontrol`` to requeue the job. Afterwards the rank resumes one Trainer from the checkpoint the signal
interrupted and one from ``hpc_ckpt_1.ckpt``, and reports what each started from, with the log lines
of the deferred save. The checks the test process makes of what the runs stored are here too.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from typing import Any

from tests.support.files import files_under

#: The Slurm job the ranks belong to: the stand-in ``scontrol`` is asked to requeue it.
JOB_ID = "4242"
#: The collectives' timeout: a run whose collectives stop meeting fails within it instead of hanging.
COLLECTIVE_TIMEOUT_S = 90.0
#: Transfer options of the gs:// runs: parts small enough that each shard goes up in many of them.
GS_WRITER_OPTIONS = {"chunk_size": 256 * 1024, "max_workers": 2}
#: Training steps, each followed by a checkpoint: that many saves for the signal to land in.
STEPS = 4
#: Width of the model's hidden layers: shards large enough that writing them takes a while.
HIDDEN = {"gs": 1024, "nvme": 1536}


def slurm_environ(rank: int, world: int, port: int, bin_dir: str) -> dict[str, str]:
    """The environment of task ``rank`` of a one-node Slurm job step of ``world`` tasks, with
    ``bin_dir`` (the stand-in ``scontrol``) first on the ``PATH``."""
    return {"SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": str(world),
            "SLURM_NTASKS_PER_NODE": str(world), "SLURM_NNODES": "1", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _strategy(kind: str, storage: str, timeout_s: float) -> Any:
    if storage == "gs":
        from dataflux_ckpt import DatafluxFSDPStrategy as FSDP
        from dataflux_ckpt import DatafluxModelParallelStrategy as ModelParallel

        options: dict[str, Any] = {"writer_options": dict(GS_WRITER_OPTIONS)}
    else:
        from fastpersist import FastPersistFSDPStrategy as FSDP
        from fastpersist import FastPersistModelParallelStrategy as ModelParallel

        options = {"writer_options": {"io_buffer_mb": 4}}
    timeout = timedelta(seconds=timeout_s)
    if kind == "fsdp":
        return FSDP(state_dict_type="sharded", timeout=timeout, **options)
    return ModelParallel(data_parallel_size=int(os.environ["SLURM_NTASKS"]), tensor_parallel_size=1,
                         timeout=timeout, **options)


def run_requeue(kind: str, storage: str, root: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dict[str, Any]:
    """Train :data:`STEPS` steps with a checkpoint after each, the Slurm handler armed; then resume from the
    checkpoint whose save the handler interrupted and from ``hpc_ckpt_1.ckpt``. A run that fails
    reports its error and how long it ran instead (``timeout_s``: the collectives' timeout)."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.support.dcp_lightning import model_class
    from tests.support.signals import deferral_log

    Model = model_class(kind, (HIDDEN[storage], HIDDEN[storage]))

    def trainer(max_steps: int, checkpoint: ModelCheckpoint | None) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=int(os.environ["SLURM_NTASKS"]), num_nodes=1,
                         strategy=_strategy(kind, storage, timeout_s), plugins=[SLURMEnvironment(auto_requeue=True)],
                         max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[checkpoint] if checkpoint else None, enable_checkpointing=checkpoint is not None)

    report: dict[str, Any] = {}
    started_at = time.monotonic()
    with deferral_log() as records:
        try:
            torch.manual_seed(0)
            checkpoint = ModelCheckpoint(dirpath=f"{root}/checkpoints", every_n_train_steps=1, save_top_k=-1)
            trainer(STEPS, checkpoint).fit(Model())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            report.update(error=type(exc).__name__, message=str(exc)[:2000], seconds=time.monotonic() - started_at)
    report["log"] = [record.getMessage() for record in records]
    if "error" in report:
        return report
    deferred = [re.match(r"saving (\S+) now: it was asked for [\d.]+ s ago while this thread was saving (\S+) ", line)
                for line in report["log"]]
    found = [match.groups() for match in deferred if match]
    if len(found) != 1:
        return report
    hpc, outer = found[0]
    report.update(hpc=hpc, outer=outer)
    step = int(re.search(r"step=(\d+)", outer).group(1))
    started = []
    for path in (outer, hpc):
        model = Model()
        trainer(step + 1, None).fit(model, ckpt_path=path)
        assert model.started_from is not None
        started.append(model.started_from)
    report["resumed_at"] = [states["step"] for states in started]
    report["same_model"] = all(torch.equal(started[1]["model"][k], v) for k, v in started[0]["model"].items())
    report["same_optimizer"] = all(torch.equal(a, b) for a, b in zip(started[0]["exp_avg"], started[1]["exp_avg"],
                                                                      strict=True))
    return report


# Checks in the test process ------------------------------------------------------------------------
def stored_names(storage: str, root: str, client: Any = None) -> list[str]:
    """Every file (relative to ``root``) or object (relative to its prefix) under ``root``."""
    if storage == "nvme":
        return files_under(root)
    from google.cloud import storage as gcs

    from dataflux_ckpt import parse_gcs_path

    bucket, key = parse_gcs_path(root)
    listing = (client or gcs.Client()).list_blobs(bucket, prefix=key + "/")
    return sorted(blob.name[len(key) + 1 :] for blob in listing)


def load_items(reader: Any) -> dict[str, Any]:
    """Every item of a DCP checkpoint, each tensor whole, loaded in this one process (by the flat
    names DCP stores them under, such as ``model.layer.weight``)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        state[key] = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
    dcp.load(state, storage_reader=reader)
    return state


def checkpoint_reader(storage: str, path: str) -> Any:
    """The storage's DCP reader of ``path``: ``gs`` (Dataflux) or ``nvme`` (FastPersist)."""
    if storage == "gs":
        from dataflux_ckpt import DatafluxStorageReader

        return DatafluxStorageReader(path)
    from fastpersist import FastPersistStorageReader

    return FastPersistStorageReader(path)


def referenced_files(reader: Any) -> set[str]:
    """The files (or objects) a checkpoint's metadata names."""
    return {info.relative_path for info in reader.read_metadata().storage_data.values()}


def checkpoint_names(storage: str, root: str, checkpoints: list[str]) -> list[str]:
    """What whole checkpoints ``checkpoints`` (relative to ``root``) store, as :func:`stored_names` lists
    them: each one's ``.metadata`` and the files it names, and on gs:// its commit record (an object at
    the checkpoint's own name, which dates it for Lightning)."""
    names = set()
    for name in checkpoints:
        names |= {f"{name}/{file}" for file in {".metadata"} | referenced_files(checkpoint_reader(storage, f"{root}/{name}"))}
        if storage == "gs":
            names.add(name)
    return sorted(names)
