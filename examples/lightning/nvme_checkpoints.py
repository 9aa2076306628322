"""Train with FastPersist checkpoints (aligned async O_DIRECT writes), saved in the background.

The files are ordinary torch.save zips: stock ``torch.load`` reads them.
"""

import argparse
import tempfile

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from fastpersist import FastPersistCheckpointIO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dirpath", help="a directory on NVMe (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as scratch:
        dirpath = args.dirpath or scratch
        trainer = Trainer(
            plugins=[AsyncCheckpointIO(FastPersistCheckpointIO(io_buffer_mb=64))],
            callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2)],
            max_steps=6, limit_val_batches=0, logger=False, enable_progress_bar=False,
        )
        trainer.fit(BoringModel())
        state = torch.load(f"{dirpath}/last.ckpt", weights_only=True)
        print("last.ckpt read by stock torch.load at step", state["global_step"])


if __name__ == "__main__":
    main()
