"""A GCS checkpoint directory that cannot work is refused when fitting starts, before the first step.

The check runs in a real ``Trainer`` against the session's fake-gcs-server: a missing bucket, a name
GCS would never accept, or a scheme other than ``gs://`` fails ``fit`` with a typed error naming the
directory, and no training step has run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from dataflux_ckpt import DatafluxCheckpointIO
from dataflux_ckpt.errors import BucketNotFoundError
from lightning_storage_plugins.preflight import StoragePreflight


class _CountSteps(Callback):
    steps = 0

    def on_train_batch_start(self, *args: object) -> None:
        self.steps += 1


def _fit(plugin: DatafluxCheckpointIO, dirpath: str, *extra: Callback) -> tuple[BaseException, int]:
    steps = _CountSteps()
    trainer = Trainer(max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                      plugins=[plugin], callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1),
                                                   steps, *extra])
    with pytest.raises(Exception) as failed:
        trainer.fit(BoringModel())
    return failed.value, steps.steps


def test_a_missing_bucket_is_refused_before_the_first_step(
        make_plugin: Callable[..., DatafluxCheckpointIO]) -> None:
    """Without ``callbacks=[StoragePreflight()]``: Lightning adds the check through this distribution's
    ``lightning.pytorch.callbacks_factory`` entry point (an install, editable or not, registers it)."""
    error, steps = _fit(make_plugin(), "gs://no-such-bucket-here/run")
    assert isinstance(error, BucketNotFoundError), repr(error)
    assert "no-such-bucket-here" in str(error) and steps == 0


@pytest.mark.parametrize(("dirpath", "words"), [
    ("gs://My_Bucket!/run", "'My_Bucket!' is not a valid GCS bucket name"),
    ("gcs://{bucket}/run", "must start with gs://"),
])
def test_a_bad_directory_is_refused_before_the_first_step(
        make_plugin: Callable[..., DatafluxCheckpointIO], gcs_bucket: str, dirpath: str, words: str) -> None:
    error, steps = _fit(make_plugin(), dirpath.format(bucket=gcs_bucket), StoragePreflight())
    assert isinstance(error, ValueError) and words in str(error), repr(error)
    assert steps == 0


def test_an_existing_bucket_passes_and_training_saves(
        make_plugin: Callable[..., DatafluxCheckpointIO], gcs_bucket: str) -> None:
    plugin = make_plugin()
    trainer = Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                      plugins=[plugin], callbacks=[ModelCheckpoint(dirpath=f"gs://{gcs_bucket}/preflight-ok",
                                                                   every_n_train_steps=1), StoragePreflight()])
    trainer.fit(BoringModel())
    assert plugin.list_checkpoints(f"gs://{gcs_bucket}/preflight-ok/")


@pytest.mark.parametrize("value", [1, "true", 0.0])
def test_weights_only_that_is_not_a_bool_is_refused_at_construction(value: object) -> None:
    with pytest.raises(TypeError, match="weights_only"):
        DatafluxCheckpointIO(weights_only=value)  # type: ignore[arg-type]
