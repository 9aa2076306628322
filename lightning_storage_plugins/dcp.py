"""What the plugins' ``torch.distributed.checkpoint`` (DCP) storage layers share.

A checkpoint is a directory (or an object prefix) holding

* ``__<rank>_0.<token>.distcp``: what one rank wrote, one file per rank; ``token`` names the save;
* ``.metadata``: DCP's ``Metadata`` (pickled), written last, by the coordinator, in one atomic step.

So a checkpoint is visible only once complete. Because every save writes files of its own token, an
earlier checkpoint at the same path stays loadable until the new ``.metadata`` replaces it; then the
coordinator deletes the files it no longer references (also those a crashed save left there).

A save changes nothing a reader or Lightning sees under the checkpoint's name until it commits
(:meth:`ShardedStorageWriter._commit`), and the commit dates the checkpoint: the modification time
fsspec gives for the checkpoint's own path, which ``ckpt_path="last"`` compares across candidates, is
the time of its commit. So a save killed in the middle never makes the previous checkpoint under its
name, or a partial one, look newer than a checkpoint committed after that one. How depends on the
storage: on a local filesystem, whose directories are dated by every file created in them, the ranks
write their files in a directory beside the checkpoint that the commit swaps in; in a bucket, where a
prefix has no date, the commit writes an object at the checkpoint's own name after its ``.metadata``.

One save at a time: the coordinator holds the checkpoint's :class:`SaveLock` from planning until it
has published and cleaned up, and a save that finds it held fails at once with
:class:`~lightning_storage_plugins.errors.ConcurrentWriteError`, before writing anything. So every file
of another token that the holder finds belongs to a save that is over (finished, failed or dead), and
only those are deleted. A reader reads only what the metadata names inside the checkpoint: every
``relative_path`` is one plain file name.

:class:`ShardedStorageWriter` and :class:`ShardedStorageReader` hold that protocol; each plugin adds
how one rank's file is written and read. Every use of DCP API that changed between torch 2.6 and the
newest torch (``set_up_storage_writer``/``read_metadata`` keyword arguments, ``Metadata.version``,
``StorageMeta``) lives in this module; torch's private storage record (``StorageInfo``) comes from
:mod:`lightning_storage_plugins._torch_compat`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import io
import logging
import os
import pickle
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from lightning_storage_plugins._torch_compat import StorageInfo
from lightning_storage_plugins.errors import (
    CheckpointExistsError,
    CheckpointMetadataError,
    ConcurrentWriteError,
)
from lightning_storage_plugins.reentry import ReentrantOperationError

log = logging.getLogger(__name__)

__all__ = [
    "LEFTOVERS_TIMEOUT_S",
    "LOCK_NAME",
    "METADATA_NAME",
    "SaveLock",
    "check_bytes_item",
    "check_relative_path",
    "is_leftover",
    "is_swept",
    "narrow",
    "stamp_version",
    "ShardPlan",
    "ShardedStorageReader",
    "ShardedStorageWriter",
    "StorageInfo",
    "load_metadata",
    "shard_name",
]

METADATA_NAME = ".metadata"
# Held by the coordinator of the save in progress (an empty locked file; an object with a lease on gs://).
LOCK_NAME = ".dcp-save.lock"
SHARD_SUFFIX = ".distcp"
TOKEN_HEX_DIGITS = 12
# Names a save of ours (or torch's FileSystemWriter) puts in a checkpoint directory: shard files,
# their temporaries and part objects, and temporaries of ``.metadata``. Only these are ever swept.
_SWEPT = re.compile(r"^\.?__\d+_\d+(\.[0-9a-f]+)?\.distcp([./].*)?$|^\.metadata\..+$")
# What a killed save of ours may leave: shard files named by their save's token, with their
# temporaries, part objects and markers, and FastPersist's temporaries of ``.metadata``. torch's
# FileSystemWriter names its files without a token; a restart leaves what it wrote as it is.
_LEFTOVER = re.compile(rf"^\.?__\d+_\d+\.[0-9a-f]{{{TOKEN_HEX_DIGITS}}}\.distcp([./].*)?$|^\.metadata\.[0-9a-f]{{8}}\.tmp$")
#: How long a restart's removal of what killed saves left may take, by default (then the rest is left
#: for the next save of each checkpoint to remove).
LEFTOVERS_TIMEOUT_S = 60.0


def shard_name(rank: int, token: str, index: int = 0) -> str:
    """The file that rank ``rank`` writes for the save ``token``."""
    return f"__{rank}_{index}.{token}{SHARD_SUFFIX}"


def is_leftover(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint) is a file that a save of the plugins' DCP writers
    puts there and a killed one may leave: a shard file of a save, or one of its temporaries."""
    return _LEFTOVER.match(name) is not None


