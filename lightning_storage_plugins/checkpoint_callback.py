"""``ModelCheckpoint`` that finds the last checkpoint of a remote directory for ``ckpt_path="last"``."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import lightning.pytorch as pl
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_storage_plugins._lightning_compat import checkpoint_directory

__all__ = ["RemoteModelCheckpoint"]


class RemoteModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that finds the last checkpoints of a remote directory, with their URLs.

    For ``ckpt_path="last"``, Lightning asks each ``ModelCheckpoint`` for its last checkpoints
    before the callbacks' ``setup``. Stock ``ModelCheckpoint`` then lists its directory through the
    filesystem of its ``dirpath``, and without one (a directory from ``Trainer(default_root_dir=...)``
    or a logger's ``save_dir``) that is the local filesystem, which has no ``gs://`` or ``redis://``
    directory: the run trains from scratch. Each name it finds also goes through
    ``os.path.normpath``, and fsspec names a remote file without its protocol
    (``bucket/run1/last.ckpt``), so Lightning looks for a local file, again finds none, and trains
    from scratch.

    This resolves the directory as Lightning does in ``setup`` (``dirpath``, else the first logger's
    ``save_dir/name/version/checkpoints``, else ``default_root_dir/checkpoints``), lists it through
    that directory's own fsspec filesystem and gives the names their URLs back
    (``gs://bucket/run1/last.ckpt``). It takes ``ModelCheckpoint``'s arguments.
    """

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        directory = self.checkpoint_directory(trainer)
        filesystem, path = url_to_fs(directory)
        if isinstance(filesystem, LocalFileSystem):
            return super()._find_last_checkpoints(trainer)
        # The plugins write behind fsspec's back: a listing it cached (gcsfs does) may miss them.
        filesystem.invalidate_cache(path)
        if not filesystem.exists(path):
            return set()
        last = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?")
        found = set()
        try:
            for name in filesystem.ls(path, detail=False):
                file = PurePosixPath(name)
                if file.suffix == self.FILE_EXTENSION and last.match(file.stem):
                    found.add(filesystem.unstrip_protocol(name))
        finally:
            # Not left cached: gcsfs answers info() from its parent's listing, where a sharded
            # checkpoint's prefix comes before the commit record at its name, and Lightning then
            # finds no modification time to date the candidate by (KeyError: 'mtime').
            filesystem.invalidate_cache(path)
        return found

    def checkpoint_directory(self, trainer: pl.Trainer) -> str:
        """The directory this callback saves in for ``trainer``, as Lightning resolves it (before
        ``setup`` too): ``dirpath``, else the first logger's ``save_dir/name/version/checkpoints``
        (``default_root_dir`` for a logger without a ``save_dir``), else
        ``default_root_dir/checkpoints``."""
        return checkpoint_directory(self, trainer)

