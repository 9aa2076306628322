"""Lightning strategies whose sharded checkpoints live on Google Cloud Storage.

    trainer = Trainer(strategy=DatafluxFSDPStrategy(state_dict_type="sharded"),
                      default_root_dir="gs://bucket/run")

Model, optimizer and trainer state go through :class:`DatafluxStorageWriter` as one DCP checkpoint
per ``ModelCheckpoint`` path (an object prefix); ``ckpt_path=`` resumes from one, and top-k removal
deletes the whole prefix.
"""

from __future__ import annotations

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from dataflux_ckpt.dcp import DatafluxStorageReader, DatafluxStorageWriter
from lightning_storage_plugins.sharded import ShardedFSDPMixin, ShardedModelParallelMixin

__all__ = ["DatafluxFSDPStrategy", "DatafluxModelParallelStrategy"]


class _DatafluxStorage:
    writer_options: dict
    reader_options: dict

    def storage_writer(self, path: str) -> DatafluxStorageWriter:
        """A :class:`DatafluxStorageWriter` for ``path`` with ``writer_options``."""
        return DatafluxStorageWriter(path, **self.writer_options)

    def storage_reader(self, path: str, weights_only: bool | None = None) -> DatafluxStorageReader:
        """A :class:`DatafluxStorageReader` for ``path`` with ``reader_options``."""
        return DatafluxStorageReader(path, weights_only=weights_only, **self.reader_options)


class DatafluxFSDPStrategy(_DatafluxStorage, ShardedFSDPMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy``; with ``state_dict_type="sharded"`` its checkpoints go to ``gs://``.

    Args:
        writer_options: keyword arguments for :class:`DatafluxStorageWriter` (``chunk_size``, ...).
        reader_options: keyword arguments for :class:`DatafluxStorageReader`.
        *args, **kwargs: as for ``FSDPStrategy``.
    """


class DatafluxModelParallelStrategy(_DatafluxStorage, ShardedModelParallelMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with its distributed checkpoints on ``gs://``.

    Args:
        writer_options: keyword arguments for :class:`DatafluxStorageWriter` (``chunk_size``, ...).
        reader_options: keyword arguments for :class:`DatafluxStorageReader`.
        *args, **kwargs: as for ``ModelParallelStrategy``.
    """