def is_swept(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint) is a shard file, a shard's leftover, or a metadata
    temporary: the only names a save deletes when its ``.metadata`` does not reference them."""
    return _SWEPT.match(name) is not None


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """``SavePlan.storage_data`` of one rank: the save's token and the rank's index in the plan, and
    whether the rank writes its file aside, for the commit to move in (``staged``; see
    :attr:`ShardedStorageWriter.stages_shards`)."""

    rank: int
    token: str
    staged: bool = False


def check_relative_path(name: object, where: str) -> str:
    """``name`` when it is a plain file name, as every DCP writer records a file: no directory part, not
    ``.`` or ``..``, no control characters; so that a reader never leaves the checkpoint.

    Raises:
        CheckpointMetadataError: naming ``where`` and the path.
    """
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or any(ord(char) < 32 or ord(char) == 127 for char in name)):
        raise CheckpointMetadataError(
            f"{where}: the metadata names {name!r}, which is not a file name inside the checkpoint "
            "(absolute paths, directories and '..' are refused)")
    return name


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The block of ``tensor`` at ``offsets`` with ``lengths`` (a view), as DCP's readers cut items."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def stamp_version(metadata: Metadata) -> None:
    """Set ``metadata.version`` as torch's FileSystemWriter does, where this torch has versions."""
    version = getattr(_dcp_filesystem, "CURRENT_DCP_VERSION", None)
    if version is not None and hasattr(metadata, "version"):
        metadata.version = version


