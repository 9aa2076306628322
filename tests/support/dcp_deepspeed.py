"""One rank of a real DeepSpeed run (CPU, gloo) whose ZeRO checkpoints go through FastPersist: for each
ZeRO stage, one training step, ``save_checkpoint`` through ``FastPersistCheckpointEngine``, then a
``load_checkpoint`` over perturbed weights; reports the files this rank wrote and whether the load
restored the weights."""

from __future__ import annotations

import importlib
import os
from typing import Any


def run_zero(stages: list[int], root: str, rank: int, world: int, port: int) -> list[dict[str, Any]]:
    import deepspeed
    import torch

    from fastpersist import enable_fastpersist

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # The shared-memory allreduce op needs a minutes-long JIT build on CPU; gloo's allreduce serves.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    outcomes = []
    for stage in stages:
        torch.manual_seed(stage)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        config = {"train_batch_size": world, "zero_optimization": {"stage": stage},
                  "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
        loss = engine(torch.randn(1, 64)).square().sum()
        engine.backward(loss)
        engine.step()
        fast = enable_fastpersist(engine, io_buffer_mb=1)
        save_dir = os.path.join(root, f"zero{stage}")
        engine.save_checkpoint(save_dir, tag="step1")
        wanted = _full_parameters(engine, stage)
        _perturb(engine, stage, rank)
        perturbed = _full_parameters(engine, stage)
        engine.load_checkpoint(save_dir, tag="step1")
        restored = _full_parameters(engine, stage)
        outcomes.append({
            "stage": stage,
            "written": sorted(os.path.relpath(stats.path, save_dir) for stats in fast.stats),
            "perturbed": not any(torch.equal(a, b) for a, b in zip(wanted, perturbed, strict=True)),
            "restored": all(torch.equal(a, b) for a, b in zip(wanted, restored, strict=True)),
        })
    return outcomes


def _perturb(engine: Any, stage: int, rank: int) -> None:
    import deepspeed
    import torch

    parameters = list(engine.module.parameters())
    with torch.no_grad():
        if stage == 3:  # partitioned: change the gathered values on rank 0, scattered on exit
            with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
                if rank == 0:
                    for parameter in parameters:
                        parameter.add_(1.0)
        else:
            for parameter in parameters:
                parameter.add_(1.0)


def _full_parameters(engine: Any, stage: int) -> list[Any]:
    import deepspeed

    parameters = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(parameters):
            return [p.detach().clone() for p in parameters]
    return [p.detach().clone() for p in parameters]
