"""Ranks of real tiered DCP runs (``DatafluxStorageWriter`` / ``Reader`` with ``local_dir``), started by
:mod:`tests.support.dcp_ranks` (steps whose ``op`` begins with ``tiered``), and the parent's checks.

Every rank of a run gets one :class:`~dataflux_ckpt.tiered_dcp.ShardedLocalTier` per ``local_dir``;
ranks of a run share ``local_dir``, as the ranks of one node do. An ``endpoint`` (a fault proxy
in front of the emulator), given in any step, is where the ranks reach GCS.

Ops:

* ``tiered_save``: save ``seed``'s state; ``durable``: then wait for this rank's uploads (the
  coordinator's: for the publish) before the barrier. A ``remote_every`` in a run's first step
  that names a ``local_dir`` is that tier's.
* ``tiered_load``: load into zeros and report ``mismatches``, the tier chosen and the files read
  from each tier.
* ``tiered_loop``: resume (load the newest whole version, whatever its seed), take over what a
  crashed run left, then save seed after seed, each rank touching ``<events>/<rank>-saving-<seed>``
  and ``<events>/<rank>-saved-<seed>``, until killed (or ``saves`` saves).
* ``tiered_hold``: touch ``<events>/<rank>-held``, then wait to be killed.
* ``tiered_lightning``: a Trainer with ``DatafluxFSDPStrategy`` or ``DatafluxModelParallelStrategy``
  (``kind``) and ``local_dir`` (the strategy's own tier, or with ``remote_every`` one of the test's),
  ``DatafluxModelCheckpoint(save_last=True)`` every step, fitting to ``max_steps`` from ``ckpt_path="last"``; reports the step it started at, the model and optimizer
  state it started from and ended with, and its tier's stats (torchrun's environment: Lightning
  makes the process group).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

# Small parts and crc blocks, so that small shards still span many of them.
GS_OPTIONS = {"chunk_size": 64 * 1024, "block_size": 4096, "max_workers": 3, "upload_mode": "composite"}
TIER_OPTIONS = {"io_buffer_mb": 1, "keep_local": 2}
COLLECTIVE_TIMEOUT_S = 30.0


def _options() -> Any:
    from dataflux_ckpt import TransferOptions
    from tests.support.gcs import FAST_RETRY

    return TransferOptions(retry=FAST_RETRY, deadline_s=60.0, **GS_OPTIONS)


def tier(local_dir: str, **changes: Any) -> Any:
    """A local tier on ``local_dir`` with the test's transfer options."""
    from dataflux_ckpt.tiered_dcp import ShardedLocalTier

    return ShardedLocalTier(local_dir, options=_options(), **{**TIER_OPTIONS, **changes})


def writer(path: str, local_tier: Any) -> Any:
    from dataflux_ckpt import DatafluxStorageWriter

    return DatafluxStorageWriter(path, options=_options(), local_dir=local_tier)


def reader(path: str, local_dir: Any) -> Any:
    from dataflux_ckpt import DatafluxStorageReader

    return DatafluxStorageReader(path, options=_options(), local_dir=local_dir)


