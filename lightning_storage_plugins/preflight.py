"""Checks a storage plugin makes when training starts, before the first step.

A ``CheckpointIO`` gets no set-up hook from Lightning; a callback does. :class:`StoragePreflight`
finds the strategy's storage when fitting starts (``on_fit_start``: every ``ModelCheckpoint``
directory is known then): one of the sharded-checkpoint strategies, or a single-file plugin as the
strategy's CheckpointIO. It asks that storage to check those directories and to remove what killed
saves left there, on global rank zero: a missing bucket, a local directory given to the GCS plugin
or a database that cannot be reached is reported then, on every rank, not at the first save hours
later. Before that, every rank cleans its own node's files (the sharded strategies' local tier).

Lightning adds the callback by itself to every ``Trainer`` made in a process where one of the
plugins or strategies exists, through its ``lightning.pytorch.callbacks_factory`` entry point (this
distribution registers :func:`callbacks`); pass ``StoragePreflight()`` in ``callbacks=`` where the
package is not installed (a source checkout on ``PYTHONPATH``).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_storage_plugins.ordering import (
    CheckpointDir,
    DeferringOperations,
    OrderedCheckpointIO,
    live_plugins,
)

__all__ = ["StoragePreflight", "callbacks"]

log = logging.getLogger(__name__)


def storage_plugin(checkpoint_io: CheckpointIO | None) -> OrderedCheckpointIO | None:
    """The single-file plugin behind ``checkpoint_io`` (inside ``AsyncCheckpointIO`` too), if any."""
    for _ in range(8):  # wrappers of wrappers, but never a cycle
        if isinstance(checkpoint_io, OrderedCheckpointIO):
            return checkpoint_io
        checkpoint_io = getattr(checkpoint_io, "checkpoint_io", None)
    return None


def _storages_of(trainer: Trainer) -> list[DeferringOperations[Any]]:
    """What a Trainer saves through of ours: its sharded-checkpoint strategy (sharded checkpoints), its
    single-file plugin (the strategy's CheckpointIO), or both."""
    storages: list[DeferringOperations[Any]] = []
    if isinstance(trainer.strategy, DeferringOperations):
        storages.append(trainer.strategy)
    plugin = storage_plugin(trainer.strategy.checkpoint_io)
    if plugin is not None:
        storages.append(plugin)
    return storages


class StoragePreflight(Callback):
    """Asks the Trainer's storage plugin or sharded-checkpoint strategy to check where ``ModelCheckpoint``
    will save, and to remove what killed saves left there, when fitting starts.

    Raises (from ``Trainer.fit``, before the first step, on every rank):
        Whatever the plugin's ``preflight`` raises (the sharded strategies' raises nothing):
        ``ValueError`` for a directory the plugin cannot save to, ``dataflux_ckpt.BucketNotFoundError``,
        ``smartredis_io.RedisConnectionError``...
    """

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        storages = _storages_of(trainer)
        first = next(callback for callback in trainer.callbacks if isinstance(callback, StoragePreflight))
        if not storages or first is not self:  # one check, however many were added
            return
        dirs = [CheckpointDir(str(callback.dirpath), callback.save_last == "link")
                for callback in trainer.checkpoint_callbacks
                if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None]
        for storage in storages:
            storage.node_preflight()
        error: BaseException | None = None
        if trainer.is_global_zero:
            try:
                for storage in storages:
                    storage.preflight(dirs)
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
    for each new ``Trainer`` while one of the single-file plugins or sharded-checkpoint strategies
    exists in this process, else none."""
    return [StoragePreflight()] if live_plugins() else []
