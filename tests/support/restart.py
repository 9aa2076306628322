"""A restarted training job: a new process that fits a BoringModel through a storage plugin.

    python -m tests.support.restart --scheme gs --root gs://bucket/run --max-steps 5 --gcs-url URL

It resumes as Lightning decides (``--ckpt-path``; none: under Slurm, the newest ``hpc_ckpt_N`` in
``default_root_dir``), then prints one JSON line: the step it started at, the checkpoint it resumed
from, the step it ended at, and where Lightning's Slurm handler would save its next hpc checkpoint.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from typing import Any

from dataflux_ckpt.emulator import activated, configure_gcsfs_for_emulator

configure_gcsfs_for_emulator()  # before anything imports gcsfs


def _storage(args: argparse.Namespace) -> tuple[Any, type]:
    if args.scheme == "gs":
        from dataflux_ckpt import DatafluxCheckpointIO, DatafluxModelCheckpoint
        from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES

        return DatafluxCheckpointIO(chunk_size=RESUMABLE_CHUNK_MULTIPLE_BYTES, max_workers=2), DatafluxModelCheckpoint
    from smartredis_io import SmartRedisCheckpointIO, SmartRedisModelCheckpoint

    return SmartRedisCheckpointIO(args.redis), SmartRedisModelCheckpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scheme", choices=("gs", "redis"), required=True)
    parser.add_argument("--root", required=True, help="the Trainer's default_root_dir")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--gcs-url", help="the fake-gcs-server to use (gs)")
    parser.add_argument("--redis", help="the database's address (redis)")
    args = parser.parse_args()

    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    starts: list[int] = []

    class StartStep(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            starts.append(trainer.global_step)

    with ExitStack() as stack:
        if args.gcs_url:
            stack.enter_context(activated(args.gcs_url))
        plugin, checkpoint = _storage(args)
        trainer = Trainer(
            max_steps=args.max_steps, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
            accelerator="cpu", devices=1, default_root_dir=args.root, logger=False, plugins=[plugin],
            callbacks=[StartStep(), checkpoint(every_n_train_steps=2, save_last=True)],
        )
        trainer.fit(BoringModel(), ckpt_path=args.ckpt_path)
        print(json.dumps({
            "start": starts[0], "ckpt_path": trainer.ckpt_path, "global_step": trainer.global_step,
            "next_hpc": trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir),
        }), flush=True)


if __name__ == "__main__":
    main()
