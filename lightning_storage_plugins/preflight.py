"""Checks a storage plugin makes when training starts, before the first step.

A ``CheckpointIO`` gets no set-up hook from Lightning; a callback does. :class:`StoragePreflight`
finds the strategy's CheckpointIO when fitting starts (``on_fit_start``: every ``ModelCheckpoint``
directory is known then) and, if it is one of the single-file plugins, asks it to check those
directories on global rank zero: a missing bucket, a local directory given to the GCS plugin or a
database that cannot be reached is reported then, on every rank, not at the first save hours later.

Lightning adds the callback by itself to every ``Trainer`` made in a process where one of the
plugins exists, through its ``lightning.pytorch.callbacks_factory`` entry point (this distribution
registers :func:`callbacks`); pass ``StoragePreflight()`` in ``callbacks=`` where the package is not
installed (a source checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_storage_plugins.ordering import CheckpointDir, OrderedCheckpointIO, live_plugins

__all__ = ["StoragePreflight", "callbacks"]

log = logging.getLogger(__name__)


def storage_plugin(checkpoint_io: CheckpointIO | None) -> OrderedCheckpointIO | None:
    """The single-file plugin behind ``checkpoint_io`` (inside ``AsyncCheckpointIO`` too), if any."""
    for _ in range(8):  # wrappers of wrappers, but never a cycle
        if isinstance(checkpoint_io, OrderedCheckpointIO):
            return checkpoint_io
        checkpoint_io = getattr(checkpoint_io, "checkpoint_io", None)
    return None


class StoragePreflight(Callback):
    """Asks the Trainer's storage plugin to check where ``ModelCheckpoint`` will save, when fitting starts.

    Raises (from ``Trainer.fit``, before the first step, on every rank):
        Whatever the plugin's ``preflight`` raises: ``ValueError`` for a directory the plugin cannot
        save to, ``dataflux_ckpt.BucketNotFoundError``, ``smartredis_io.RedisConnectionError``...
    """

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plugin = storage_plugin(trainer.strategy.checkpoint_io)
        first = next(callback for callback in trainer.callbacks if isinstance(callback, StoragePreflight))
        if plugin is None or first is not self:  # one check, however many were added
            return
        dirs = [CheckpointDir(str(callback.dirpath), callback.save_last == "link")
                for callback in trainer.checkpoint_callbacks
                if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None]
        error: BaseException | None = None
        if trainer.is_global_zero:
            try:
                plugin.preflight(dirs)
            except Exception as exc:  # every rank raises it, not rank zero alone
                error = exc
        shared = trainer.strategy.broadcast(_picklable(error), src=0)
        if error is not None:
            raise error
        if shared is not None:
            raise shared


def _picklable(error: BaseException | None) -> BaseException | None:
    """``error``, or a ``RuntimeError`` with its text where it does not pickle (to send it to other ranks)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def callbacks() -> list[Any]:
    """Lightning's ``lightning.pytorch.callbacks_factory`` entry point: a :class:`StoragePreflight`
    for each new ``Trainer`` while one of the single-file plugins exists in this process, else none."""
    return [StoragePreflight()] if live_plugins() else []
