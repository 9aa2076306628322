"""Lightning strategies whose sharded checkpoints live on Google Cloud Storage.

    trainer = Trainer(strategy=DatafluxFSDPStrategy(state_dict_type="sharded"),
                      default_root_dir="gs://bucket/run")

Model, optimizer and trainer state go through :class:`DatafluxStorageWriter` as one DCP checkpoint
per ``ModelCheckpoint`` path (an object prefix); ``ckpt_path=`` resumes from one, and top-k removal
deletes the whole prefix.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from dataflux_ckpt.dcp import DatafluxStorageReader, DatafluxStorageWriter
from dataflux_ckpt.options import FIELDS, TransferOptions, resolve_options
from lightning_storage_plugins.sharded import ShardedFSDPMixin, ShardedModelParallelMixin

__all__ = ["DatafluxFSDPStrategy", "DatafluxModelParallelStrategy"]


class _DatafluxStorage:
    writer_options: dict
    reader_options: dict

    def __init__(self, *args: Any, options: TransferOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = options
        # A conflict or an option out of range is reported here, not at the first save or load.
        for owner, given in (("writer_options", self.writer_options), ("reader_options", self.reader_options)):
            if options is not None and given.get("options") is not None:
                raise TypeError(f"{type(self).__name__}: options given twice, as options= and in {owner}")
            resolve_options(f"{type(self).__name__} {owner}", given.get("options", options),
                            **{name: value for name, value in given.items() if name in FIELDS})

    def _storage_options(self, given: dict[str, Any]) -> dict[str, Any]:
        return given if self.options is None else {"options": self.options, **given}

    def storage_writer(self, path: str) -> DatafluxStorageWriter:
        """A :class:`DatafluxStorageWriter` for ``path`` with ``options`` and ``writer_options``."""
        return DatafluxStorageWriter(path, **self._storage_options(self.writer_options))

    def storage_reader(self, path: str, weights_only: bool | None = None) -> DatafluxStorageReader:
        """A :class:`DatafluxStorageReader` for ``path`` with ``options`` and ``reader_options``."""
        return DatafluxStorageReader(path, weights_only=weights_only, **self._storage_options(self.reader_options))


class DatafluxFSDPStrategy(_DatafluxStorage, ShardedFSDPMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy``; with ``state_dict_type="sharded"`` its checkpoints go to ``gs://``.

    Args:
        options: the :class:`~dataflux_ckpt.TransferOptions` of every save and load.
        writer_options: keyword arguments for :class:`DatafluxStorageWriter` (``overwrite``, ``chunk_size``,
            ...); a transfer option here must agree with ``options``.
        reader_options: keyword arguments for :class:`DatafluxStorageReader`.
        *args, **kwargs: as for ``FSDPStrategy``.

    Raises:
        TypeError, ValueError: as :class:`~dataflux_ckpt.TransferOptions`, for ``options`` and the
            transfer options among ``writer_options`` and ``reader_options``.
    """


class DatafluxModelParallelStrategy(_DatafluxStorage, ShardedModelParallelMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with its distributed checkpoints on ``gs://``.

    Args:
        options: the :class:`~dataflux_ckpt.TransferOptions` of every save and load.
        writer_options: keyword arguments for :class:`DatafluxStorageWriter` (``overwrite``, ``chunk_size``,
            ...); a transfer option here must agree with ``options``.
        reader_options: keyword arguments for :class:`DatafluxStorageReader`.
        *args, **kwargs: as for ``ModelParallelStrategy``.

    Raises:
        TypeError, ValueError: as :class:`~dataflux_ckpt.TransferOptions`, for ``options`` and the
            transfer options among ``writer_options`` and ``reader_options``.
    """
