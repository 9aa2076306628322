"""A restart removes the temporary files of FastPersist saves killed in the middle, before the first
step, and never the temporary of a save still running in another process.

Real processes and a real kill: children save through ``FastPersistCheckpointIO`` and hold in the
middle of the save, their temporary files written (tests.support.held_save); one is killed with
SIGKILL, the other keeps running while a Trainer starts on the directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from fastpersist import FastPersistCheckpointIO
from fastpersist.writer import TEMP_SUFFIX
from tests.support.held_save import held_save


def temporaries(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.endswith(TEMP_SUFFIX))


class TemporariesAtStart(Callback):
    """Records the temporary files of a directory when training starts (after the preflight, before any save)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.found: list[str] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: BoringModel) -> None:
        self.found = temporaries(self.directory)


@pytest.mark.slow
def test_a_trainer_start_removes_a_killed_saves_temporary_and_keeps_a_live_saves(ckpt_dir: Path, caplog) -> None:
    with held_save("nvme", str(ckpt_dir / "last.ckpt")) as killed, held_save("nvme", str(ckpt_dir / "epoch=9.ckpt")) as live:
        (killed_temporary,) = [name for name in temporaries(ckpt_dir) if name.startswith(".last.ckpt.")]
        (live_temporary,) = [name for name in temporaries(ckpt_dir) if name.startswith(".epoch=9.ckpt.")]
        killed.kill()
        killed.wait(30)
        assert temporaries(ckpt_dir) == sorted([killed_temporary, live_temporary])

        start = TemporariesAtStart(ckpt_dir)
        trainer = Trainer(max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, accelerator="cpu", devices=1,
                          plugins=[FastPersistCheckpointIO(io_buffer_mb=4)],
                          callbacks=[start, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
        trainer.fit(BoringModel())
        assert start.found == [live_temporary], "at the start of training, only the live save's temporary is left"
        assert "removed 1 temporary file(s)" in caplog.text
        assert live.poll() is None
        assert temporaries(ckpt_dir) == [live_temporary]
