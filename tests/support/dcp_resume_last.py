"""One start of a Lightning run with a Dataflux sharded strategy, resuming with ``ckpt_path="last"``.

    python -m tests.support.dcp_resume_last --kind fsdp --root gs://bucket/run --max-steps 4 \\
        [--dirpath] [--fail-at 5] --gcs-url http://127.0.0.1:PORT

One rank (torchrun's environment, so that Lightning launches nothing), ``DatafluxModelCheckpoint(
save_last=True)`` every 2 steps (its directory given as ``dirpath``, or from ``Trainer(default_root_dir=
...)``) and ``OnExceptionCheckpoint`` in the same directory; with ``--fail-at N`` the step N raises, and
Lightning saves ``on_exception.ckpt`` before the process exits; with ``--kill-at N`` the process
SIGKILLs itself at step N. It prints a JSON line when training starts (the step and checkpoint it
started from) and one when it ends (the step it reached).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.dcp_resume_last")
    parser.add_argument("--kind", choices=["fsdp", "model_parallel"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--dirpath", action="store_true", help="give ModelCheckpoint its directory")
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--gcs-url", required=True)
    args = parser.parse_args(argv)

    from dataflux_ckpt.emulator import activated, configure_gcsfs_for_emulator
    from lightning_storage_plugins.services import free_port
    from tests.support.dcp_lightning import _strategy, model_class, torchrun_environ

    configure_gcsfs_for_emulator()
    os.environ.update(torchrun_environ(0, 1, free_port()))
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    from dataflux_ckpt import DatafluxModelCheckpoint

    base = model_class(args.kind)

    class Model(base):  # type: ignore[misc, valid-type]
        def on_train_start(self) -> None:
            super().on_train_start()
            print(json.dumps({"started_at": self.global_step, "ckpt_path": self.trainer.ckpt_path}), flush=True)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.global_step == args.fail_at:
                raise RuntimeError(f"failing at step {args.fail_at}, as asked")
            if self.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().training_step(batch, batch_idx)

    directory = f"{args.root}/checkpoints"
    checkpoint = DatafluxModelCheckpoint(dirpath=directory if args.dirpath else None, every_n_train_steps=2,
                                         save_top_k=0, save_last=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=_strategy(args.kind, "gs"), max_steps=args.max_steps,
                        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=args.root,
                        callbacks=[checkpoint, OnExceptionCheckpoint(directory, filename="on_exception")])
    torch.manual_seed(0)
    model = Model()
    with activated(args.gcs_url):
        try:
            trainer.fit(model, ckpt_path="last")
        except RuntimeError as error:
            if args.fail_at is None or "as asked" not in str(error):
                raise
    print(json.dumps({"reached": trainer.global_step}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
