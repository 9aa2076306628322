"""``FastPersistCheckpointIO``: a Lightning ``CheckpointIO`` that saves with FastPersist."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from fastpersist.context import DEFAULT_BUFFER_MB, FastPersistContext
from fastpersist.reader import fastpersist_load
from fastpersist.writer import SaveStats, fastpersist_save
from lightning_storage_plugins.ordering import SaveOrder

log = logging.getLogger(__name__)


def _local_path(path: _PATH) -> str:
    """The absolute local path of ``path``; a URL of another storage is refused."""
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if sep and scheme.isidentifier():
        if scheme != "file":
            raise ValueError(f"{text!r} is a {scheme}:// URL; FastPersistCheckpointIO writes local files "
                             "(give a path on a local or NVMe filesystem)")
        text = rest
    return os.path.abspath(text)


class FastPersistCheckpointIO(CheckpointIO):
    """Saves checkpoints as torch.load-compatible files with aligned async NVMe writes.

    Use as ``Trainer(plugins=[FastPersistCheckpointIO()])``; wrap it in ``AsyncCheckpointIO`` to save in
    the background. Files load with plain ``torch.load`` too. The staging buffer and I/O handle live
    in a :class:`~fastpersist.FastPersistContext` owned by this plugin (created on first use, freed
    by :meth:`teardown`), unless you pass your own.

    Args:
        io_buffer_mb: size of the pinned staging buffer.
        engine: ``"aio"`` (default), ``"python"`` or ``"gds"`` (falls back with a warning).
        context: a context to use instead of creating one (``io_buffer_mb`` and ``engine`` are then
            ignored; the caller frees it).

    Raises:
        ValueError: unknown engine or non-positive ``io_buffer_mb``.
    """

    def __init__(
        self,
        io_buffer_mb: float = DEFAULT_BUFFER_MB,
        engine: str | None = None,
        *,
        context: FastPersistContext | None = None,
    ) -> None:
        super().__init__()
        self._owns_context = context is None
        self.context = context or FastPersistContext(engine=engine, io_buffer_mb=io_buffer_mb)
        self.last_stats: SaveStats | None = None
        self._order = SaveOrder(os.path.lexists)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` atomically to ``path`` (its directory is created).

        Args:
            checkpoint: the state to save.
            path: destination file.
            storage_options: not supported; must be ``None``.

        Raises:
            TypeError: ``storage_options`` was given.
            ValueError: ``path`` is a URL of another storage (``gs://...``).
            OSError: the write failed; the previous file at ``path`` is intact.
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} does not support `storage_options`, got {storage_options!r}"
            )
        key = _local_path(path)
        if not self._order.begin_save(key):
            log.debug("not saving %s: it was removed before its save ran", key)
            return
        remove = False
        try:
            os.makedirs(os.path.dirname(key), exist_ok=True)
            self.last_stats = fastpersist_save(checkpoint, key, context=self.context)
        finally:
            remove = self._order.end_save(key)
        if remove:
            self._remove(key)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint written by this plugin or by ``torch.save``.

        Args:
            path: the checkpoint file.
            map_location: as for ``torch.load``.
            weights_only: as for ``torch.load``; ``None`` means torch's default.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: ``path`` is a URL of another storage (``gs://...``).
            fastpersist.CheckpointFormatError: the file is not a readable checkpoint.
        """
        if not os.path.exists(_local_path(path)):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return fastpersist_load(path, map_location, weights_only, context=self.context)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint at ``path`` if present, and cancel a save of it not yet written.

        Args:
            path: the checkpoint file (or directory).
        """
        key = _local_path(path)
        self._order.removing(key)
        self._remove(key)

    @staticmethod
    def _remove(path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
        log.debug("removed checkpoint %s", path)

    @override
    def teardown(self) -> None:
        """Free the staging buffer and handle of the plugin's own context (a later save makes new ones)."""
        self._order.reset()
        if self._owns_context:
            self.context.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_order"]  # holds a lock; a copy starts with no saves in flight
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._order = SaveOrder(os.path.lexists)