# Metadata loading ---------------------------------------------------------------------------------
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global, so reading it never runs stored code."""

    def __init__(self, data: io.BytesIO, where: str, allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(data)
        self._where = where
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module, name) in self._allowed:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{self._where}: refusing to load global {module}.{name} from checkpoint metadata (it is not "
            "DCP metadata); pass weights_only=False to the reader only if you trust the checkpoint's source"
        )


def load_metadata(
    data: bytes, where: str, *, weights_only: bool | None = None,
    allowed: Iterable[tuple[str, str]] = (),
) -> Metadata:
    """Unpickle a ``.metadata`` file; unless ``weights_only`` is ``False``, only DCP's metadata
    classes (and ``allowed``) may appear in it.

    Raises:
        pickle.UnpicklingError: the file holds anything else, or is not a pickle (``where`` named).
    """
    try:
        if weights_only is False:
            metadata = pickle.loads(data)
        else:
            metadata = _MetadataUnpickler(io.BytesIO(data), where, frozenset(allowed)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as err:
        raise pickle.UnpicklingError(f"{where}: not DCP checkpoint metadata ({err})") from err
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def check_bytes_item(data: bytes | memoryview, where: str, weights_only: bool | None) -> None:
    """Refuse a pickled (``BYTE_IO``) item that ``torch.load(weights_only=...)`` refuses.

    DCP's default load planner unpickles these items without restriction; this check runs first, so
    with ``weights_only`` left to torch's default a payload that would run code is never unpickled.

    Raises:
        pickle.UnpicklingError: naming ``where``.
    """
    if weights_only is False:
        return
    try:
        torch.load(io.BytesIO(data), weights_only=weights_only)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"{where}: refused by torch.load(weights_only=True): {err}. Pass weights_only=False to the "
            "reader only if you trust the checkpoint's source."
        ) from None


# Writer and reader --------------------------------------------------------------------------------
class _CheckpointStorage(abc.ABC):
    """What the writer and the reader of a plugin share: its checkpoint ids and its storage infos,
    and one save or load at a time per thread.

    It comes first among their bases, so that its :meth:`validate_checkpoint_id` is the one DCP finds.
    """

    #: The plugin's own ``StorageInfo`` subclasses, which its checkpoints' metadata may hold.
    storage_info_types: tuple[type, ...] = ()
    #: What a save or load through this instance is called in refusals: ``"saving"`` or ``"loading"``.
    _activity = "using"
    path: str | None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_busy": {}}  # the steps in progress belong to this process' threads

    @contextlib.contextmanager
    def _step(self, path: str | os.PathLike[str] | None = None) -> Iterator[None]:
        """Run one of DCP's steps of a save or load through this instance (of ``path``, by default
        this instance's), refusing it on a thread that is inside another step of this instance.

        Why: a signal handler (or a callback) runs on the thread it interrupts; a save or load it
        asks of this instance would take over the state of the one in progress (its path, save id,
        save lock and connection) and leave that one writing into another checkpoint, or without
        its lock. Another thread's step is not refused: one instance serves one save at a time, and
        DCP calls each step on the thread that runs the save (or on its async-save thread).

        Raises:
            ReentrantOperationError: this thread is inside a step of this instance.
        """
        busy: dict[int, str] = self.__dict__.setdefault("_busy", {})
        me = threading.get_ident()
        target = path if path is not None else self.path
        asked = f"{self._activity} {target if target is not None else 'a checkpoint through the same instance'}"
        if me in busy:
            name = type(self).__name__
            raise ReentrantOperationError(busy[me], asked, f"a {name} serves one save or load at a time; give the "
                                          f"one asked for inside another its own {name}")
        busy[me] = asked
        try:
            yield
        finally:
            del busy[me]

    @staticmethod
    @abc.abstractmethod
    def _normalize(checkpoint_id: str | os.PathLike[str]) -> str:
        """The canonical form of a checkpoint id (raises ``ValueError`` for one of another storage)."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a checkpoint in this storage."""
        try:
            cls._normalize(checkpoint_id)
        except ValueError:
            return False
        return True


# Writer -------------------------------------------------------------------------------------------
class SaveLock(abc.ABC):
    """The right to save to one checkpoint, held by one save's coordinator from planning until it has
    published and cleaned up; the plugins hold it with ``flock`` (NVMe) or a leased object (gs://)."""

    @abc.abstractmethod
    def confirm(self) -> float:
        """Check that the lock is still held.

        Returns:
            The ``time.monotonic()`` until which it is certainly held (``math.inf`` for a lock that
            only the holder's death releases).

        Raises:
            ConcurrentWriteError: it was lost (its lease ran out, and another save may have taken it).
        """

    @abc.abstractmethod
    def release(self) -> None:
        """Let go of the lock (idempotent; never raises for a lock already lost)."""


