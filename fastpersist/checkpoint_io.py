"""``FastPersistCheckpointIO``: a Lightning ``CheckpointIO`` that saves with FastPersist."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from typing_extensions import override

from fastpersist.context import DEFAULT_BUFFER_MB, FastPersistContext
from fastpersist.reader import fastpersist_load
from fastpersist.writer import SaveStats, fastpersist_save, remove_stale_temporaries
from lightning_storage_plugins.ordering import CheckpointDir, OrderedCheckpointIO, remove_local

log = logging.getLogger(__name__)


def _local_path(path: str | os.PathLike[str]) -> str:
    """The absolute local path of ``path``; a URL of another storage is refused."""
    text = os.fspath(path)
    scheme, sep, rest = text.partition("://")
    if sep and scheme.isidentifier():
        if scheme != "file":
            raise ValueError(f"{text!r} is a {scheme}:// URL; FastPersistCheckpointIO writes local files "
                             "(give a path on a local or NVMe filesystem)")
        text = rest
    return os.path.abspath(text)


class FastPersistCheckpointIO(OrderedCheckpointIO[str]):
    """Saves checkpoints as torch.load-compatible files with aligned async NVMe writes.

    Use as ``Trainer(plugins=[FastPersistCheckpointIO()])``; wrap it in ``AsyncCheckpointIO`` to save in
    the background. Files load with plain ``torch.load`` too. The staging buffer and I/O handle live
    in a :class:`~fastpersist.FastPersistContext` owned by this plugin (created on first use, freed
    by :meth:`teardown`), unless you pass your own. Saving creates the file's directory; removing a
    link (``ModelCheckpoint(save_last="link")``) removes the link, never the checkpoint it points to.

    Args:
        io_buffer_mb: the largest pinned staging buffer; a save gets one the size of the checkpoint,
            up to this, kept for the next save (and grown for a bigger one).
        engine: how saves write: ``"aio"`` (default), ``"python"`` or ``"gds"`` (falls back with a
            warning). Loads read straight into the tensors' memory whichever it is.
        context: a context to use instead of creating one (``io_buffer_mb`` and ``engine`` are then
            ignored; the caller frees it).
        weights_only: what ``load_checkpoint`` passes on when its caller passes ``None``, as for
            ``torch.load`` (``None``: torch's default).

    Raises:
        ValueError: unknown engine or non-positive ``io_buffer_mb``; at save or load, a path that is
            a URL of another storage (``gs://...``).
        TypeError: ``weights_only`` is not a bool or ``None``.
        OSError: a write failed; the previous file at the path is intact.
        fastpersist.CheckpointFormatError: at load, the file is not a readable checkpoint.
    """

    def __init__(
        self,
        io_buffer_mb: float = DEFAULT_BUFFER_MB,
        engine: str | None = None,
        *,
        context: FastPersistContext | None = None,
        weights_only: bool | None = None,
    ) -> None:
        super().__init__(weights_only=weights_only)
        self._owns_context = context is None
        self.context = context or FastPersistContext(engine=engine, io_buffer_mb=io_buffer_mb)
        self.last_stats: SaveStats | None = None

    @override
    def _target(self, path: str | os.PathLike[str]) -> str:
        return _local_path(path)

    @override
    def _write(self, checkpoint: dict[str, Any], target: str) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        self.last_stats = fastpersist_save(checkpoint, target, context=self.context)

    @override
    def _read(self, target: str, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        if not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        return fastpersist_load(target, map_location, weights_only, context=self.context)

    @override
    def _delete(self, target: str) -> None:
        if remove_local(target):
            log.debug("removed checkpoint %s", target)

    @override
    def _stored(self, target: str) -> bool:
        return os.path.lexists(target)

    @override
    def preflight(self, checkpoint_dirs: Sequence[CheckpointDir]) -> None:
        """Before the first step: refuse a ``ModelCheckpoint`` directory of another storage, create
        those in which ``save_last="link"`` makes its links, and remove the temporary files that
        saves killed in the middle left in them (never those of a save still running: see
        :func:`~fastpersist.writer.remove_stale_temporaries`).

        Lightning makes a ``last`` link as soon as it has asked for a save; behind
        ``AsyncCheckpointIO`` that save, which creates the directory, may not have run yet.
        """
        for checkpoint_dir in checkpoint_dirs:
            directory = _local_path(checkpoint_dir.dirpath)
            if checkpoint_dir.links:
                os.makedirs(directory, exist_ok=True)
            remove_stale_temporaries(directory)

    @override
    def _close(self) -> None:
        """Free the staging buffer and handle of the plugin's own context (a later save makes new ones)."""
        if self._owns_context:
            self.context.close()
