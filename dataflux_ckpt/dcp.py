"""``torch.distributed.checkpoint`` storage on Google Cloud Storage: every rank streams its shard.

    dcp.save(state_dict, storage_writer=DatafluxStorageWriter("gs://bucket/run/step-100"))
    dcp.load(state_dict, storage_reader=DatafluxStorageReader("gs://bucket/run/step-100"))

Save: each rank writes one object, ``__<rank>_0.<token>.distcp``, through :class:`ObjectWriter`
(parallel part uploads, at most ``max_workers + 1`` parts alive: a shard is never held whole). The
whole parts of a contiguous CPU tensor go up from the tensor's own memory; only bytes that share a part
with another item, and tensors that are not contiguous or not on the CPU, pass through part buffers.
Tensors are stored as their raw bytes (C order) with a crc32c for every ``block_size`` bytes of each
item, recorded in the metadata; the coordinator publishes ``.metadata`` last, in one request.

Load: the byte ranges the load plan needs (only the rows a resharded rank needs, when they are
contiguous) are fetched with parallel ranged GETs, neighbouring items coalesced into one request,
big ones split; contiguous targets receive their bytes in place. Every block is checked against its
crc32c before it is used. Checkpoints written by torch's ``FsspecWriter`` (``torch.save`` items) load too.

Concurrent saves: a save's coordinator holds the object ``.dcp-save.lock`` under the prefix, created
with ``ifGenerationMatch=0`` and renewed (again under a generation precondition) every quarter of its
lease. A second save finds it held and fails with ``ConcurrentWriteError`` before writing anything; a
lock not renewed for its lease (by the server's clock), or whose recorded process is certainly gone
(killed on this machine, or in an earlier attempt of this Slurm job), belongs to a dead save and is
taken over under a precondition on its generation. ``.metadata`` is published under a precondition on the generation
seen when the lock was taken, so a save that lost its lock publishes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import os
import pickle
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch
from google.cloud import storage
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from typing_extensions import override

from dataflux_ckpt._gcs_compat import raw_body_reader, release_read_connection
from dataflux_ckpt.checksums import crc32c_extend
from dataflux_ckpt.dcp_objects import (
    LOCK_LEASE_S,
    GcsItemInfo,
    _BlockCrcs,
    _checkpoint_path,
    _Connection,
    _GcsSaveLock,
    _read_small,
    write_commit_record,
)
from dataflux_ckpt.errors import (
    DataCorruptionError,
    HttpStatusError,
    TransferError,
)
from dataflux_ckpt.gcs import Gcs
from dataflux_ckpt.options import TransferOptions, option_property, resolve_options
from dataflux_ckpt.paths import GcsPath
from dataflux_ckpt.retry import Deadline, RetryPolicy
from dataflux_ckpt.upload import PARTS_SUFFIX, ObjectWriter, sweep_dead_uploads
from lightning_storage_plugins import _torch_compat as _load_compat
from lightning_storage_plugins.dcp import (
    LEFTOVERS_TIMEOUT_S,
    LOCK_NAME,
    METADATA_NAME,
    TOKEN_HEX_DIGITS,
    SaveLock,
    ShardedStorageReader,
    ShardedStorageWriter,
    ShardPlan,
    StorageInfo,
    is_leftover,
    narrow,
    stamp_version,
)
from lightning_storage_plugins.errors import CheckpointMetadataError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.checkpoint.metadata import Metadata

    from dataflux_ckpt.tiered_dcp import LoadVersion, ShardedLocalTier

log = logging.getLogger(__name__)

__all__ = ["DatafluxStorageReader", "DatafluxStorageWriter"]

DEVICE_PIECE_BYTES = 64 * 2**20  # a GPU tensor is copied to host in pieces of this size
SCRATCH_BYTES = 1 * 2**20
# How long a load with a local tier waits for GCS to say which checkpoint it holds.
NEWER_CHECK_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class _TieredShardPlan(ShardPlan):
    """A rank's ``SavePlan.storage_data`` in a tiered save: also whether the save goes to GCS."""

    remote: bool = True


def _ordered_save_id(after: str | None = None) -> str:
    from dataflux_ckpt.tiered_dcp import ordered_save_id

    return ordered_save_id(after)


def _local_tier(local_dir: str | os.PathLike[str] | ShardedLocalTier | None, owner: str,
                connection: _Connection) -> ShardedLocalTier | None:
    """The local tier ``local_dir`` names: the one given, or a new one on that directory (uploading
    with ``connection``'s client and options)."""
    if local_dir is None:
        return None
    from dataflux_ckpt.tiered_dcp import ShardedLocalTier

    if isinstance(local_dir, ShardedLocalTier):
        return local_dir
    if not isinstance(local_dir, (str, os.PathLike)):
        raise TypeError(f"{owner}: local_dir must be a directory or a ShardedLocalTier, not {local_dir!r}")
    return ShardedLocalTier(local_dir, project_name=connection.project_name, storage_client=connection._client,
                            options=connection.options)


