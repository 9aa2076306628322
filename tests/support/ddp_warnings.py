"""A real 2-process DDP run (CPU, gloo) in which every rank meets the same plugin warning twice.

Run as ``python tests/support/ddp_warnings.py OUT``: Lightning's subprocess launcher starts rank 1 by
running this script again. Each rank makes two ``FastPersistCheckpointIO(engine="gds")`` plugins
(on CPU the ``gds`` engine falls back, with a warning) and saves and loads through both; each rank
records what the ``fastpersist`` loggers said in ``OUT/rank<N>.log`` (one line per record:
``LEVEL message``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from fastpersist import FastPersistCheckpointIO


class UseTwoPlugins(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        handler = logging.FileHandler(self.out / f"rank{trainer.global_rank}.log")
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger = logging.getLogger("fastpersist")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for index in range(2):
            plugin = FastPersistCheckpointIO(io_buffer_mb=1, engine="gds")
            path = self.out / f"rank{trainer.global_rank}-{index}.ckpt"
            plugin.save_checkpoint({"w": torch.arange(4)}, path)
            assert torch.equal(plugin.load_checkpoint(path)["w"], torch.arange(4))
            plugin.teardown()


def main(out: Path) -> None:
    trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[UseTwoPlugins(out)])
    trainer.fit(BoringModel())
    (out / f"done{trainer.global_rank}").touch()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