def load_seed(path: str, local_dir: Any, mesh: Any = None) -> tuple[int, list[str], Any]:
    """Load the checkpoint at ``path`` (whatever its seed) through one reader: first its seed, then
    the rest; ``(seed, mismatches, reader)``. Sharded on ``mesh`` when given, else whole."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tests.support.dcp_ranks import full_state, mismatches, same_bits, sharded_state

    source = reader(path, local_dir)
    if not source.exists():  # as the strategies ask, on every rank, before DCP's collectives
        raise FileNotFoundError(f"no checkpoint at {path}")
    probe = {"s": torch.zeros(())}
    dcp.load(probe, storage_reader=source)
    seed = int(probe["s"].item())
    full = full_state(seed)
    if mesh is not None:
        state = sharded_state(full, mesh, zeros=True)
        dcp.load(state, storage_reader=source)
        return seed, mismatches(state, full), source
    from tests.support.dcp_ranks import META_PLACEHOLDER

    whole = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict(META_PLACEHOLDER) for k, v in full.items()}
    dcp.load(whole, storage_reader=source)
    bad = [k for k, v in full.items() if not (same_bits(whole[k], v) if isinstance(v, torch.Tensor) else whole[k] == v)]
    return seed, bad, source


def run_tiered(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Run a spec's ``tiered_*`` steps on this rank; its report."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from tests.support.dcp_ranks import full_state, sharded_state

    if all(step["op"] == "tiered_lightning" for step in spec["steps"]):
        from tests.support.dcp_lightning import torchrun_environ

        os.environ.update(torchrun_environ(rank, world, spec["port"]))
        return {"rank": rank, "steps": [_fit(step) for step in spec["steps"]]}
    endpoint = next((step["endpoint"] for step in spec["steps"] if step.get("endpoint")), None)
    if endpoint:
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (world,))
    tiers: dict[str, Any] = {}
    report: dict[str, Any] = {"rank": rank, "steps": []}

    def tier_of(local_dir: str) -> Any:
        if local_dir not in tiers:
            first = next(step for step in spec["steps"] if step.get("local_dir") == local_dir)
            tiers[local_dir] = tier(local_dir, remote_every=first.get("remote_every", 1))
        return tiers[local_dir]

    for step in spec["steps"]:
        op, outcome = step["op"], {}
        if op == "tiered_save":
            local_tier = tier_of(step["local_dir"])
            started = time.perf_counter()
            dcp.save(sharded_state(full_state(step["seed"]), mesh), storage_writer=writer(step["path"], local_tier))
            outcome["save_s"] = time.perf_counter() - started
            if step.get("durable"):
                outcome["durable"] = local_tier.wait(COLLECTIVE_TIMEOUT_S * 2)
            if step.get("touch"):
                Path(step["touch"], f"{rank}-saved-{step['seed']}").touch()
        elif op == "tiered_load":
            seed, bad, source = load_seed(step["path"], tier_of(step["local_dir"]), mesh)
            outcome.update(seed=seed, mismatches=bad, tier=source.chosen_tier, local=source.files_read_locally,
                           gcs=source.files_read_from_gcs)
        elif op == "tiered_hold":
            Path(step["events"], f"{rank}-held").touch()
            time.sleep(600)
        elif op == "tiered_loop":
            return _loop(step, rank, mesh, tier_of(step["local_dir"]), report)
        else:
            raise ValueError(f"unknown step {op!r}")
        dist.barrier()
        report["steps"].append(outcome)
    for local_tier in tiers.values():
        local_tier.close(step.get("close_s"))
    return report


def _loop(step: dict[str, Any], rank: int, mesh: Any, local_tier: Any, report: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from tests.support.dcp_ranks import full_state, sharded_state

    events = Path(step["events"])
    try:
        resumed, bad, _ = load_seed(step["path"], local_tier, mesh)
    except FileNotFoundError:
        resumed, bad = 0, []
    if bad:
        raise AssertionError(f"resumed a mixed checkpoint: tensors {bad} are not seed {resumed}'s")
    (events / f"{rank}-resumed-{resumed}").touch()
    report["steps"].append({"resumed": resumed, "mismatches": bad})
    local_tier.finish_pending()
    for seed in range(resumed + 1, resumed + 1 + step["saves"]):
        (events / f"{rank}-saving-{seed}").touch()
        dcp.save(sharded_state(full_state(seed), mesh), storage_writer=writer(step["path"], local_tier))
        (events / f"{rank}-saved-{seed}").touch()
    local_tier.close()
    return report


def _fit(step: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch

    from dataflux_ckpt import DatafluxFSDPStrategy, DatafluxModelCheckpoint, DatafluxModelParallelStrategy
    from tests.support.dcp_lightning import _full_states, model_class

    def sums(states: dict[str, Any]) -> dict[str, Any]:  # for the report: equal sums, equal states here
        return {"model": {k: v.sum().item() for k, v in states["model"].items()},
                "exp_avg": [v.sum().item() for v in states["exp_avg"]]}

    options = {"writer_options": {"options": _options()}, "reader_options": {"options": _options()},
               "local_dir": step["local_dir"] if "remote_every" not in step else
               tier(step["local_dir"], remote_every=step["remote_every"])}
    if step["kind"] == "fsdp":
        strategy: Any = DatafluxFSDPStrategy(state_dict_type="sharded", **options)
    else:
        strategy = DatafluxModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]),
                                                 tensor_parallel_size=1, **options)
    torch.manual_seed(0)
    model = model_class(step["kind"])()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                        max_steps=step["max_steps"], limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=step["root"],
                        callbacks=[DatafluxModelCheckpoint(dirpath=f"{step['root']}/checkpoints",
                                                           every_n_train_steps=1, save_last=True)])
    trainer.fit(model, ckpt_path="last")
    stats = strategy.local_tier().stats()
    started = model.started_from
    return {"started": None if started is None else {"step": started["step"], **sums(started)},  # None: no step
            "ended": {"step": trainer.global_step, **sums(_full_states(strategy.model, trainer.optimizers[0]))},
            "saves": stats.saves, "pending": stats.uploads_pending}