class _GcsCheckpoint:
    """What the writer and the reader share: a checkpoint is the objects under ``gs://bucket/prefix/``."""

    storage_info_types = (GcsItemInfo,)
    checkpoint_id: str
    options: TransferOptions

    # The options' fields, read as attributes of the writer or reader.
    chunk_size = option_property("chunk_size", "Bytes per uploaded part; the largest ranged GET.")
    max_workers = option_property("max_workers", "Concurrent part uploads / GETs of this rank.")
    retry = option_property("retry", "The retry policy of each request.")
    deadline_s = option_property("deadline_s", "The deadline of each step of a save or load, in seconds.")

    @staticmethod
    def _normalize(checkpoint_id: str | os.PathLike[str]) -> str:
        return _checkpoint_path(checkpoint_id).uri

    def _object(self, name: str) -> GcsPath:
        base = _checkpoint_path(self.checkpoint_id)
        return GcsPath(base.bucket, f"{base.key}/{name}")


class DatafluxStorageWriter(_GcsCheckpoint, ShardedStorageWriter):
    """A DCP ``StorageWriter`` for ``gs://bucket/prefix`` checkpoints.

    Args:
        path: ``gs://bucket/prefix``; the checkpoint's objects go under ``prefix/``.
        project_name: project of the client made from the environment.
        storage_client: a ``google.cloud.storage.Client`` to use (not pickled).
        chunk_size: bytes per uploaded part; ``max_workers + 1`` such buffers per rank at most.
        max_workers: concurrent part uploads per rank.
        upload_mode: ``"auto"``, ``"xml"`` or ``"composite"`` (see ``DatafluxCheckpointIO``).
        block_size: bytes covered by each recorded crc32c (the granularity of verified partial reads).
        retry: retry policy for each request.
        deadline_s: each step of a save on a rank (its shard, the metadata, the clean-up) must finish
            within this many seconds, or fails with ``DeadlineExceededError`` naming it.
        options: all of the above (and the request and clean-up timeouts) as one
            :class:`~dataflux_ckpt.TransferOptions`; an individual argument given as well must agree.
        overwrite: ``False`` refuses to save where a checkpoint exists.
        cache_staged_state_dict: as for torch's ``FileSystemWriter`` (``dcp.async_save``).
        local_dir: a local tier (a :class:`~dataflux_ckpt.tiered_dcp.ShardedLocalTier`, or its
            directory on the node's NVMe, for one of this writer's own): each rank then writes its
            shard there with FastPersist and returns, and the checkpoint is uploaded and published
            in GCS in the background (see :mod:`dataflux_ckpt.tiered_dcp`). It needs the
            ``[nvme]`` extra too.
        save_round: with ``local_dir``, the round of the tier's ``remote_every`` this save
            belongs to: saves of the same round one after another (Lightning's strategies pass the
            ``global_step``) all go to GCS or all stay on the node. ``None``: a round of its own.

    Raises:
        ValueError: ``path`` is not a ``gs://`` path, or an option is out of range (the message names it).
        TypeError: an option has the wrong type, or conflicts with the same field of ``options``.
        ImportError: ``local_dir`` was given without the ``[nvme]`` extra (the message names it).
    """

    upload_mode = option_property("upload_mode", '``"auto"``, ``"xml"`` or ``"composite"``.')
    block_size = option_property("block_size", "Bytes covered by each recorded crc32c.")

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        project_name: str | None = None,
        storage_client: storage.Client | None = None,
        chunk_size: int | None = None,
        max_workers: int | None = None,
        upload_mode: str | None = None,
        block_size: int | None = None,
        retry: RetryPolicy | None = None,
        deadline_s: float | None = None,
        options: TransferOptions | None = None,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
        local_dir: str | os.PathLike[str] | ShardedLocalTier | None = None,
        save_round: int | None = None,
    ) -> None:
        self.options = resolve_options(type(self).__name__, options, chunk_size=chunk_size, max_workers=max_workers,
                                       upload_mode=upload_mode, block_size=block_size, retry=retry,
                                       deadline_s=deadline_s)
        super().__init__(path, overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)
        self.save_round = save_round
        self._remote = True  # whether the current tiered save goes to GCS (the coordinator's word)
        self._connection = _Connection(project_name, storage_client, self.options)
        self._metadata_generation = 0
        #: The local tier of a tiered save (``None``: each rank uploads its shard as it saves).
        self.local_tier = _local_tier(local_dir, type(self).__name__, self._connection)
        self._rank: int | None = None
        self._removing = False
        self._until: float | None = None  # the end of a restart's removal of leftovers (time.monotonic())
        if self.local_tier is not None:
            self.save_id = _ordered_save_id()

    @override
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, to ``checkpoint_id`` when given (see ``ShardedStorageWriter.reset``);
        a tiered save's id begins with the time, which orders the saves of a checkpoint."""
        super().reset(checkpoint_id)
        if self.local_tier is not None:
            self.save_id = _ordered_save_id(self.save_id)

    def _deadline(self) -> Deadline:
        if self._until is None:
            return Deadline(self.deadline_s, "save", self.checkpoint_id)
        return Deadline(max(min(self._until - time.monotonic(), self.deadline_s), 1e-3),
                        "removal of what killed saves left", self.checkpoint_id)

    def _lock_checkpoint(self) -> SaveLock:
        if self.local_tier is not None and not self._removing:  # a tiered save's publish takes GCS's
            return self.local_tier._save_lock(self.checkpoint_id)
        gcs = self._connection.gcs
        lock = _GcsSaveLock(gcs, self._object(LOCK_NAME), self.checkpoint_id, self.save_id, LOCK_LEASE_S,
                            self._deadline().seconds).acquire()
        weakref.finalize(self, lock.release).atexit = False  # a writer dropped after a failed save
        try:
            self._metadata_generation = gcs.current_generation(self._object(METADATA_NAME), self._deadline())
        except BaseException:
            lock.release()
            raise
        return lock

    @override
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """As ``ShardedStorageWriter.prepare_global_plan``; a tiered save's coordinator also decides,
        for every rank, whether the save goes to GCS (its tier's ``remote_every``)."""
        plans = super().prepare_global_plan(plans)
        if self.local_tier is None:
            return plans
        remote = self.local_tier._next_round(self.save_round)  # each rank, this one too, reads it in write_data
        return [dataclasses.replace(plan, storage_data=_TieredShardPlan(**dataclasses.asdict(plan.storage_data),
                                                                        remote=remote))
                for plan in plans]

    @override
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """As ``ShardedStorageWriter.write_data``; a tiered save writes to the local tier."""
        if self.local_tier is not None:
            self._remote = getattr(plan.storage_data, "remote", True)
        return super().write_data(plan, planner)

    # Files --------------------------------------------------------------------------------------
    def _write_shard(self, name: str, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        if self.local_tier is not None:
            from dataflux_ckpt.tiered_dcp import shard_rank

            self._rank = shard_rank(name)[0]
            return self.local_tier._save_shard(self.checkpoint_id, name, items, planner, self._connection,
                                              self.block_size, remote=self._remote)
        results: list[WriteResult] = []
        target = self._object(name)
        ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)  # as torch orders them
        with ObjectWriter(self._connection.gcs, target, chunk_size=self.chunk_size, max_workers=self.max_workers,
                          mode=self.upload_mode, deadline_s=self.deadline_s,
                          cleanup_timeout_s=self.options.cleanup_timeout_s) as stream:
            for item in ordered:
                offset = stream.tell()
                crcs = _BlockCrcs(self.block_size)
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view = data.getbuffer()
                    crcs.update(view)
                    stream.write(view)
                    info = GcsItemInfo(name, offset, view.nbytes, crc32c=crcs.values(), block_size=self.block_size)
                else:
                    tensor = data.detach()
                    for piece, own in _host_bytes(tensor, f"{item.index.fqn} of {target}"):
                        crcs.update(piece)
                        # The tensor's own memory outlives the upload (DCP holds the state until
                        # write_data returns): its whole parts go up without a staging copy.
                        if own:
                            stream.write_borrowed(piece)
                        else:
                            stream.write(piece)
                    info = GcsItemInfo(name, offset, stream.tell() - offset, crc32c=crcs.values(),
                                       block_size=self.block_size, dtype=_dtype_name(tensor.dtype),
                                       shape=tuple(tensor.shape))
                results.append(WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info))
        # Part objects of a composite upload are deleted in the background: done before the save returns.
        self._connection.gcs.wait_background(self.options.cleanup_timeout_s)
        return results

    @override
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Publish ``.metadata`` (see ``ShardedStorageWriter.finish``); a tiered save writes it to the
        coordinator's local tier instead, and publishes it in GCS in the background once every
        rank's shard is uploaded.

        Raises:
            FileNotFoundError: a rank's object is missing or short (nothing is published).
            ConcurrentWriteError: the save lock was lost meanwhile (nothing is published).
            OSError: a tiered save's local write failed.
        """
        if self.local_tier is None:
            super().finish(metadata, results)
            return
        try:
            metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
            metadata.storage_meta = self.storage_meta()
            stamp_version(metadata)
            self._held_lock().confirm()
            self.local_tier._commit(self.checkpoint_id, self.save_id[:TOKEN_HEX_DIGITS], pickle.dumps(metadata),
                                   self._connection, remote=self._remote)
        finally:
            self._release()

    @override
    def abort(self) -> None:
        """Remove what the current save wrote, once it failed (see ``ShardedStorageWriter.abort``); a
        tiered save removes this rank's files from the local tier, stops their uploads and deletes
        what they put in GCS."""
        if self.local_tier is None:
            super().abort()
            return
        try:
            if self._token is not None and self.path is not None:
                self.local_tier._abort(self.checkpoint_id, self._token, self._rank)
                self._token = None
        finally:
            self._release()

    @override
    def remove(self) -> None:
        """Delete the checkpoint (see ``ShardedStorageWriter.remove``); with a local tier, its
        uploads in this process are stopped and its local copy on this node removed first.

        Raises:
            ConcurrentWriteError: a save to this checkpoint is in progress.
        """
        if self.local_tier is None:
            super().remove()
            return
        self.local_tier._forget(self.checkpoint_id)
        self._removing = True  # under GCS's save lock, as any removal from GCS
        try:
            super().remove()
        finally:
            self._removing = False

    @override
    def remove_leftovers(self, timeout_s: float = LEFTOVERS_TIMEOUT_S) -> int:
        """Remove what killed saves left in the checkpoint (see ``ShardedStorageWriter.remove_leftovers``):
        part objects of uploads that are over, then, under GCS's save lock (taken over from a save
        whose process is certainly gone or whose lease ran out), the objects of saves that
        ``.metadata`` does not reference, and the lock. With a local tier, only the part objects and
        the lock: a tiered save's shards, markers and pending metadata in GCS are its node's to
        finish (``ShardedLocalTier.finish_pending``), and the next publish of the checkpoint removes
        what is older.

        Raises:
            ReentrantOperationError: this thread is inside a step of a save through this writer.
            TransferError, DeadlineExceededError: GCS failed, or did not answer within ``timeout_s``.
        """
        self._removing = True  # GCS's save lock, with a local tier too
        try:
            return super().remove_leftovers(timeout_s)
        finally:
            self._removing = False

    @contextlib.contextmanager
    def _within(self, timeout_s: float) -> Iterator[None]:
        self._until = time.monotonic() + timeout_s
        try:
            yield
        finally:
            self._until = None

    def _children(self) -> dict[str, list[str]]:
        children: dict[str, list[str]] = {}
        for name in self._list():
            child, _, rest = name.partition("/")
            if rest:
                children.setdefault(child, []).append(rest)
        return children

    def _remove_dead_temporaries(self) -> int:
        base = _checkpoint_path(self.checkpoint_id)
        return sweep_dead_uploads(self._connection.gcs, GcsPath(base.bucket, f"{base.key}/"), self._deadline())

    def _removable(self, name: str) -> bool:
        # Part objects go by their owner and lease (above), whoever holds the lock.
        return self.local_tier is None and is_leftover(name) and PARTS_SUFFIX not in name

    def _publish(self, name: str, data: bytes) -> None:
        # .metadata replaces only the generation there when this save took the lock.
        precondition = self._metadata_generation if name == METADATA_NAME else None
        self._connection.gcs.upload_object(self._object(name), memoryview(data), crc32c_extend(0, data),
                                           self._deadline(), if_generation_match=precondition)

    @override
    def _commit(self, metadata: bytes) -> None:
        """Publish ``.metadata``, then the commit record, which dates the checkpoint (see
        :func:`write_commit_record`)."""
        super()._commit(metadata)
        write_commit_record(self._connection.gcs, self.checkpoint_id, self.save_id, self._deadline())

    @override
    def _remove_location(self) -> None:
        # The commit record goes last, once the checkpoint's .metadata is gone (never a whole one's).
        record = _checkpoint_path(self.checkpoint_id)
        if record.key and self._read(METADATA_NAME) is None:
            self._connection.gcs.delete(record.bucket, record.key, self._deadline())

    def _read(self, name: str) -> bytes | None:
        return _read_small(self._connection.gcs, self._object(name), self._deadline())

    def _list(self) -> list[str]:
        base = _checkpoint_path(self.checkpoint_id)
        prefix = f"{base.key}/"
        names = self._connection.gcs.list_names(base.bucket, prefix, self._deadline())
        return [name[len(prefix):] for name in names]

    def _size(self, name: str) -> int | None:
        try:
            return self._connection.gcs.stat(self._object(name), self._deadline()).size
        except FileNotFoundError:
            return None

    def _delete(self, names: Sequence[str]) -> None:
        gcs, deadline = self._connection.gcs, self._deadline()
        targets = [self._object(name) for name in names]
        with ThreadPoolExecutor(self.max_workers, thread_name_prefix="dataflux-delete") as pool:
            list(pool.map(lambda path: gcs.delete(path.bucket, path.key, deadline), targets))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r} in the checkpoint metadata")
    return dtype


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _host_bytes(tensor: torch.Tensor, what: str) -> Iterator[tuple[memoryview, bool]]:
    """The tensor's bytes in C order, as host memory, each piece with whether it is the tensor's own
    memory: a contiguous CPU tensor's is; a copy is made when it is not contiguous, and a device
    tensor's bytes come in copied pieces of ``DEVICE_PIECE_BYTES``."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"{what}: cannot store a {tensor.layout} / quantized tensor as raw bytes")
    contiguous = tensor.contiguous()
    flat = _flat_bytes(contiguous)
    if flat.device.type == "cpu":
        yield memoryview(flat.numpy()), contiguous is tensor
        return
    for start in range(0, flat.numel(), DEVICE_PIECE_BYTES):
        yield memoryview(flat[start : start + DEVICE_PIECE_BYTES].cpu().numpy()), False


