"""Lightning strategies whose sharded checkpoints live on NVMe (FastPersist).

    trainer = Trainer(strategy=FastPersistFSDPStrategy(state_dict_type="sharded"),
                      default_root_dir="/mnt/nvme0/run")

Model, optimizer and trainer state go through :class:`FastPersistStorageWriter` as one DCP checkpoint
per ``ModelCheckpoint`` path (a directory); ``ckpt_path=`` resumes from one, and top-k removal
deletes the whole directory.
"""

from __future__ import annotations

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from fastpersist.dcp import FastPersistStorageReader, FastPersistStorageWriter
from lightning_storage_plugins.sharded import ShardedFSDPMixin, ShardedModelParallelMixin

__all__ = ["FastPersistFSDPStrategy", "FastPersistModelParallelStrategy"]


class _FastPersistStorage:
    writer_options: dict
    reader_options: dict

    def storage_writer(self, path: str) -> FastPersistStorageWriter:
        """A :class:`FastPersistStorageWriter` for ``path`` with ``writer_options``."""
        return FastPersistStorageWriter(path, **self.writer_options)

    def storage_reader(self, path: str, weights_only: bool | None = None) -> FastPersistStorageReader:
        """A :class:`FastPersistStorageReader` for ``path`` with ``reader_options``."""
        return FastPersistStorageReader(path, weights_only=weights_only, **self.reader_options)


class FastPersistFSDPStrategy(_FastPersistStorage, ShardedFSDPMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy``; with ``state_dict_type="sharded"`` its checkpoints go to NVMe.

    Args:
        writer_options: keyword arguments for :class:`FastPersistStorageWriter` (``io_buffer_mb``, ``engine``...).
        reader_options: keyword arguments for :class:`FastPersistStorageReader`.
        *args, **kwargs: as for ``FSDPStrategy``.
    """


class FastPersistModelParallelStrategy(_FastPersistStorage, ShardedModelParallelMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with its distributed checkpoints on NVMe.

    Args:
        writer_options: keyword arguments for :class:`FastPersistStorageWriter` (``io_buffer_mb``, ``engine``...).
        reader_options: keyword arguments for :class:`FastPersistStorageReader`.
        *args, **kwargs: as for ``ModelParallelStrategy``.
    """
