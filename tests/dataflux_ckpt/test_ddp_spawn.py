"""``Trainer(strategy="ddp_spawn")`` with DatafluxCheckpointIO: checkpoints go to GCS, and the trained
weights come back to the launching process through Lightning's local hand-back file (``.temp.ckpt``
in ``default_root_dir``), which the plugin writes and reads as a local file and which is gone after."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from dataflux_ckpt import DatafluxCheckpointIO


def test_ddp_spawn_on_two_cpu_processes_finishes_fit_and_hands_the_weights_back(
        make_plugin: Callable[..., DatafluxCheckpointIO], gcs_bucket: str, tmp_path: Path) -> None:
    plugin = make_plugin()
    dirpath = f"gs://{gcs_bucket}/spawn"
    model = BoringModel()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = Trainer(strategy="ddp_spawn", devices=2, accelerator="cpu", max_steps=2, limit_val_batches=0,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=str(tmp_path), plugins=[plugin],
                      callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(model)

    assert trainer.state.finished
    saved = plugin.list_checkpoints(dirpath + "/")
    assert saved, "no checkpoint reached the bucket"
    last = plugin.load_checkpoint(saved[-1] if "step=2" in saved[-1] else next(p for p in saved if "step=2" in p))
    after = model.state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before), "the trained weights did not come back"
    for name, value in after.items():
        assert torch.equal(last["state_dict"][name], value), name
    assert not (tmp_path / ".temp.ckpt").exists()
