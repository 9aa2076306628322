"""Lightning strategies whose sharded checkpoints live on NVMe (FastPersist).

    trainer = Trainer(strategy=FastPersistFSDPStrategy(state_dict_type="sharded"),
                      default_root_dir="/mnt/nvme0/run")

Model, optimizer and trainer state go through :class:`FastPersistStorageWriter` as one DCP checkpoint
per ``ModelCheckpoint`` path (a directory); ``ckpt_path=`` resumes from one, and top-k removal
deletes the whole directory.
"""

from __future__ import annotations

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from fastpersist.context import FastPersistContext
from fastpersist.dcp import FastPersistStorageReader, FastPersistStorageWriter
from lightning_storage_plugins.sharded import ShardedFSDPMixin, ShardedModelParallelMixin

__all__ = ["FastPersistFSDPStrategy", "FastPersistModelParallelStrategy"]


class _FastPersistStorage:
    """Writers and readers that share one :class:`FastPersistContext` (handle, staging buffer), made
    on first use from ``writer_options`` (``engine``, ``io_buffer_mb``) unless one is given there."""

    writer_options: dict
    reader_options: dict
    _fastpersist_context: FastPersistContext | None = None

    def _context(self) -> FastPersistContext:
        given = self.writer_options.get("context")
        if given is not None:
            return given
        if self._fastpersist_context is None:
            settings = {key: self.writer_options[key] for key in ("engine", "io_buffer_mb") if key in self.writer_options}
            self._fastpersist_context = FastPersistContext(**settings)
        return self._fastpersist_context

    def storage_writer(self, path: str) -> FastPersistStorageWriter:
        """A :class:`FastPersistStorageWriter` for ``path`` with ``writer_options``."""
        return FastPersistStorageWriter(path, **{**self.writer_options, "context": self._context()})

    def storage_reader(self, path: str, weights_only: bool | None = None) -> FastPersistStorageReader:
        """A :class:`FastPersistStorageReader` for ``path`` with ``reader_options``."""
        options = {"context": self._context(), **self.reader_options}
        return FastPersistStorageReader(path, weights_only=weights_only, **options)

    def teardown(self) -> None:
        """Lightning's teardown, then free the staging buffer and threads of the context made here."""
        super().teardown()  # type: ignore[misc]
        if self._fastpersist_context is not None:
            self._fastpersist_context.close()


class FastPersistFSDPStrategy(_FastPersistStorage, ShardedFSDPMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy``; with ``state_dict_type="sharded"`` its checkpoints go to NVMe.

    Args:
        writer_options: keyword arguments for :class:`FastPersistStorageWriter` (``context``, ``engine``, ``io_buffer_mb``).
        reader_options: keyword arguments for :class:`FastPersistStorageReader`.
        *args, **kwargs: as for ``FSDPStrategy``.
    """


class FastPersistModelParallelStrategy(_FastPersistStorage, ShardedModelParallelMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with its distributed checkpoints on NVMe.

    Args:
        writer_options: keyword arguments for :class:`FastPersistStorageWriter` (``context``, ``engine``, ``io_buffer_mb``).
        reader_options: keyword arguments for :class:`FastPersistStorageReader`.
        *args, **kwargs: as for ``ModelParallelStrategy``.
    """
