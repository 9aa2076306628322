"""FastPersistCheckpointIO in real Lightning training loops (CPU, BoringModel)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from fastpersist import FastPersistCheckpointIO
from fastpersist.writer import TEMP_SUFFIX
from tests.support.fp_compare import assert_same

BUFFER_MB = 1


def make_trainer(root: Path, plugin: Any, max_steps: int, **checkpoint: Any) -> Trainer:
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=1, **checkpoint)
    return Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        limit_val_batches=0,
        plugins=[plugin],
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )


def checkpoint_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.suffix == ".ckpt")


def test_trainer_saves_with_top_k_removal_and_files_load_in_torch(ckpt_dir: Path, engine: str) -> None:
    plugin = FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine=engine)
    trainer = make_trainer(ckpt_dir, plugin, max_steps=5, save_top_k=2, monitor="step", mode="max")
    trainer.fit(BoringModel())
    assert checkpoint_files(ckpt_dir) == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt"]
    assert plugin.last_stats is not None and plugin.last_stats.engine == engine
    saved = torch.load(ckpt_dir / "epoch=0-step=5.ckpt", weights_only=False)
    assert saved["global_step"] == 5
    assert_same(plugin.load_checkpoint(ckpt_dir / "epoch=0-step=5.ckpt", weights_only=False), saved)
    assert not [n for n in os.listdir(ckpt_dir) if n.endswith(TEMP_SUFFIX)]


def test_resume_from_checkpoint_continues_training(ckpt_dir: Path, engine: str) -> None:
    first = make_trainer(
        ckpt_dir, FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine=engine), max_steps=3, save_top_k=-1
    )
    first.fit(BoringModel())
    resume_from = ckpt_dir / "epoch=0-step=3.ckpt"
    weights = torch.load(resume_from, weights_only=False)["state_dict"]

    model = BoringModel()
    restored: dict[str, Any] = {}
    model.on_train_start = lambda: restored.update({k: v.clone() for k, v in model.state_dict().items()})
    second = make_trainer(
        ckpt_dir, FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine=engine), max_steps=6, save_top_k=-1
    )
    second.fit(model, ckpt_path=resume_from)
    assert second.global_step == 6
    assert_same(restored, dict(weights))
    assert "epoch=0-step=6.ckpt" in checkpoint_files(ckpt_dir)


def test_wrapped_in_async_checkpoint_io(ckpt_dir: Path, engine: str) -> None:
    inner = FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine=engine)
    trainer = make_trainer(ckpt_dir, AsyncCheckpointIO(inner), max_steps=4, save_top_k=-1)
    trainer.fit(BoringModel())
    assert checkpoint_files(ckpt_dir) == [f"epoch=0-step={step}.ckpt" for step in range(1, 5)]
    for step in range(1, 5):
        assert torch.load(ckpt_dir / f"epoch=0-step={step}.ckpt", weights_only=False)["global_step"] == step
    assert inner.last_stats is not None and inner.last_stats.engine == engine


def test_plugin_contract(ckpt_dir: Path) -> None:
    plugin = FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine="python")
    target = ckpt_dir / "nested" / "dir" / "x.ckpt"
    plugin.save_checkpoint({"w": torch.arange(4)}, target)
    assert torch.equal(plugin.load_checkpoint(target)["w"], torch.arange(4))
    with pytest.raises(TypeError, match="storage_options"):
        plugin.save_checkpoint({"w": torch.arange(4)}, target, storage_options={"x": 1})
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        plugin.load_checkpoint(ckpt_dir / "absent.ckpt")
    plugin.remove_checkpoint(target)
    plugin.remove_checkpoint(target)  # removing twice is fine
    assert not target.exists()
    plugin.teardown()
    plugin.save_checkpoint({"w": torch.arange(2)}, target)  # usable again after teardown
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(2))


class SlowToSaveModel(BoringModel):
    """BoringModel carrying 32 MiB of state, so a save takes far longer than a training step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.randn(8 * 1024**2))


def test_async_saves_with_top_k_1_keep_only_the_newest_checkpoint(ckpt_dir: Path, engine: str) -> None:
    # Fast steps queue saves behind a slow one, so ModelCheckpoint removes checkpoints whose saves
    # have not been written yet: those saves must not publish them afterwards.
    inner = FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine=engine)
    trainer = make_trainer(
        ckpt_dir, AsyncCheckpointIO(inner), max_steps=8, save_top_k=1, monitor="step", mode="max"
    )
    trainer.fit(SlowToSaveModel())
    assert checkpoint_files(ckpt_dir) == ["epoch=0-step=8.ckpt"]
    assert torch.load(ckpt_dir / "epoch=0-step=8.ckpt", weights_only=False)["global_step"] == 8
    assert not [n for n in os.listdir(ckpt_dir) if n.endswith(TEMP_SUFFIX)]


def test_a_removal_after_a_save_request_wins_and_a_save_after_a_removal_wins(ckpt_dir: Path) -> None:
    plugin = FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine="python")
    async_io = AsyncCheckpointIO(plugin)
    first, second = ckpt_dir / "a.ckpt", ckpt_dir / "b.ckpt"
    big = {"w": torch.randn(8 * 1024**2)}
    async_io.save_checkpoint(big, first)
    async_io.save_checkpoint(big, second)
    async_io.remove_checkpoint(second)  # queued behind the first save: cancelled
    async_io.teardown()
    assert checkpoint_files(ckpt_dir) == ["a.ckpt"]
    plugin.save_checkpoint({"w": torch.ones(1)}, second)  # asked for after the removal: kept
    assert checkpoint_files(ckpt_dir) == ["a.ckpt", "b.ckpt"]


def test_plugin_pickles_without_its_lock_or_buffers(ckpt_dir: Path) -> None:
    plugin = FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine="python")
    plugin.save_checkpoint({"w": torch.arange(3)}, ckpt_dir / "x.ckpt")
    copy = pickle.loads(pickle.dumps(plugin))
    copy.save_checkpoint({"w": torch.arange(4)}, ckpt_dir / "y.ckpt")
    assert torch.equal(copy.load_checkpoint(ckpt_dir / "y.ckpt")["w"], torch.arange(4))
    assert copy.context.io_buffer_mb == BUFFER_MB and copy.context.engine == "python"


def test_load_follows_torchs_weights_only_default_and_passes_an_explicit_choice(ckpt_dir: Path) -> None:
    plugin = FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB, engine="python")
    path = ckpt_dir / "module.ckpt"
    plugin.save_checkpoint({"w": torch.ones(2), "layer": torch.nn.ReLU()}, path)
    with pytest.raises(pickle.UnpicklingError, match="weights-only load"):
        plugin.load_checkpoint(path)
    assert isinstance(plugin.load_checkpoint(path, weights_only=False)["layer"], torch.nn.ReLU)


def test_async_saves_with_last_links_into_a_directory_that_does_not_exist_yet(ckpt_dir: Path) -> None:
    """Lightning links ``last.ckpt`` as soon as it has asked for a save; behind AsyncCheckpointIO the
    save that would create the directory may not have run (stock TorchCheckpointIO fails here)."""
    root = ckpt_dir / "new" / "run"
    plugin = AsyncCheckpointIO(FastPersistCheckpointIO(io_buffer_mb=BUFFER_MB))
    trainer = make_trainer(root, plugin, max_steps=4, save_top_k=2, monitor="step", mode="max", save_last="link")
    trainer.fit(BoringModel())
    assert checkpoint_files(root) == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.path.islink(root / "last.ckpt")
    assert torch.load(root / "last.ckpt", weights_only=False)["global_step"] == 4
