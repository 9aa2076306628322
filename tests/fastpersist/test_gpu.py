"""FastPersist on a real GPU: state dicts resident in CUDA memory, every engine, Lightning and DeepSpeed.

Run wherever CUDA is present (``pytest -m gpu``); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fastpersist import FastPersistCheckpointIO, FastPersistContext, fastpersist_load, fastpersist_save
from fastpersist.aio import aio_unavailable_reason, gds_unavailable_reason
from tests.support.fp_compare import assert_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GPU_ENGINES = ["aio", "python", "gds"]


def gpu_state() -> dict[str, Any]:
    """bf16/fp16/fp32 tensors on the GPU, views sharing one storage, a non-contiguous one, CPU tensors."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(1024, 257, device="cuda", generator=generator)
    state: dict[str, Any] = {
        "fp32": base,
        "bf16": torch.randn(3000, 333, device="cuda", generator=generator).to(torch.bfloat16),
        "fp16": torch.randn(77, 1001, device="cuda", generator=generator).half(),
        "row_view": base[5:9],
        "transposed": base.t(),  # non-contiguous, shares base's storage
        "strided": base[:, ::3],
        "cpu": torch.arange(1000, dtype=torch.int64),
        "cpu_bf16": torch.randn(64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        "step": 7,
    }
    return state


def on(device: str, obj: Any) -> Any:
    if isinstance(obj, dict):
        return {key: on(device, value) for key, value in obj.items()}
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


def assert_bit_exact(got: dict[str, Any], want: dict[str, Any], device: str | None) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            expected_device = torch.device(device) if device else value.device
            assert got[key].device.type == expected_device.type, key
            assert got[key].dtype == value.dtype and got[key].stride() == value.stride(), key
            assert torch.equal(
                got[key].cpu().view(-1).view(torch.uint8) if got[key].is_contiguous() else got[key].cpu(),
                value.cpu().view(-1).view(torch.uint8) if value.is_contiguous() else value.cpu(),
            ), key
        else:
            assert got[key] == value, key
    assert got["row_view"].untyped_storage().data_ptr() == got["fp32"].untyped_storage().data_ptr()


def require(engine: str) -> None:
    if engine == "aio" and aio_unavailable_reason():
        pytest.skip(aio_unavailable_reason())


@pytest.mark.parametrize("engine", GPU_ENGINES)
@pytest.mark.parametrize("map_location", [None, "cuda", "cpu"])
def test_gpu_state_dicts_round_trip_bit_exact(ckpt_dir: Path, engine: str, map_location: str | None) -> None:
    require(engine)
    state = gpu_state()
    with FastPersistContext(io_buffer_mb=4, engine=engine) as context:
        stats = fastpersist_save(state, ckpt_dir / "gpu.pt", context=context)
        assert stats.engine in (
            {engine} if engine != "gds" or not gds_unavailable_reason() else {"aio", "python"}
        )
        loaded = fastpersist_load(ckpt_dir / "gpu.pt", map_location=map_location, context=context)
    assert_bit_exact(loaded, state, map_location)
    assert_bit_exact(
        torch.load(ckpt_dir / "gpu.pt", map_location=map_location, weights_only=True), state, map_location
    )


_GDS_FALLBACK_SCRIPT = """
import json, logging, sys
from pathlib import Path
import torch
from fastpersist import FastPersistContext, fastpersist_save
from tests.fastpersist.test_gpu import gpu_state

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("fastpersist").addHandler(handler)
folder = Path(sys.argv[1])
with FastPersistContext(io_buffer_mb=4, engine="gds") as context:
    first = fastpersist_save(gpu_state(), folder / "a.pt", context=context)
    second = fastpersist_save(gpu_state(), folder / "b.pt", context=context)
warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
print(json.dumps({"engines": [first.engine, second.engine], "warnings": warnings}))
"""


def test_gds_without_cufile_falls_back_with_one_warning_and_no_native_noise(ckpt_dir: Path) -> None:
    # A fresh process: warnings are once per process, and an earlier test may have given this one.
    done = subprocess.run([sys.executable, "-c", _GDS_FALLBACK_SCRIPT, str(ckpt_dir)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["engines"][0] == "gds":
        assert result["engines"] == ["gds", "gds"] and not result["warnings"]
        return
    assert len(result["warnings"]) == 1 and "'gds' unavailable" in result["warnings"][0], result
    assert "file register error" not in done.stdout + done.stderr
    assert_same(
        torch.load(ckpt_dir / "b.pt", map_location="cpu", weights_only=True)["cpu"], torch.arange(1000)
    )


def test_gpu_staging_buffer_with_a_host_engine_is_refused(ckpt_dir: Path) -> None:
    require("aio")
    wrong = torch.empty(4 * 1024**2, dtype=torch.uint8, device="cuda")
    with (
        FastPersistContext(engine="aio", pinned_buffer=wrong) as context,
        pytest.raises(ValueError, match="staging buffer is on cuda"),
    ):
        fastpersist_save(gpu_state(), ckpt_dir / "x.pt", context=context)
    assert not list(ckpt_dir.iterdir())


def test_host_staging_buffer_with_gds_falls_back_to_aio(ckpt_dir: Path) -> None:
    require("aio")
    host = torch.empty(4 * 1024**2, dtype=torch.uint8).pin_memory()
    with FastPersistContext(engine="gds", pinned_buffer=host) as context:
        stats = fastpersist_save(gpu_state(), ckpt_dir / "x.pt", context=context)
    assert stats.engine in ("aio", "python")
    assert_bit_exact(torch.load(ckpt_dir / "x.pt", weights_only=True), gpu_state(), None)


@pytest.mark.parametrize("wrapped", [False, True])
def test_lightning_trainer_on_gpu_saves_and_resumes(ckpt_dir: Path, wrapped: bool) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    def trainer(max_steps: int) -> Trainer:
        plugin: Any = FastPersistCheckpointIO(io_buffer_mb=4)
        if wrapped:
            plugin = AsyncCheckpointIO(plugin)
        return Trainer(
            default_root_dir=ckpt_dir, max_steps=max_steps, limit_val_batches=0, plugins=[plugin],
            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")],
            logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="gpu", devices=1,
        )  # fmt: skip

    trainer(3).fit(BoringModel())
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["epoch=0-step=3.ckpt"]
    saved = torch.load(ckpt_dir / "epoch=0-step=3.ckpt", weights_only=False)
    resumed = trainer(5)
    resumed.fit(BoringModel(), ckpt_path=ckpt_dir / "epoch=0-step=3.ckpt")
    assert resumed.global_step == 5 and saved["global_step"] == 3
    # As with Lightning's own TorchCheckpointIO: the resumed run's ModelCheckpoint keeps its best one
    # and leaves the checkpoint the run started from.
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["epoch=0-step=3.ckpt", "epoch=0-step=5.ckpt"]


def test_deepspeed_engine_on_gpu_saves_through_fastpersist(ckpt_dir: Path) -> None:
    deepspeed = pytest.importorskip("deepspeed")
    from fastpersist import FastPersistCheckpointEngine, deepspeed_initialize

    require("aio")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl")
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    config = {
        "train_batch_size": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 0},
        "checkpoint": {"writer": {"type": "fast", "io_buffer_size": 4 * 1024**2}},
    }
    engine, *_ = deepspeed_initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
    )
    assert isinstance(engine.checkpoint_engine, FastPersistCheckpointEngine)
    engine.backward(engine(torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)).float().sum())
    engine.step()
    engine.save_checkpoint(ckpt_dir, tag="gpu")
    saved = torch.load(
        ckpt_dir / "gpu" / "mp_rank_00_model_states.pt", map_location="cuda", weights_only=False
    )
    for name, value in engine.module.state_dict().items():
        assert torch.equal(saved["module"][name], value), name
    assert {s.engine for s in engine.checkpoint_engine.stats} <= {"aio", "python"}