class ShardedStorageWriter(_CheckpointStorage, StorageWriter, BlockingAsyncStager):
    """The save protocol of the plugins' DCP writers; subclasses add the storage.

    Subclasses implement :meth:`_write_shard` (write one rank's file atomically under its final name),
    :meth:`_lock_checkpoint`, and the small file operations :meth:`_publish`, :meth:`_read`,
    :meth:`_list`, :meth:`_size` and :meth:`_delete`, plus :meth:`_normalize` (which also answers
    :meth:`validate_checkpoint_id`).

    Args:
        path: the checkpoint (may be ``None`` when ``dcp.save(checkpoint_id=...)`` supplies it).
        overwrite: when ``False``, a save to a path that holds a checkpoint raises
            :class:`~lightning_storage_plugins.errors.CheckpointExistsError` (a ``FileExistsError`` and
            the ``RuntimeError`` torch's ``FileSystemWriter`` raises).
        cache_staged_state_dict: as for torch's ``FileSystemWriter`` (``dcp.async_save`` staging).
    """

    def __init__(
        self, path: str | os.PathLike[str] | None, *, overwrite: bool = True, cache_staged_state_dict: bool = False
    ) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.path = self._normalize(path) if path is not None else None
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self._token: str | None = None
        self._staged = False  # whether this rank's file of the save goes aside (see ShardPlan)
        self._lock: SaveLock | None = None

    _activity = "saving"
    #: Whether the ranks write their files aside (where :meth:`_write_shard` puts a ``staged`` plan's
    #: file), for :meth:`_commit` to make them the checkpoint's, rather than into the checkpoint.
    stages_shards = False

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_lock": None}  # a lock belongs to the process that took it

    # Storage operations (relative names inside the checkpoint) --------------------------------
    @abc.abstractmethod
    def _write_shard(self, name: str, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """Write ``items`` into the file ``name``; nothing appears under ``name`` unless complete."""

    @abc.abstractmethod
    def _lock_checkpoint(self) -> SaveLock:
        """Take the checkpoint's save lock, at once.

        Raises:
            ConcurrentWriteError: another save holds it.
        """

    @abc.abstractmethod
    def _publish(self, name: str, data: bytes) -> None:
        """Atomically create or replace ``name`` with ``data``, durably.

        Raises:
            ConcurrentWriteError: (``.metadata``) another save published since this one took the lock.
        """

    @abc.abstractmethod
    def _read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or ``None`` if there is no such file."""

    @abc.abstractmethod
    def _list(self) -> list[str]:
        """Every name in the checkpoint (part objects and temporaries included)."""

    @abc.abstractmethod
    def _size(self, name: str) -> int | None:
        """The size of ``name``, or ``None`` if there is no such file."""

    @abc.abstractmethod
    def _delete(self, names: Sequence[str]) -> None:
        """Delete ``names``; missing ones are fine."""

    def _commit(self, metadata: bytes) -> None:
        """Make this save the checkpoint, in one step: publish ``metadata`` (the pickled ``.metadata``)
        together with every file the save wrote.

        Nothing under the checkpoint's name changed before this, and after it the checkpoint's own
        path is dated now (see the module): by default the new ``.metadata`` dates it; a storage whose
        files do not date their checkpoint (a prefix of objects) or whose shards were written aside
        (:attr:`stages_shards`) adds what it needs.

        Raises:
            ConcurrentWriteError: another save published since this one took the lock.
        """
        self._publish(METADATA_NAME, metadata)

    def _prepare(self) -> None:
        """Make the checkpoint location ready for writing (every rank, before planning)."""

    def _remove_location(self) -> None:
        """Remove what is left of the checkpoint location once its files are deleted (called holding
        the save lock)."""

    def _children(self) -> dict[str, list[str]]:
        """The locations directly under this writer's path, taken as a directory of checkpoints, each
        with the names in it (as :meth:`_list` gives them for that checkpoint)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list the checkpoints of a directory")

    def _remove_dead_temporaries(self) -> int:
        """Remove the checkpoint's temporaries whose writers are certainly gone, whatever else is
        running (a storage that can tell); how many were removed."""
        return 0

    def _removable(self, name: str) -> bool:
        """Whether a restart that holds the save lock removes ``name`` when no checkpoint references it:
        files of our saves (:func:`is_leftover`), but not temporaries that a writer may still hold."""
        return is_leftover(name)

    @contextlib.contextmanager
    def _within(self, timeout_s: float) -> Iterator[None]:
        """Bound every storage request made in the block to end within ``timeout_s`` from now (a
        storage whose requests can wait on a network narrows their deadlines)."""
        yield

    # StorageWriter ------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, to ``checkpoint_id`` when given.

        Raises:
            ReentrantOperationError: this thread is inside a step of a save through this writer
                (this one was asked for from a signal handler or a callback).
        """
        with self._step(checkpoint_id or None):
            self._release()  # left by an earlier save on this writer that failed without abort()
            if checkpoint_id:
                self.path = self._normalize(checkpoint_id)
            self.save_id = uuid.uuid4().hex
            self._token = None
            self._staged = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Called by DCP on every rank before planning.

        Raises:
            ValueError: ``dcp.save(use_collectives=False)``: rank-local metadata is not supported.
            ReentrantOperationError: this thread is inside a step of a save through this writer.
        """
        with self._step():
            self._require_path()
            if kwargs.get("use_collectives", True) is False:
                raise ValueError(
                    f"{type(self).__name__} writes one .metadata for all ranks: use dcp.save(use_collectives=True)"
                )
            self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Make the checkpoint location ready (every rank); the plan is unchanged."""
        with self._step():
            self._prepare()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Take the checkpoint's save lock (coordinator) and give every rank the save's token (the
        coordinator's save id) and its file.

        Raises:
            ConcurrentWriteError: another save to this checkpoint is in progress.
            CheckpointExistsError: ``overwrite=False`` and a checkpoint is there.
        """
        with self._step():
            self._release()
            lock = self._lock_checkpoint()
            try:
                if not self.overwrite and self._read(METADATA_NAME) is not None:
                    raise CheckpointExistsError(
                        f"Checkpoint already exists at {self.checkpoint_id} and overwrite=False")
            except BaseException:
                lock.release()
                raise
            self._lock = lock
        token = self.save_id[:TOKEN_HEX_DIGITS]
        return [dataclasses.replace(plan, storage_data=ShardPlan(rank, token, self.stages_shards))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into its own file (none when it has no items)."""
        shard: ShardPlan = plan.storage_data
        with self._step():
            self._token, self._staged = shard.token, shard.staged
            if not plan.items:
                return _done([])
            name = shard_name(shard.rank, shard.token)
            return _done(self._write_shard(name, plan.items, planner))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Publish ``.metadata`` (coordinator only), after checking that every file it references is
        there and that the save lock is still held; then delete the files of saves that are over, and
        let go of the lock.

        Raises:
            FileNotFoundError: a rank's file is missing or short (nothing is published).
            ConcurrentWriteError: the save lock was lost meanwhile (nothing is published).
        """
        with self._step():
            try:
                storage: dict[MetadataIndex, Any] = {}
                ends: dict[str, int] = {}
                for rank_results in results:
                    for result in rank_results:
                        storage[result.index] = result.storage_data
                        info = result.storage_data
                        end = info.offset + info.length
                        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
                for name, end in sorted(ends.items()):
                    size = self._size(name)
                    if size is None or size < end:
                        raise FileNotFoundError(
                            f"{self.checkpoint_id}/{name} is {'missing' if size is None else f'{size} bytes'}, "
                            f"expected {end}: not publishing this checkpoint"
                        )
                metadata.storage_data = storage
                metadata.storage_meta = self.storage_meta()
                stamp_version(metadata)
                self._held_lock().confirm()
                self._commit(pickle.dumps(metadata))
                log.debug("published %s (%d files)", self.checkpoint_id, len(ends))
                self._sweep(set(ends))
            finally:
                self._release()

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint id and this save's id, recorded in the metadata."""
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        """Where this writer saves."""
        return self._require_path()

    # Clean-up -----------------------------------------------------------------------------------
    def _held_lock(self) -> SaveLock:
        if self._lock is None:
            raise ConcurrentWriteError(f"{self.checkpoint_id}: this save does not hold the checkpoint's save lock "
                                       "(was prepare_global_plan called?)", target=self.checkpoint_id)
        return self._lock

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _sweep(self, keep: set[str]) -> None:
        """Delete the files of saves that are over: every shard, leftover and metadata temporary that
        ``keep`` (the files of the checkpoint just published) does not hold."""
        try:
            held_until = self._held_lock().confirm()
        except ConcurrentWriteError:
            log.warning("%s: published, but the save lock was lost before clean-up; leaving other files in "
                        "place for the next save to remove", self.checkpoint_id)
            return
        names = self._list()
        # Listed while the lock was held: no save in progress can own any of these names.
        if time.monotonic() >= held_until:
            log.warning("%s: listing outlasted the save lock; leaving other files in place for the next save "
                        "to remove", self.checkpoint_id)
            return
        stale = [name for name in names if is_swept(name) and not _under(name, keep)]
        if stale:
            log.debug("deleting %d files no checkpoint at %s references", len(stale), self.checkpoint_id)
            self._delete(stale)

    def abort(self) -> None:
        """Remove what the current save wrote, once ``dcp.save``/``dcp.async_save`` has failed.

        Does nothing when the save's ``.metadata`` was published after all (the checkpoint is
        complete). Otherwise deletes the files of this save, those of other ranks included (a rank
        killed mid-save cannot clean up after itself); safe to call on every rank. Lets go of the
        save lock. A later save to the same path deletes anything left over, too.
        """
        with self._step():
            try:
                token = self._token
                if token is None or self.path is None:
                    return
                published = self._read(METADATA_NAME)
                allowed = _qualified(self.storage_info_types)
                if published is not None and token in _referenced_tokens(published, self.checkpoint_id, allowed):
                    return
                own = [name for name in self._list() if is_swept(name) and f".{token}." in name]
                log.warning("save to %s failed: deleting its %d files", self.checkpoint_id, len(own))
                self._delete(own)
                self._token = None
            finally:
                self._release()

    # Restart ------------------------------------------------------------------------------------
    def leftover_checkpoints(self, timeout_s: float = LEFTOVERS_TIMEOUT_S) -> list[str]:
        """The checkpoints directly under this writer's path, taken as a directory of checkpoints
        (``ModelCheckpoint``'s), that hold a save lock or files of our saves: where
        :meth:`remove_leftovers` may find something to remove. Locations that hold neither (torch's
        ``FileSystemWriter`` checkpoints among them) are not named.

        Args:
            timeout_s: how long the listing may take.

        Raises:
            ReentrantOperationError: this thread is inside a step of a save through this writer.
            OSError: the storage could not be listed (the Dataflux writer: ``TransferError``,
                ``DeadlineExceededError``).
        """
        with self._step(), self._within(timeout_s):
            children = self._children()
        base = self.checkpoint_id.rstrip("/")
        return sorted(f"{base}/{child}" for child, names in children.items()
                      if any(name == LOCK_NAME or is_leftover(name) for name in names))

    def remove_leftovers(self, timeout_s: float = LEFTOVERS_TIMEOUT_S) -> int:
        """Remove what killed saves left in the checkpoint at this writer's path, never what a live
        save is writing (a restart calls it for each checkpoint of its ``ModelCheckpoint`` directories).

        First the temporaries whose writers are certainly gone (the storage tells: FastPersist's
        temporary files whose writer's ``flock`` is free, part objects of uploads whose process is
        gone or whose lease ran out), whatever else is running. Then, holding the checkpoint's save
        lock (taken over from a save that is over; where a live save holds it, nothing more is done),
        every file of our saves that the checkpoint's ``.metadata`` does not reference, and the lock
        itself; a location left without a checkpoint and without other files is removed. Files of
        torch's ``FileSystemWriter`` are left as they are, and so is everything where ``.metadata``
        cannot be read. What is removed is logged.

        Args:
            timeout_s: how long it may take; what is left then stays for the next save of the
                checkpoint to remove.

        Returns:
            How many files (objects) were removed.

        Raises:
            ReentrantOperationError: this thread is inside a step of a save through this writer.
            OSError: the storage failed (the Dataflux writer: ``TransferError``,
                ``DeadlineExceededError``).
        """
        with self._step(), self._within(timeout_s):
            until = time.monotonic() + timeout_s
            removed = self._remove_dead_temporaries()
            try:
                lock = self._lock_checkpoint()
            except ConcurrentWriteError:
                log.debug("%s: a save in progress holds the save lock; leaving its files", self.checkpoint_id)
                return removed
            try:
                return removed + self._remove_unreferenced(until)
            finally:
                lock.release()

    def _remove_unreferenced(self, until: float) -> int:
        """:meth:`remove_leftovers`' part under the save lock; how many files it removed."""
        names = self._list()
        published = self._read(METADATA_NAME)
        keep: set[str] | None = set()
        if published is not None:
            keep = _referenced_names(published, f"{self.checkpoint_id}/{METADATA_NAME}",
                                     _qualified(self.storage_info_types))
            if keep is None:
                log.warning("%s: its %s cannot be read as DCP metadata; leaving every file in place",
                            self.checkpoint_id, METADATA_NAME)
                return 0
        stale = sorted(name for name in names if self._removable(name) and not _under(name, keep))
        if time.monotonic() >= until:
            log.warning("%s: the time for removing what killed saves left ran out; leaving %d files for the next "
                        "save to remove", self.checkpoint_id, len(stale))
            return 0
        if stale:
            shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
            log.warning("%s: removing %d files of saves that are over, which no checkpoint references: %s",
                        self.checkpoint_id, len(stale), shown)
            self._delete(stale)
        if published is None:
            log.info("%s: no save published a checkpoint there; removing its save lock, and the location once "
                     "nothing else is in it", self.checkpoint_id)
            self._remove_location()
        return len(stale)

    def remove(self) -> None:
        """Delete the checkpoint at this writer's path: ``.metadata`` first (so that it is no longer a
        checkpoint), then everything under the path. Holds the save lock meanwhile.

        Raises:
            ConcurrentWriteError: a save to this checkpoint is in progress.
        """
        with self._step():
            lock = self._lock_checkpoint()
            try:
                self._delete([METADATA_NAME])
                self._delete([name for name in self._list() if name != LOCK_NAME])
                self._remove_location()
            finally:
                lock.release()

    def _require_path(self) -> str:
        if self.path is None:
            raise ValueError(f"{type(self).__name__} has no path: pass one, or dcp.save(checkpoint_id=...)")
        return self.path


def _under(name: str, keep: set[str]) -> bool:
    """Whether ``name`` is one of ``keep`` or lies inside one of them (a referenced file's parts)."""
    return any(name == kept or name.startswith(kept + "/") for kept in keep)


def _qualified(types: Iterable[type]) -> tuple[tuple[str, str], ...]:
    return tuple((cls.__module__, cls.__qualname__) for cls in types)


def _referenced_names(data: bytes, where: str, allowed: Iterable[tuple[str, str]]) -> set[str] | None:
    """The files a ``.metadata`` names; ``None`` where it is not DCP metadata."""
    try:
        metadata = load_metadata(data, where, allowed=allowed)
    except pickle.UnpicklingError:
        return None
    return {getattr(info, "relative_path", "") for info in (metadata.storage_data or {}).values()}


def _referenced_tokens(data: bytes, where: str, allowed: Iterable[tuple[str, str]]) -> set[str]:
    names = _referenced_names(data, where, allowed) or set()
    return {part for name in names for part in name.split(".")[1:-1]}


# Reader -------------------------------------------------------------------------------------------
class ShardedStorageReader(_CheckpointStorage, StorageReader):
    """The load protocol of the plugins' DCP readers; subclasses add how items are read.

    Args:
        path: the checkpoint (may be ``None`` when ``dcp.load(checkpoint_id=...)`` supplies it).
        weights_only: ``None`` (torch's default, restricted) or ``True``: the metadata may only hold
            DCP's classes and pickled items must pass ``torch.load(weights_only=True)``; ``False``
            unpickles them without restriction (only for checkpoints from a trusted source).
    """

    _activity = "loading"

    def __init__(self, path: str | os.PathLike[str] | None, *, weights_only: bool | None = None) -> None:
        StorageReader.__init__(self)
        self.path = self._normalize(path) if path is not None else None
        self.weights_only = weights_only
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._metadata_error: Exception | None = None  # why the last global metadata read failed

    @abc.abstractmethod
    def _read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or ``None`` if there is no such file."""

    @abc.abstractmethod
    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan`` and hand it to ``planner``."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` when given.

        Raises:
            ReentrantOperationError: this thread is inside a step of a load through this reader
                (this one was asked for from a signal handler or a callback).
        """
        with self._step(checkpoint_id or None):
            self.storage_data = {}
            if checkpoint_id:
                self.path = self._normalize(checkpoint_id)
            self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (see ``weights_only``).

        Raises:
            FileNotFoundError: there is no complete checkpoint at the path.
            pickle.UnpicklingError: the metadata holds something other than DCP metadata.
            ReentrantOperationError: this thread is inside a step of a load through this reader.
        """
        with self._step():
            return self._read_metadata(**kwargs)

    def _read_metadata(self, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # Newer torch asks for rank-local metadata after the global read failed, and some releases
            # (2.11) then drop both errors for "metadata is None": the reason is logged here so that
            # the caller still learns it.
            if self._metadata_error is not None:
                log.warning("cannot load the checkpoint: %s", self._metadata_error)
            raise FileNotFoundError(f"{type(self).__name__} reads one {METADATA_NAME} for all ranks, "
                                    f"not rank-local metadata ({self.checkpoint_id})") from self._metadata_error
        self._metadata_error = None
        try:
            return self._read_global_metadata()
        except Exception as error:
            self._metadata_error = error
            raise

    def _read_global_metadata(self) -> Metadata:
        where = f"{self.checkpoint_id}/{METADATA_NAME}"
        data = self._read(METADATA_NAME)
        if data is None:
            raise FileNotFoundError(f"no checkpoint at {self.checkpoint_id} (no {METADATA_NAME})")
        metadata = load_metadata(data, where, weights_only=self.weights_only,
                                 allowed=_qualified(self.storage_info_types))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def exists(self) -> bool:
        """Whether a complete checkpoint is at the path (its ``.metadata`` is there)."""
        return self._read(METADATA_NAME) is not None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep where every item lies (from the metadata), once every item is checked.

        Raises:
            CheckpointMetadataError: an item lies outside the checkpoint (see :func:`check_relative_path`)
                or :meth:`_check_item` refuses it.
            ReentrantOperationError: this thread is inside a step of a load through this reader.
        """
        with self._step():
            self._set_up(metadata)

    def _set_up(self, metadata: Metadata) -> None:
        if metadata.storage_data is None:
            raise ValueError(f"{self.checkpoint_id}/{METADATA_NAME} has no storage data")
        where = f"{self.checkpoint_id}/{METADATA_NAME}"
        checked: set[str] = set()
        for index, info in metadata.storage_data.items():
            name = getattr(info, "relative_path", None)
            if name not in checked:
                checked.add(check_relative_path(name, f"{where} (item {index.fqn})"))
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
                raise CheckpointMetadataError(f"{where}: item {index.fqn} has offset {offset!r} and length "
                                              f"{length!r}; both must be integers >= 0")
            self._check_item(info, f"{where}: item {index.fqn}")
        self.storage_data = metadata.storage_data

    def _check_item(self, info: Any, where: str) -> None:
        """Refuse a stored item this reader cannot read safely (a plugin's own checks)."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans, unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items (see the plugin) and hand them to ``planner``; a completed future.

        Raises:
            ReentrantOperationError: this thread is inside a step of a load through this reader.
        """
        with self._step():
            self._read_items(plan, planner)
        return _done(None)

    @property
    def checkpoint_id(self) -> str:
        """Where this reader loads from."""
        if self.path is None:
            raise ValueError(f"{type(self).__name__} has no path: pass one, or dcp.load(checkpoint_id=...)")
        return self.path

    def check_bytes(self, data: bytes | memoryview, index: MetadataIndex) -> None:
        """Apply ``weights_only`` to a pickled item before DCP's planner unpickles it."""
        check_bytes_item(data, f"{self.checkpoint_id}: item {index.fqn}", self.weights_only)


