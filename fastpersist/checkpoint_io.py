"""``FastPersistCheckpointIO``: a Lightning CheckpointIO that saves with FastPersist."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH

from fastpersist.handles import DEFAULT_BUFFER_MB, get_pinned_buffer, release_pinned_buffer
from fastpersist.reader import fastpersist_load
from fastpersist.writer import SaveStats, fastpersist_save

log = logging.getLogger(__name__)


class FastPersistCheckpointIO(CheckpointIO):
    """Saves checkpoints as torch.save-compatible files with aligned async NVMe writes.

    Use as ``Trainer(plugins=[FastPersistCheckpointIO()])``; wrap it in ``AsyncCheckpointIO`` to save in
    the background. Files load with plain ``torch.load`` too.

    Args:
        io_buffer_mb: size of the pinned staging buffer this plugin allocates on first save or load.
        engine: ``"aio"`` (default), ``"python"`` or ``"gds"`` (falls back with a warning).
        aio_handle: a DeepSpeed aio handle to use (default: the shared one).
        pinned_buffer: staging memory to use instead of allocating one (not freed by ``teardown``).
    """

    def __init__(
        self,
        io_buffer_mb: int = DEFAULT_BUFFER_MB,
        engine: str | None = None,
        aio_handle: Any = None,
        pinned_buffer: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.io_buffer_mb = io_buffer_mb
        self.engine = engine
        self.aio_handle = aio_handle
        self.last_stats: SaveStats | None = None
        self._buffer = pinned_buffer
        self._owns_buffer = False
        self._lock = threading.Lock()

    def _staging(self) -> torch.Tensor:
        with self._lock:
            if self._buffer is None:
                self._buffer = get_pinned_buffer(self.io_buffer_mb, self.aio_handle)
                self._owns_buffer = True
            return self._buffer

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` atomically to ``path`` (its directory is created).

        Raises:
            TypeError: ``storage_options`` was given (this plugin has none).
            OSError: the write failed; the previous file at ``path`` is intact.
        """
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} does not support `storage_options`, got {storage_options!r}"
            )
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.last_stats = fastpersist_save(
            checkpoint, path, self.aio_handle, self._staging(), engine=self.engine
        )

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint written by this plugin or by ``torch.save``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return fastpersist_load(
            path, map_location, weights_only, self.aio_handle, self._staging(), engine=self.engine
        )

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint file (or directory) at ``path`` if present."""
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        log.debug("removed checkpoint %s", path)

    def teardown(self) -> None:
        """Free the staging buffer this plugin allocated (a later save allocates a new one)."""
        with self._lock:
            if self._owns_buffer and self._buffer is not None:
                release_pinned_buffer(self._buffer, self.aio_handle)
                self._buffer = None
                self._owns_buffer = False
