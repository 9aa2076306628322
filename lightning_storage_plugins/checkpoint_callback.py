"""``ModelCheckpoint`` that finds the last checkpoint of a remote directory for ``ckpt_path="last"``."""

from __future__ import annotations

import lightning.pytorch as pl
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_storage_plugins._lightning_compat import checkpoint_filesystem

__all__ = ["RemoteModelCheckpoint"]


class RemoteModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose last checkpoints in a remote directory keep their URLs.

    For ``ckpt_path="last"``, Lightning lists the checkpoint directory through fsspec and passes each
    name through ``os.path.normpath``. fsspec names a remote file without its protocol
    (``bucket/run1/last.ckpt``), so Lightning then looks for a local file, finds none, and trains
    from scratch. This gives the names their URLs back (``gs://bucket/run1/last.ckpt``). It takes
    ``ModelCheckpoint``'s arguments.
    """

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        found = super()._find_last_checkpoints(trainer)
        filesystem = checkpoint_filesystem(self)
        if isinstance(filesystem, LocalFileSystem):
            return found
        return {filesystem.unstrip_protocol(path) for path in found}
