"""A real DeepSpeed engine (CPU, gloo, one process) whose save_checkpoint writes through FastPersist."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fastpersist import FastPersistCheckpointEngine, enable_fastpersist
from lightning_storage_plugins.services import free_port
from tests.support.fp_compare import assert_same

deepspeed = pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def ds_engine() -> Iterator[Any]:
    """A DeepSpeed engine over a small MLP with AdamW state after one step."""
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # the attribute "torch" is torch itself

    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    saved_env = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    # One process needs no shared-memory allreduce; skipping it avoids a minutes-long JIT build on CPU.
    build_shm_op, ds_torch_comm.build_shm_op = ds_torch_comm.build_shm_op, lambda: None
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
        config = {"train_batch_size": 1, "zero_optimization": {"stage": 0}}
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
        )
        loss = engine(torch.randn(1, 32)).square().sum()
        engine.backward(loss)
        engine.step()
        yield engine
    finally:
        ds_torch_comm.build_shm_op = build_shm_op
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        ds_comm.cdb = None
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_deepspeed_save_checkpoint_goes_through_fastpersist(
    ds_engine: Any, ckpt_dir: Path, engine: str
) -> None:
    default_engine = ds_engine.checkpoint_engine
    ds_engine.save_checkpoint(ckpt_dir / "baseline", tag="step1")
    fast = enable_fastpersist(ds_engine, io_buffer_mb=1, engine=engine)
    try:
        assert isinstance(ds_engine.checkpoint_engine, FastPersistCheckpointEngine)
        ds_engine.save_checkpoint(ckpt_dir / "fast", tag="step1")
        written = ckpt_dir / "fast" / "step1" / "mp_rank_00_model_states.pt"
        assert [Path(s.path) for s in fast.stats] == [written] and fast.stats[0].engine == engine
        baseline = torch.load(
            ckpt_dir / "baseline" / "step1" / "mp_rank_00_model_states.pt", weights_only=False
        )
        saved = torch.load(written, weights_only=False)
        assert_same(saved["module"], baseline["module"])
        assert_same(saved["optimizer"]["state"], baseline["optimizer"]["state"])
        assert (ckpt_dir / "fast" / "latest").read_text() == "step1"

        wanted = {k: v.clone() for k, v in ds_engine.module.state_dict().items()}
        with torch.no_grad():
            for parameter in ds_engine.module.parameters():
                parameter.add_(1.0)
        ds_engine.load_checkpoint(ckpt_dir / "fast", tag="step1")
        assert_same(dict(ds_engine.module.state_dict()), wanted)
    finally:
        ds_engine.checkpoint_engine = default_engine


def test_ds_config_alone_chooses_and_tunes_fastpersist(
    ds_engine: Any, ckpt_dir: Path, aio_engine: str
) -> None:
    from fastpersist import AioConfig, deepspeed_initialize

    model = torch.nn.Linear(8, 4)
    config = {
        "train_batch_size": 1,
        "zero_optimization": {"stage": 0},
        "checkpoint": {"writer": {"type": "fast", "io_buffer_size": 2 * 1024**2}},
        "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2},
    }
    engine, *_ = deepspeed_initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    fast = engine.checkpoint_engine
    assert isinstance(fast, FastPersistCheckpointEngine)
    assert fast.context.io_buffer_mb == 2 and fast.context.engine == "aio"
    assert fast.context.aio == AioConfig(block_size=262144, queue_depth=16, intra_op_parallelism=2)
    engine.save_checkpoint(ckpt_dir, tag="t")
    assert [s.engine for s in fast.stats] == ["aio"]
    saved = torch.load(ckpt_dir / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert_same(saved["module"], model.state_dict())
    fast.cleanup()


def test_ds_config_without_a_writer_block_leaves_deepspeeds_engine(ds_engine: Any) -> None:
    from fastpersist import deepspeed_initialize

    model = torch.nn.Linear(8, 4)
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed_initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    assert not isinstance(engine.checkpoint_engine, FastPersistCheckpointEngine)


@pytest.mark.parametrize(
    "config",
    [
        {"aio": {"queue_depth": 0}},
        {"aio": {"single_submit": 1}},
        {"checkpoint": {"writer": {"type": "fast", "io_buffer_size": -5}}},
    ],
)
def test_bad_ds_config_values_are_named(config: dict[str, Any]) -> None:
    from fastpersist.deepspeed_engine import writer_settings

    with pytest.raises(ValueError, match=r"ds_config \"(aio|checkpoint)\."):
        writer_settings(config)
