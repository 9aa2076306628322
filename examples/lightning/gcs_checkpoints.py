"""Train with checkpoints on Google Cloud Storage through DatafluxCheckpointIO, then resume.

Runs offline against a local GCS emulator; point ``--dirpath`` at a real ``gs://bucket/prefix`` (with
application default credentials) to use GCS itself.
"""

import argparse

from dataflux_ckpt.emulator import configure_gcsfs_for_emulator

configure_gcsfs_for_emulator()  # before Lightning's ModelCheckpoint imports gcsfs

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from dataflux_ckpt import DatafluxCheckpointIO, DatafluxModelCheckpoint  # noqa: E402
from dataflux_ckpt.testing import FakeGcsServer  # noqa: E402


def train(dirpath: str, max_steps: int, ckpt_path: str | None = None) -> Trainer:
    trainer = Trainer(
        plugins=[DatafluxCheckpointIO()],
        # DatafluxModelCheckpoint: ModelCheckpoint whose ckpt_path="last" finds gs:// checkpoints
        callbacks=[DatafluxModelCheckpoint(dirpath=dirpath, save_top_k=2, monitor="step", mode="max",
                                           every_n_train_steps=2, save_last=True)],
        max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dirpath", help="gs://bucket/prefix (default: a bucket on a local emulator)")
    args = parser.parse_args()
    if args.dirpath:
        run(args.dirpath)
        return
    with FakeGcsServer() as gcs, gcs.activated():
        gcs.create_bucket("example-ckpts")
        run("gs://example-ckpts/run1")


def run(dirpath: str) -> None:
    first = train(dirpath, max_steps=6)
    print("saved:", first.checkpoint_callback.best_model_path)
    resumed = train(dirpath, max_steps=10, ckpt_path="last")
    print(f"resumed from {resumed.ckpt_path}, now at step {resumed.global_step}")


if __name__ == "__main__":
    main()
