"""``FastPersistCheckpointIO``: a Lightning ``CheckpointIO`` that saves with FastPersist."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from fastpersist.context import DEFAULT_BUFFER_MB, FastPersistContext
from fastpersist.reader import fastpersist_load
from fastpersist.writer import SaveStats, fastpersist_save

log = logging.getLogger(__name__)


class _SaveOrder:
    """Keeps removals and saves of one path in the order they were asked for.

    ``AsyncCheckpointIO`` queues saves on a worker thread but removes at once on the training thread,
    so ``ModelCheckpoint`` can remove a checkpoint whose save has not been written yet; that save
    would then publish it afterwards and the file would never go away. A removal of a path whose save
    is running, or (once saves are seen on another thread) of a path not yet on disk, cancels that
    save instead: a queued one is skipped, a running one is removed as soon as it lands.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saving: dict[str, int] = {}
        self._cancelled: set[str] = set()
        self._save_threads: set[int] = set()

    def begin_save(self, key: str) -> bool:
        """Whether to go on with a save of ``key`` (False: it was removed before it could run)."""
        with self._lock:
            if key in self._cancelled and key not in self._saving:
                self._cancelled.discard(key)
                return False
            self._saving[key] = self._saving.get(key, 0) + 1
            self._save_threads.add(threading.get_ident())
            return True

    def end_save(self, key: str) -> bool:
        """Whether the file just saved at ``key`` must be removed (a removal came while it ran)."""
        with self._lock:
            count = self._saving.pop(key) - 1
            if count:
                self._saving[key] = count
                return False
            if key in self._cancelled:
                self._cancelled.discard(key)
                return True
            return False

    def removing(self, key: str) -> None:
        with self._lock:
            saves_elsewhere = bool(self._save_threads - {threading.get_ident()})
            if key in self._saving or (saves_elsewhere and not os.path.lexists(key)):
                self._cancelled.add(key)


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
        self._order = _SaveOrder()

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
            OSError: the write failed; the previous file at ``path`` is intact.
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} does not support `storage_options`, got {storage_options!r}"
            )
        key = os.path.abspath(os.fspath(path))
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
            fastpersist.CheckpointFormatError: the file is not a readable checkpoint.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return fastpersist_load(path, map_location, weights_only, context=self.context)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint at ``path`` if present, and cancel a save of it not yet written.

        Args:
            path: the checkpoint file (or directory).
        """
        key = os.path.abspath(os.fspath(path))
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
        if self._owns_context:
            self.context.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_order"]  # holds a lock; a copy starts with no saves in flight
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._order = _SaveOrder()
