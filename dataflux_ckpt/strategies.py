"""Lightning strategies whose sharded checkpoints live on Google Cloud Storage.

    trainer = Trainer(strategy=DatafluxFSDPStrategy(state_dict_type="sharded"),
                      default_root_dir="gs://bucket/run")

Model, optimizer and trainer state go through :class:`DatafluxStorageWriter` as one DCP checkpoint
per ``ModelCheckpoint`` path (an object prefix); ``ckpt_path=`` resumes from one, and top-k removal
deletes the whole prefix. With ``local_dir``, every rank saves its shard to the node's NVMe and
training goes on while the checkpoint is uploaded (:mod:`dataflux_ckpt.tiered_dcp`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from typing_extensions import override

from dataflux_ckpt.dcp import DatafluxStorageReader, DatafluxStorageWriter
from dataflux_ckpt.options import FIELDS, TransferOptions, resolve_options
from dataflux_ckpt.tiered_dcp import ShardedLocalTier
from lightning_storage_plugins.dcp import METADATA_NAME
from lightning_storage_plugins.sharded import ShardedFSDPMixin, ShardedModelParallelMixin

__all__ = ["DatafluxFSDPStrategy", "DatafluxModelParallelStrategy"]

log = logging.getLogger(__name__)


class _DatafluxStorage:
    writer_options: dict
    reader_options: dict

    def __init__(self, *args: Any, options: TransferOptions | None = None,
                 local_dir: str | os.PathLike[str] | ShardedLocalTier | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options = options
        self.local_dir = local_dir
        self._local_tier: ShardedLocalTier | None = None
        self._save_round: int | None = None  # the global step of the save being written
        if local_dir is not None and not isinstance(local_dir, (str, os.PathLike, ShardedLocalTier)):
            raise TypeError(f"{type(self).__name__}: local_dir must be a directory or a ShardedLocalTier, not "
                            f"{local_dir!r}")
        # A conflict or an option out of range is reported here, not at the first save or load.
        for owner, given in (("writer_options", self.writer_options), ("reader_options", self.reader_options)):
            if options is not None and given.get("options") is not None:
                raise TypeError(f"{type(self).__name__}: options given twice, as options= and in {owner}")
            resolve_options(f"{type(self).__name__} {owner}", given.get("options", options),
                            **{name: value for name, value in given.items() if name in FIELDS})

    def _storage_options(self, given: dict[str, Any]) -> dict[str, Any]:
        return given if self.options is None else {"options": self.options, **given}

    def local_tier(self) -> ShardedLocalTier | None:
        """This process' local tier (``None`` without ``local_dir``): made on first use, with the
        writers' transfer options for the uploads a crashed process left."""
        if self.local_dir is None or isinstance(self.local_dir, ShardedLocalTier):
            return self.local_dir
        if self._local_tier is None:
            given = self._storage_options(self.writer_options)
            options = resolve_options(f"{type(self).__name__} writer_options", given.get("options"),
                                      **{name: value for name, value in given.items() if name in FIELDS})
            self._local_tier = ShardedLocalTier(self.local_dir, options=options,
                                                project_name=given.get("project_name"),
                                                storage_client=given.get("storage_client"))
        return self._local_tier

    def storage_writer(self, path: str) -> DatafluxStorageWriter:
        """A :class:`DatafluxStorageWriter` for ``path`` with ``options``, ``writer_options`` and the
        local tier (the saves of one ``global_step`` are one round of its ``remote_every``)."""
        return DatafluxStorageWriter(path, local_dir=self.local_tier(), save_round=self._save_round,
                                     **self._storage_options(self.writer_options))

    @override
    def _write(self, checkpoint: Any, target: str) -> None:
        step = checkpoint.checkpoint.get("global_step") if isinstance(checkpoint.checkpoint, dict) else None
        self._save_round = step
        try:
            super()._write(checkpoint, target)  # type: ignore[misc]
        finally:
            self._save_round = None

    def _remove_unsharded(self, target: str) -> None:
        # Through this plugin's client, never the strategy's CheckpointIO: fsspec's gcsfs answers from
        # listings it cached, which removals made here (a killed save's leftovers, at a restart) leave
        # stale, and then raises FileNotFoundError for a checkpoint already gone. The writer removes a
        # full checkpoint's object at the name, what a killed save or removal of a sharded one left
        # (its files, lock and commit record), or nothing when nothing is there.
        if "://" not in target:
            super()._remove_unsharded(target)  # type: ignore[misc]
            return
        self.storage_writer(target).remove()

    def storage_reader(self, path: str, weights_only: bool | None = None) -> DatafluxStorageReader:
        """A :class:`DatafluxStorageReader` for ``path`` with ``options``, ``reader_options`` and the
        local tier. ``path`` may also name a checkpoint by its ``.metadata`` (in GCS or, for a save
        of the local tier, its local file), as :meth:`last_checkpoints` gives them to Lightning."""
        return DatafluxStorageReader(self._checkpoint_of(path), weights_only=weights_only,
                                     local_dir=self.local_tier(), **self._storage_options(self.reader_options))

    def _checkpoint_of(self, path: str) -> str:
        text = os.fspath(path)
        tier = self.local_tier()
        if "://" not in text and tier is not None and (uri := tier.checkpoint_of(text)) is not None:
            return uri
        suffix = "/" + METADATA_NAME
        if "://" in text and text.endswith(suffix):
            return text[: -len(suffix)]
        return text

    def last_checkpoints(self, found: set[str], directory: str) -> set[str]:
        """For ``ckpt_path="last"``: the ``last`` checkpoints ``ModelCheckpoint`` listed in the
        ``gs://`` ``directory`` (``found``), and the local tier's (the local metadata files of its
        newest saves of them, which GCS may not hold yet). A sharded checkpoint is named by its
        commit record (the object at its own name, which Lightning dates), or where it has none (a
        checkpoint saved before commit records were written) by its ``.metadata`` object; a prefix
        with neither is what a save killed before its first commit left, not a checkpoint."""
        from fsspec.core import url_to_fs

        candidates = set()
        for path in found:
            filesystem, stripped = url_to_fs(path)
            if not filesystem.isdir(stripped):  # an object: a checkpoint file, or a commit record
                candidates.add(path)
                continue
            metadata = f"{stripped.rstrip('/')}/{METADATA_NAME}"
            if filesystem.exists(metadata):
                candidates.add(filesystem.unstrip_protocol(metadata))
        tier = self.local_tier()
        if tier is not None:
            candidates |= set(tier.last_checkpoints(directory).values())
        return candidates

    @override
    def node_preflight(self) -> None:
        """When training starts, on every rank: with ``local_dir``, finish what killed saves left on
        this node's local tier (``ShardedLocalTier.finish_pending``: half-written files removed, the
        uploads and publishes of processes certainly gone taken over); only this node can. A failure
        is logged, and the first save tries again."""
        try:
            tier = self.local_tier()
            if tier is not None:
                tier.finish_pending()
        except Exception as exc:
            log.warning("could not finish what killed saves left on the local tier %s: %s", self.local_dir, exc)

    def teardown(self) -> None:
        """Tear down as the strategy does, then wait (up to the tier's ``teardown_timeout_s``) for the
        local tier's uploads in flight, saying which."""
        try:
            super().teardown()  # type: ignore[misc]
        finally:
            tier = self.local_dir if isinstance(self.local_dir, ShardedLocalTier) else self._local_tier
            if tier is not None:
                tier.close()


class DatafluxFSDPStrategy(_DatafluxStorage, ShardedFSDPMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy``; with ``state_dict_type="sharded"`` its checkpoints go to ``gs://``.

    Args:
        options: the :class:`~dataflux_ckpt.TransferOptions` of every save and load.
        writer_options: keyword arguments for :class:`DatafluxStorageWriter` (``overwrite``, ``chunk_size``,
            ...); a transfer option here must agree with ``options``.
        reader_options: keyword arguments for :class:`DatafluxStorageReader`.
        local_dir: the local tier on each node's NVMe (a directory, the same for the ranks of a
            node, or a :class:`~dataflux_ckpt.tiered_dcp.ShardedLocalTier`): every rank saves its
            shard there and training goes on while the checkpoint is uploaded; loads read the newest
            whole version (see :mod:`dataflux_ckpt.tiered_dcp`). ``teardown`` waits for the uploads.
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
        local_dir: the local tier on each node's NVMe, as for :class:`DatafluxFSDPStrategy`.
        *args, **kwargs: as for ``ModelParallelStrategy``.

    Raises:
        TypeError, ValueError: as :class:`~dataflux_ckpt.TransferOptions`, for ``options`` and the
            transfer options among ``writer_options`` and ``reader_options``.
    """