# Reading ------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Request:
    """One read item: the byte range ``[start, end)`` of its object to fetch into ``dest``."""

    item: ReadItem
    info: StorageInfo
    name: str
    start: int  # object offsets
    end: int
    target: torch.Tensor | None = None  # the planner's tensor, for tensor items
    direct: bool = False  # ``dest`` is the target's own memory
    dest: torch.Tensor | None = None  # flat uint8, end - start bytes
    pending: int = 0  # GETs not yet complete

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class _Get:
    """One ranged GET: object bytes ``[start, end)`` into the ranges of ``parts`` (request, offset)."""

    name: str
    start: int
    end: int
    parts: list[tuple[_Request, int, int]]  # (request, object offset, length): read in order


def _requests_of(get: _Get) -> list[_Request]:
    """The distinct requests a GET serves, in order."""
    return list({id(part[0]): part[0] for part in get.parts}.values())


def _c_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _tensor_byte_range(info: GcsItemInfo, item: ReadItem, element: int) -> tuple[int, int, bool]:
    """The item-relative byte range holding the requested sub-block, and whether it is exactly the
    sub-block (contiguous) rather than a covering range."""
    shape = list(info.shape or ())
    strides = _c_strides(shape)
    offsets, lengths = list(item.storage_offsets), list(item.lengths)
    count = math.prod(lengths)
    if count == 0:
        return 0, 0, True
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first * element, (last + 1) * element, last + 1 - first == count