@pytest.mark.parametrize("engine", ["aio", "python"])
@pytest.mark.parametrize("map_location", ["cuda", "cuda:0", torch.device("cuda", 0)])
def test_a_load_to_the_gpu_makes_no_host_copy_and_matches_torch_load(
    ckpt_dir: Path, engine: str, map_location: Any
) -> None:
    psutil = pytest.importorskip("psutil")
    require(engine)
    generator = torch.Generator().manual_seed(5)
    state = {f"w{index}": torch.randn(2**23 + index, generator=generator) for index in range(8)}  # 256 MiB
    path = ckpt_dir / "big.pt"
    fastpersist_save(state, path, engine="python")
    size = path.stat().st_size
    with FastPersistContext(io_buffer_mb=16, engine=engine) as context:
        fastpersist_load(path, map_location=map_location, context=context)  # buffers allocated once
        before = psutil.Process().memory_info().rss
        loaded = fastpersist_load(path, map_location=map_location, context=context)
        grown = psutil.Process().memory_info().rss - before
    # Through the 16 MiB staging buffer to the device: the host never holds the checkpoint.
    assert grown < size / 4, f"host memory grew by {grown} bytes for a {size}-byte checkpoint"
    assert all(tensor.device == torch.device("cuda", 0) for tensor in loaded.values())
    assert_same(
        {key: value.cpu() for key, value in loaded.items()},
        torch.load(path, map_location="cpu", weights_only=True),
    )
