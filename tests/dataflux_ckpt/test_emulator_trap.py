"""The README's GCS quick start, minus ``configure_gcsfs_for_emulator()``, with gcsfs imported first.

gcsfs imported with its bucket-type probe on sends a gRPC call to the emulator's HTTP port on every
bucket access, each retried for 60 s; ``activated()`` has fsspec use gcsfs' plain filesystem instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from dataflux_ckpt.emulator import GCSFS_PROBE_ENV

QUICK_START = textwrap.dedent('''
    import time

    import gcsfs  # before any emulator configuration: the forgotten-call case

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from dataflux_ckpt import DatafluxCheckpointIO
    from dataflux_ckpt.testing import FakeGcsServer

    assert gcsfs.GCSFileSystem.__name__ == "ExtendedGcsFileSystem"


    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"])
            return out


    def trainer(max_steps):
        return Trainer(max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, plugins=[DatafluxCheckpointIO()],
                       callbacks=[ModelCheckpoint(dirpath="gs://ckpts/run1", monitor="train_loss", save_top_k=2,
                                                  every_n_train_steps=2, save_last=True)])


    start = time.monotonic()
    with FakeGcsServer() as gcs, gcs.activated():
        gcs.create_bucket("ckpts")
        trainer(max_steps=4).fit(Model())
        resumed = trainer(max_steps=6)
        resumed.fit(Model(), ckpt_path="gs://ckpts/run1/last.ckpt")
        assert resumed.global_step == 6
    print(f"ELAPSED {time.monotonic() - start:.2f}")
''')


def test_a_forgotten_emulator_configuration_works_within_10_s(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != GCSFS_PROBE_ENV}
    # A timeout well past 10 s so that today's behaviour (a minute per probe) fails on the assertion below.
    result = subprocess.run([sys.executable, "-c", QUICK_START], capture_output=True, text=True, timeout=120,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    elapsed = float(result.stdout.rsplit("ELAPSED ", 1)[1])
    assert elapsed < 10, f"the quick start took {elapsed:.1f} s after its imports"
    assert "Could not determine bucket type" not in result.stderr
    assert "Handshake failed" not in result.stderr