class DatafluxStorageReader(_GcsCheckpoint, ShardedStorageReader):
    """A DCP ``StorageReader`` for ``gs://bucket/prefix`` checkpoints (ours, or ``FsspecWriter``'s).

    Args:
        path: ``gs://bucket/prefix``.
        project_name: project of the client made from the environment.
        storage_client: a ``google.cloud.storage.Client`` to use (not pickled).
        chunk_size: the largest ranged GET; bigger ranges are split into parallel GETs.
        max_workers: concurrent GETs.
        coalesce_gap: items of one object closer than this many bytes are fetched by one GET.
        retry: retry policy for each request.
        deadline_s: a rank's load (metadata, then its items) must finish within this many seconds, or
            fails with ``DeadlineExceededError`` naming it.
        options: all of the above (and the request timeout) as one :class:`~dataflux_ckpt.TransferOptions`;
            an individual argument given as well must agree.
        weights_only: see :class:`~lightning_storage_plugins.dcp.ShardedStorageReader`.
        local_dir: the local tier of tiered saves (a :class:`~dataflux_ckpt.tiered_dcp.ShardedLocalTier`
            or its directory): the load reads the newest version of the checkpoint whose every file
            each rank finds whole on its node, if it is as new as GCS's, else GCS's; each file from
            the local tier where it is there and whole (its size and crc32c), else from GCS. The
            version is chosen at the first read of the metadata after the reader is made (or reset
            to another path), so that the loads of one reader (a model's, then its optimizers')
            read one version. See :mod:`dataflux_ckpt.tiered_dcp`.
        process_group: the ranks that choose the version together (with ``local_dir``): the group
            ``dcp.load`` runs in; ``None``, its default, is torch's default group where one is
            initialized (else this process alone).

    Raises:
        ValueError: ``path`` is not a ``gs://`` path, or an option is out of range (the message names it).
        TypeError: an option has the wrong type, or conflicts with the same field of ``options``.
        ImportError: ``local_dir`` was given without the ``[nvme]`` extra (the message names it).
    """

    coalesce_gap = option_property("coalesce_gap", "Items closer than this many bytes are fetched by one GET.")

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        project_name: str | None = None,
        storage_client: storage.Client | None = None,
        chunk_size: int | None = None,
        max_workers: int | None = None,
        coalesce_gap: int | None = None,
        retry: RetryPolicy | None = None,
        deadline_s: float | None = None,
        options: TransferOptions | None = None,
        weights_only: bool | None = None,
        local_dir: str | os.PathLike[str] | ShardedLocalTier | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.options = resolve_options(type(self).__name__, options, chunk_size=chunk_size, max_workers=max_workers,
                                       coalesce_gap=coalesce_gap, retry=retry, deadline_s=deadline_s)
        super().__init__(path, weights_only=weights_only)
        self._connection = _Connection(project_name, storage_client, self.options)
        #: The local tier of tiered saves (``None``: every file is read from GCS).
        self.local_tier = _local_tier(local_dir, type(self).__name__, self._connection)
        self.process_group = process_group
        self._version: LoadVersion | None = None
        #: With a local tier: where the version loaded was chosen from, ``"local"`` or ``"gcs"``
        #: (``None`` until the metadata is read).
        self.chosen_tier: str | None = None
        #: With a local tier: how many files this reader read from the local tier, and from GCS.
        self.files_read_locally = 0
        self.files_read_from_gcs = 0

    @override
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` when given (see ``ShardedStorageReader.reset``);
        a load of another path chooses its version afresh."""
        previous = self.path
        super().reset(checkpoint_id)
        if self.path != previous:
            self._version, self.chosen_tier = None, None

    def _read(self, name: str) -> bytes | None:
        if self.local_tier is not None and name == METADATA_NAME:
            return self._chosen_version().metadata
        return self._read_gcs(name)

    def _read_gcs(self, name: str) -> bytes | None:
        return _read_small(self._connection.gcs, self._object(name), Deadline(self.deadline_s, "load", self.checkpoint_id))

    @override
    def exists(self) -> bool:
        """Whether a complete checkpoint is at the path (its ``.metadata`` is in GCS), or, with a
        local tier, a save of it is whole on this node (its metadata and every file it names)."""
        if self.local_tier is not None and self.local_tier._holds(self.checkpoint_id):
            return True
        return self._read_gcs(METADATA_NAME) is not None

    def _chosen_version(self) -> LoadVersion:
        """The version of the checkpoint this reader loads (chosen with the other ranks at the first call)."""
        if self._version is None:
            from dataflux_ckpt.tiered_dcp import choose_version

            assert self.local_tier is not None
            self._version = choose_version(self.local_tier, self.checkpoint_id, self._gcs_metadata,
                                           self.process_group)
            self.chosen_tier = self._version.tier
        return self._version

    def _gcs_metadata(self) -> tuple[bytes, int] | None:
        """GCS's ``.metadata`` and its generation (``None``: there is none)."""
        gcs = self._connection.gcs
        deadline = Deadline(min(self.deadline_s, NEWER_CHECK_TIMEOUT_S), "load", self.checkpoint_id)
        path = self._object(METADATA_NAME)
        with contextlib.suppress(FileNotFoundError):
            info = gcs.stat(path, deadline)
            data = _read_small(gcs, path, deadline)
            if data is not None:
                return data, info.generation
        return None

    def _check_item(self, info: Any, where: str) -> None:
        """Refuse an item whose crc32c blocks, dtype or shape cannot describe its bytes."""
        if not isinstance(info, GcsItemInfo):
            return
        block = info.block_size
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            raise CheckpointMetadataError(f"{where}: crc32c block size {block!r}; it must be a positive integer")
        if len(info.crc32c) != -(-info.length // block):
            raise CheckpointMetadataError(f"{where}: {len(info.crc32c)} crc32c values for {info.length} bytes in "
                                          f"blocks of {block}")
        if info.dtype is None:
            return
        try:
            element = torch.empty((), dtype=_dtype(info.dtype, where)).element_size()
        except ValueError as err:
            raise CheckpointMetadataError(str(err)) from None
        shape = info.shape
        if (not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape)
                or math.prod(shape) * element != info.length):
            raise CheckpointMetadataError(f"{where}: shape {shape!r} of {info.dtype} does not fit its {info.length} bytes")

    # Planning -----------------------------------------------------------------------------------
    def _request(self, item: ReadItem, planner: LoadPlanner) -> _Request:
        info = self.storage_data[item.storage_index]
        base = info.offset
        if item.type == LoadItemType.BYTE_IO or not isinstance(info, GcsItemInfo) or info.dtype is None:
            return _Request(item, info, info.relative_path, base, base + info.length)
        where = f"{self.checkpoint_id}: item {item.storage_index.fqn}"
        dtype = _dtype(info.dtype, where)
        element = torch.empty((), dtype=dtype).element_size()
        first, last, exact = _tensor_byte_range(info, item, element)
        # Whole crc blocks, so that every byte used is verified.
        start = first // info.block_size * info.block_size
        end = min(-(-last // info.block_size) * info.block_size, info.length)
        target = planner.resolve_tensor(item).detach()
        direct = (exact and (start, end) == (first, last) and target.device.type == "cpu"
                  and target.dtype == dtype and target.is_contiguous() and target.numel() * element == end - start)
        request = _Request(item, info, info.relative_path, base + start, base + end, target, direct)
        if direct:
            request.dest = _flat_bytes(target)
        return request

    def _gets(self, requests: list[_Request]) -> list[_Get]:
        """Coalesce neighbouring requests of one object into GETs of at most ``chunk_size`` bytes
        (gaps included); a request larger than that is split over several GETs."""
        gets: list[_Get] = []
        current: _Get | None = None
        for request in sorted(requests, key=lambda r: (r.name, r.start)):
            position = request.start
            while position < request.end:
                room = 0
                if (current is not None and current.name == request.name and current.end <= position
                        and position - current.end <= self.coalesce_gap):
                    room = self.chunk_size - (position - current.start)
                if room <= 0:
                    current = _Get(request.name, position, position, [])
                    gets.append(current)
                    room = self.chunk_size
                assert current is not None
                take = min(request.end - position, room)
                current.parts.append((request, position, take))
                current.end = position + take
                position += take
        for get in gets:
            for request in _requests_of(get):
                request.pending += 1
        return gets

    # Reading ------------------------------------------------------------------------------------
    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        if self.local_tier is None:
            self._read_from_gcs(plan.items, planner)
            return
        version = self._chosen_version()
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        remote: list[ReadItem] = []
        for name, items in by_file.items():
            copy = self._local_copy(version, name)
            if copy is None:
                remote.extend(items)
                self.files_read_from_gcs += 1
                continue
            try:
                whole = torch.empty(0, dtype=torch.uint8).set_(copy.untyped_storage())
                for item in items:
                    request = self._request(item, planner)
                    data = whole.narrow(0, request.start, request.size)
                    if request.direct:
                        assert request.dest is not None
                        request.dest.copy_(data)
                    else:
                        request.dest = data
                    self._use(request, planner)
            finally:
                copy.close()
            self.files_read_locally += 1
        if remote:
            self._read_from_gcs(remote, planner)

    def _local_copy(self, version: LoadVersion, name: str) -> Any:
        """The local tier's copy of the version's file ``name`` read whole, once its size and crc32c
        match; ``None`` when GCS is to be read instead.

        Raises:
            FileNotFoundError, DataCorruptionError: the file is not whole here, and the version is
                not in GCS either.
        """
        assert self.local_tier is not None
        entry = version.local_files.get(name)
        if entry is None:
            if not version.in_gcs:
                raise FileNotFoundError(f"{self.checkpoint_id}/{name} is not on this node's local tier, and GCS "
                                        f"does not hold this version (save {version.token}) of the checkpoint")
            return None
        try:
            return self.local_tier._read_local(self.checkpoint_id, name, *entry)
        except (OSError, DataCorruptionError) as err:
            if not version.in_gcs:
                raise
            log.warning("could not read the local copy of %s/%s (%s); reading it from GCS", self.checkpoint_id,
                        name, err)
            return None

    def _read_from_gcs(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        requests = [self._request(item, planner) for item in items]
        for request in requests:
            if request.size == 0:
                self._use(request, planner)
        gets = self._gets(requests)
        budget = max(2 * self.max_workers * self.chunk_size, 1)
        in_flight: dict[Future[None], _Get] = {}
        buffered = 0  # bytes of temporary destinations alive
        gcs, deadline = self._connection.gcs, Deadline(self.deadline_s, "load", self.checkpoint_id)
        with ThreadPoolExecutor(self.max_workers, thread_name_prefix="dataflux-dcp-read") as pool:
            try:
                for get in gets:
                    fresh = [r for r in _requests_of(get) if r.dest is None]
                    need = sum(r.size for r in fresh)
                    while in_flight and buffered + need > budget:
                        buffered -= self._complete(in_flight, planner)
                    for request in fresh:
                        request.dest = torch.empty(request.size, dtype=torch.uint8)
                    buffered += need
                    in_flight[pool.submit(self._fetch, gcs, get, deadline)] = get
                while in_flight:
                    buffered -= self._complete(in_flight, planner)
            except BaseException:
                for future in in_flight:
                    future.cancel()
                raise

    def _complete(self, in_flight: dict[Future[None], _Get], planner: LoadPlanner) -> int:
        """Wait for at least one GET; use every request it completed; returns the bytes freed."""
        done, _ = wait(list(in_flight), return_when=FIRST_COMPLETED)
        freed = 0
        for future in done:
            get = in_flight.pop(future)
            future.result()
            for request in _requests_of(get):
                request.pending -= 1
                if request.pending == 0:
                    self._use(request, planner)
                    if not request.direct:
                        freed += request.size
                    request.dest = None
        return freed

    def _fetch(self, gcs: Gcs, get: _Get, deadline: Deadline) -> None:
        path = self._object(get.name)
        what = f"download of bytes {get.start}-{get.end - 1} of {path.uri}"
        url = gcs.media_url(*path)
        scratch = memoryview(bytearray(min(SCRATCH_BYTES, get.end - get.start)))

        def once() -> None:
            headers = {"Range": f"bytes={get.start}-{get.end - 1}", "Accept-Encoding": "identity"}
            with gcs.request("GET", url, what, deadline, ok=(200, 206), headers=headers, stream=True) as response:
                if response.status_code == 200 and get.start != 0:
                    raise HttpStatusError(200, f"{what}: the server ignored the Range header")
                source = raw_body_reader(response)
                position = get.start
                for request, offset, length in get.parts:
                    if offset > position:  # a gap between coalesced items: read and drop
                        _read_exactly(source, None, offset - position, scratch, what)
                    assert request.dest is not None
                    dest = memoryview(request.dest.numpy())[offset - request.start : offset - request.start + length]
                    _read_exactly(source, dest, length, scratch, what)
                    position = offset + length
                release_read_connection(response, source)

        try:
            gcs.retry.call(once, what, deadline)
        except HttpStatusError as err:
            if err.status == 404:
                raise FileNotFoundError(f"{path.uri} is missing; the checkpoint {self.checkpoint_id} "
                                        "references it") from err
            raise TransferError(f"{what} failed: {err}") from err
        except (DataCorruptionError, FileNotFoundError, TransferError):  # deadline errors included
            raise
        except Exception as err:
            raise TransferError(f"{what} failed: {err}") from err

    def _use(self, request: _Request, planner: LoadPlanner) -> None:
        """Verify the request's bytes and hand them to the planner."""
        item, info = request.item, request.info
        where = f"{self.checkpoint_id}/{request.name}: item {item.storage_index.fqn}"
        data = request.dest if request.dest is not None else torch.empty(0, dtype=torch.uint8)
        if isinstance(info, GcsItemInfo):
            _verify(info, request.start - info.offset, data, where)
        if item.type == LoadItemType.BYTE_IO:
            view = memoryview(data.numpy())
            self.check_bytes(view, item.storage_index)
            planner.load_bytes(item, io.BytesIO(view))
            return
        target = request.target if request.target is not None else planner.resolve_tensor(item).detach()
        if not request.direct:
            if isinstance(info, GcsItemInfo) and info.dtype is not None:
                stored = _sub_block(info, item, data, request.start - info.offset, where)
            else:  # a torch.save item (FsspecWriter / FileSystemWriter layout)
                whole = data.untyped_storage()[data.storage_offset() : data.storage_offset() + data.numel()]
                loaded = _load_compat.load_tensor_item(memoryview(data.numpy()), whole, where)
                stored = narrow(loaded, item.storage_offsets, item.lengths)
            if stored.size() != target.size():
                raise ValueError(f"{where}: stored block {tuple(stored.size())} does not fit the target "
                                 f"{tuple(target.size())}")
            target.copy_(stored)
        planner.commit_tensor(item, target)


def _read_exactly(source: Any, dest: memoryview | None, length: int, scratch: memoryview, what: str) -> None:
    got = 0
    while got < length:
        if dest is None:
            window = scratch[: min(scratch.nbytes, length - got)]
        else:
            window = dest[got:]
        n = source.readinto(window)
        if not n:
            raise ConnectionError(f"{what}: connection closed early ({got} of {length} bytes of a range)")
        got += n


def _verify(info: GcsItemInfo, start: int, data: torch.Tensor, where: str) -> None:
    """Check the item-relative bytes ``[start, start + len(data))`` (whole blocks) against their crc32c."""
    view = memoryview(data.numpy())
    block = info.block_size
    for offset in range(0, view.nbytes, block):
        index = (start + offset) // block
        if index >= len(info.crc32c):
            raise DataCorruptionError(f"{where}: no crc32c recorded for block {index}")
        actual = crc32c_extend(0, view[offset : offset + block])
        if actual != info.crc32c[index]:
            raise DataCorruptionError(
                f"{where}: bytes {info.offset + start + offset}-{info.offset + start + offset + block - 1} "
                f"have crc32c {actual:#010x}, the checkpoint recorded {info.crc32c[index]:#010x}"
            )


def _sub_block(info: GcsItemInfo, item: ReadItem, data: torch.Tensor, start: int, where: str) -> torch.Tensor:
    """The requested sub-block as a view of ``data`` (item-relative bytes from ``start``)."""
    dtype = _dtype(info.dtype or "", where)
    element = torch.empty((), dtype=dtype).element_size()
    first, last, _ = _tensor_byte_range(info, item, element)
    elements = data.narrow(0, first - start, last - first).view(dtype)
    return torch.as_strided(elements, list(item.lengths), _c_strides(info.shape or ()), elements.storage_offset())
