"""``torch.distributed.checkpoint`` storage on NVMe: torch's directory layout, FastPersist's I/O.

    dcp.save(state_dict, storage_writer=FastPersistStorageWriter("/mnt/nvme0/run/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistStorageReader("/mnt/nvme0/run/step-100"))

The checkpoint is what torch's ``FileSystemWriter`` writes: one file per rank whose items are
``torch.save`` blobs (pickled items raw) and a pickled ``.metadata``, so torch's ``FileSystemReader``
loads it, and :class:`FastPersistStorageReader` loads checkpoints torch wrote. What differs is the I/O:
each rank's file is streamed through the two halves of a page-locked staging buffer, each half going
out in large aligned O_DIRECT writes as it fills, through a FastPersist engine (DeepSpeed aio by default)
that checks the bytes every write put down; the file is fsynced and renamed into place. Loads read each
file in windows with parallel aligned O_DIRECT reads, the next window in flight while this one's tensors
(built on the bytes read, no copy) are copied into their targets.

A save touches nothing under the checkpoint's name until it commits. Every rank writes its file into
a directory beside the checkpoint, ``.<name>.<token>.dcp-save``; the coordinator writes ``.metadata``
there and swaps that directory with the checkpoint's in one ``renameat2(RENAME_EXCHANGE)`` (a first
save renames it into place), then deletes the previous checkpoint's files. So the checkpoint directory
is always whole, and its modification time, which Lightning's ``ckpt_path="last"`` compares, is the
time of its commit: a save killed in the middle leaves the previous checkpoint as it was, dated as it
was. Where the filesystem cannot exchange two names (NFS), the files are renamed into the checkpoint
and ``.metadata`` replaced last; a kill during those few renames dates the previous checkpoint then.

A save's coordinator holds an exclusive ``flock`` on ``.<name>.dcp-save.lock`` beside the checkpoint from
planning to publishing (the kernel lets go when the process dies); a second save finds it held and
fails with ``ConcurrentWriteError``. Readers open only regular files (never through a link, never a
FIFO or a device, refused before anything blocks) named by the metadata inside the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import math
import os
import re
import shutil
import stat
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from typing_extensions import override

from fastpersist import _libc, _torch_compat
from fastpersist.archive import TORCH_STORAGE_ALIGNMENT
from fastpersist.buffers import DoubleBuffer, split_halves
from fastpersist.context import DEFAULT_BUFFER_MB, FastPersistContext
from fastpersist.engines import OpenFile, Transfer, io_error
from fastpersist.memory import ALIGNMENT_BYTES, aligned_empty, round_down, round_up
from fastpersist.writer import (
    ARCHIVE_OVERHEAD_BYTES,
    TEMP_SUFFIX,
    fsync_dir,
    remove_stale_temporaries,
    save_file,
    write_archive,
)
from lightning_storage_plugins import release
from lightning_storage_plugins.dcp import (
    LOCK_NAME,
    METADATA_NAME,
    TOKEN_HEX_DIGITS,
    SaveLock,
    ShardedStorageReader,
    ShardedStorageWriter,
    StorageInfo,
    is_leftover,
    narrow,
)
from lightning_storage_plugins.errors import CheckpointMetadataError, ConcurrentWriteError

log = logging.getLogger(__name__)

__all__ = ["FastPersistStorageReader", "FastPersistStorageWriter"]

# A file is read in windows that start at FIRST_READ_WINDOW_BYTES and double up to READ_WINDOW_BYTES.
# Only the first window's read has nothing to overlap (each later one is read while the items of the
# one before are copied out), so a small first window starts the copying early; the large later ones
# keep several reads in flight. On a 2-vCPU VM, a cold 64 MiB shard of 63 tensors loaded in about
# 0.15 s this way against 0.25 s with 64 MiB windows throughout; 512 MiB loaded as fast as before.
READ_WINDOW_BYTES = 64 * 2**20
FIRST_READ_WINDOW_BYTES = 4 * 2**20
# Where a tensor item's bytes start in the file, as torch.save aligns storages: each item is its own
# archive and is read at its own offset, so page alignment (what a whole-file fastpersist_save keeps,
# for reading straight into place) would only pad every small item out to 4 KiB.
ITEM_STORAGE_ALIGNMENT = TORCH_STORAGE_ALIGNMENT
# Attempts at locking when a removal replaces the lock file between our open and our flock.
_LOCK_ATTEMPTS = 5
# Ends the name of the directory beside a checkpoint where a save writes until it commits.
STAGING_SUFFIX = ".dcp-save"
_FILE_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
               stat.S_IFSOCK: "socket", stat.S_IFLNK: "symbolic link", stat.S_IFDIR: "directory"}


def _directory(checkpoint_id: str | os.PathLike[str]) -> str:
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or "://" in text:
        raise ValueError(f"not a local directory: {checkpoint_id!r}")
    return os.path.abspath(text)


def _open_regular(path: str, where: str) -> int:
    """A blocking read-only descriptor of ``path``, once it is known to be a regular file.

    The file's type is checked before it is opened (a device is never opened), it is opened without
    following a link and without blocking (a FIFO cannot stall the open), and checked again on the
    descriptor.

    Raises:
        FileNotFoundError: there is no ``path``.
        CheckpointMetadataError: ``path`` is a link, a FIFO, a device, a socket or a directory.
    """

    def refuse(mode: int) -> CheckpointMetadataError:
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "special file")
        return CheckpointMetadataError(f"{where}: {path} is a {kind}, not a regular file; a checkpoint's files "
                                       "must be regular files")

    before = os.lstat(path)
    if not stat.S_ISREG(before.st_mode):
        raise refuse(before.st_mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        if err.errno == errno.ELOOP:  # replaced by a link since the lstat
            raise refuse(stat.S_IFLNK) from None
        raise
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode):
        os.close(fd)
        raise refuse(opened.st_mode)
    os.set_blocking(fd, True)
    return fd


def _open_for_reading(path: str, where: str) -> tuple[OpenFile, int]:
    """``path`` (a regular file, see :func:`_open_regular`) opened twice on the same inode: with O_DIRECT
    where the filesystem allows it, and buffered (for the unaligned end of a range)."""
    fd = _open_regular(path, where)
    try:
        buffered = _reopen(fd, path, where)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            return OpenFile(path, fd, True), buffered
        except OSError as err:
            if err.errno != errno.EINVAL:
                os.close(buffered)
                raise
        log.warning("%s: filesystem refuses O_DIRECT; using buffered I/O", path)
        return OpenFile(path, fd, False), buffered
    except BaseException:
        os.close(fd)
        raise


def _reopen(fd: int, path: str, where: str) -> int:
    """A second, independent descriptor of the file ``fd`` has open (its own file status flags)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # no /proc: open the path again, and make sure it is still the same file
        again = _open_regular(path, where)
        first, second = os.fstat(fd), os.fstat(again)
        if (first.st_dev, first.st_ino) != (second.st_dev, second.st_ino):
            os.close(again)
            raise CheckpointMetadataError(f"{where}: {path} was replaced while it was being opened") from None
        return again


class _DirectoryCheckpoint:
    """What the writer and the reader share: a checkpoint is the files of one local directory."""

    checkpoint_id: str

    @staticmethod
    def _normalize(checkpoint_id: str | os.PathLike[str]) -> str:
        return _directory(checkpoint_id)

    def _file(self, name: str) -> str:
        return os.path.join(self.checkpoint_id, name)

    def _read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name``; ``None`` when there is none.

        Raises:
            CheckpointMetadataError: ``name`` is a link, a FIFO, a device... (see :func:`_open_regular`).
        """
        try:
            fd = _open_regular(self._file(name), self.checkpoint_id)
        except FileNotFoundError:
            return None
        with open(fd, "rb") as stream:
            return stream.read()


def _beside(checkpoint: str, suffix: str) -> str:
    """The hidden name ``.<checkpoint's name><suffix>`` in the checkpoint's parent directory."""
    parent, name = os.path.split(checkpoint)
    return os.path.join(parent, f".{name}{suffix}")


def lock_path(checkpoint: str) -> str:
    """The save lock's file of the checkpoint directory ``checkpoint``: beside it, so that taking the
    lock changes nothing under the checkpoint's name."""
    return _beside(checkpoint, LOCK_NAME)


def staging_path(checkpoint: str, token: str) -> str:
    """The directory beside ``checkpoint`` where the save ``token`` writes its files until it commits."""
    return _beside(checkpoint, f".{token}{STAGING_SUFFIX}")


def _staging_dirs(checkpoint: str) -> list[str]:
    """Every save's directory beside ``checkpoint`` (see :func:`staging_path`)."""
    parent, name = os.path.split(checkpoint)
    pattern = re.compile(rf"^\.{re.escape(name)}\.[0-9a-f]{{{TOKEN_HEX_DIGITS}}}{re.escape(STAGING_SUFFIX)}$")
    try:
        return [os.path.join(parent, entry) for entry in os.listdir(parent) if pattern.match(entry)]
    except FileNotFoundError:
        return []


def _exchange(first: str, second: str) -> bool:
    """Swap the names ``first`` and ``second`` in one step (``renameat2(RENAME_EXCHANGE)``); ``False``
    where this kernel or filesystem cannot.

    Raises:
        OSError: the exchange failed for another reason (the path is named).
    """
    error = _libc.exchange(os.fsencode(first), os.fsencode(second))
    if error == 0:
        return True
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(error, f"cannot swap {first} in for {second}: {os.strerror(error)}", second)


def _remove_tree(path: str) -> None:
    """Delete ``path``: a directory with everything in it (its files' blocks freed after this returns,
    see :mod:`~lightning_storage_plugins.release`), a file, or a link (never its target)."""
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError), release.freed_later(path):
            os.unlink(path)
        return
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError), release.freed_later(entry.path):
                    os.unlink(entry.path)
    shutil.rmtree(path, ignore_errors=True)  # never follows a link, at the top or inside


class _DirectoryLock(SaveLock):
    """An exclusive ``flock`` on a checkpoint's lock file (beside it), which exists only while held.

    The holder unlinks the file before letting go; whoever opened it meanwhile finds, once it has the
    flock, that the path no longer names that file, and tries again (see :func:`_lock_directory`).
    """

    def __init__(self, fd: int, directory: str) -> None:
        self._fd: int | None = fd
        self._directory = directory

    def confirm(self) -> float:
        if self._fd is None:
            raise ConcurrentWriteError(f"{self._directory}: the save lock was already let go", target=self._directory)
        return math.inf  # only this process' death lets go of a flock

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            path = lock_path(self._directory)
            held, current = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
                os.unlink(path)
        except FileNotFoundError:  # the checkpoint was removed with it
            pass
        finally:
            os.close(fd)


def _lock_directory(directory: str) -> _DirectoryLock:
    """Take the exclusive ``flock`` on the lock file of the checkpoint ``directory`` (created if
    missing, beside it: see :func:`lock_path`), at once.

    Raises:
        ConcurrentWriteError: another process (or another writer of this one) holds it.
    """
    path = lock_path(directory)
    flags = os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_LOCK_ATTEMPTS):
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | flags, 0o666)
        except PermissionError:  # another user's lock file: a shared lock needs no write access here
            fd = os.open(path, os.O_RDONLY | flags)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConcurrentWriteError(
                f"{directory}: another save to this checkpoint is in progress (it holds {LOCK_NAME}); this "
                "save wrote nothing", target=directory) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                os.close(fd)
                raise
            log.warning("%s: the filesystem has no flock, so concurrent saves to this checkpoint are not "
                        "detected", directory)
            return _DirectoryLock(fd, directory)
        held = os.fstat(fd)
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        if current is not None and held.st_nlink > 0 and (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino):
            return _DirectoryLock(fd, directory)
        os.close(fd)  # a removal took the file away between our open and our flock: lock the new one
    raise ConcurrentWriteError(f"{directory}: the checkpoint was removed and re-created {_LOCK_ATTEMPTS} times while "
                               "this save tried to lock it", target=directory)


def _shard_bytes(items: Sequence[WriteItem]) -> int:
    """About the bytes of a shard holding ``items``: each tensor's, padded, and room for the pickled
    items and the records (which are not pickled here to be measured: the planner pickles on each
    resolve)."""
    total = ARCHIVE_OVERHEAD_BYTES
    for item in items:
        total += ALIGNMENT_BYTES
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            element = torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
            total += math.prod(item.tensor_data.chunk.sizes) * element
    return total


def _write_durably(path: str, data: bytes) -> None:
    """Create or replace ``path`` with ``data`` in one step (a temporary, fsynced and renamed), durably."""
    temp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    fsync_dir(os.path.dirname(path))


def _tensor_to_save(tensor: torch.Tensor) -> torch.Tensor:
    """What ``FileSystemWriter`` stores for a tensor: itself, copied when it is a view of a larger
    storage (``torch.save`` would store the whole storage). A GPU tensor stays there: the staging
    buffer receives its bytes straight from the device."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class FastPersistStorageWriter(_DirectoryCheckpoint, ShardedStorageWriter):
    """A DCP ``StorageWriter`` that writes torch's checkpoint layout through FastPersist's engines.

    Args:
        path: the checkpoint directory (created if missing).
        context: the aio handle, staging buffer and lock to use, kept across saves (pass one when
            saving repeatedly); without one, each save creates and frees its own.
        engine: ``"aio"`` (default), ``"python"`` or ``"gds"``; an unavailable one falls back with a warning.
        io_buffer_mb: size of the staging buffer of a context this writer creates.
        overwrite: ``False`` refuses to save where a checkpoint exists.
        cache_staged_state_dict: as for torch's ``FileSystemWriter`` (``dcp.async_save``).

    Raises:
        ValueError: ``path`` is not a local path.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        context: FastPersistContext | None = None,
        engine: str | None = None,
        io_buffer_mb: float = DEFAULT_BUFFER_MB,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
    ) -> None:
        super().__init__(path, overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)
        self.context, self.engine, self.io_buffer_mb = context, engine, io_buffer_mb

    stages_shards = True

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "context": None}  # handles and pinned memory stay in their process

    def _prepare(self) -> None:
        os.makedirs(os.path.dirname(self.checkpoint_id), exist_ok=True)

    def _lock_checkpoint(self) -> SaveLock:
        return _lock_directory(self.checkpoint_id)

    def _shard_directory(self) -> str:
        """Where this save's files go: beside the checkpoint (a staged plan's, see the module), else in it."""
        if self._staged and self._token is not None:
            return staging_path(self.checkpoint_id, self._token)
        return self.checkpoint_id

    def _write_shard(self, name: str, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        results: list[WriteResult] = []
        ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)  # as torch orders them

        def content(stage: DoubleBuffer) -> int:
            storages = 0
            for item in ordered:
                start = stage.position
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stage.put(bytes(data.getbuffer()))
                else:  # the archive torch.save would write for the tensor, offsets relative to its start
                    storages += write_archive(_tensor_to_save(data), stage.put,
                                              lambda base=start: stage.position - base,
                                              alignment=ITEM_STORAGE_ALIGNMENT, base=start,
                                              in_place_from=stage.in_place_from)
                length = stage.position - start
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=StorageInfo(name, start, length)))
            return storages

        directory = self._shard_directory()
        os.makedirs(directory, exist_ok=True)
        context = self.context or FastPersistContext(engine=self.engine, io_buffer_mb=self.io_buffer_mb)
        try:
            save_file(os.path.join(directory, name), content, engine=self.engine, context=context,
                      nbytes=_shard_bytes(items))
        finally:
            if self.context is None:
                context.close()
        return results

    def _publish(self, name: str, data: bytes) -> None:
        _write_durably(self._file(name), data)

    @override
    def _commit(self, metadata: bytes) -> None:
        """Write ``.metadata`` beside this save's files, then swap their directory in for the
        checkpoint's (see the module); the previous checkpoint's files are left in this save's
        directory for the sweep."""
        if not self._staged:
            super()._commit(metadata)
            return
        staged, target = self._shard_directory(), self.checkpoint_id
        os.makedirs(staged, exist_ok=True)  # no rank had anything to write
        _write_durably(os.path.join(staged, METADATA_NAME), metadata)
        if not os.path.lexists(target):
            os.rename(staged, target)
        elif not _exchange(staged, target):
            self._move_in(staged)
        fsync_dir(os.path.dirname(target))

    def _move_in(self, staged: str) -> None:
        """Rename this save's files from ``staged`` into the checkpoint directory, ``.metadata`` last
        (where the filesystem cannot exchange two names)."""
        log.debug("%s: this filesystem cannot exchange two names; moving the files in", self.checkpoint_id)
        names = sorted(os.listdir(staged), key=lambda name: name == METADATA_NAME)
        for name in names:
            with release.freed_later(self._file(name)):
                os.rename(os.path.join(staged, name), self._file(name))
        fsync_dir(self.checkpoint_id)

    @override
    def _sweep(self, keep: set[str]) -> None:
        super()._sweep(keep)
        # Held under the save lock: every directory of a save of this checkpoint belongs to a save that
        # is over (this one's holds what it replaced).
        for path in _staging_dirs(self.checkpoint_id):
            _remove_tree(path)

    @override
    def abort(self) -> None:
        """Remove what the current save wrote, once it failed (see ``ShardedStorageWriter.abort``),
        and its directory beside the checkpoint (safe on every rank)."""
        staged = self._shard_directory() if self._staged and self._token is not None else None
        super().abort()
        if staged is not None:
            _remove_tree(staged)

    def _list(self) -> list[str]:
        try:
            return os.listdir(self.checkpoint_id)
        except FileNotFoundError:
            return []

    def _size(self, name: str) -> int | None:
        try:
            info = os.lstat(os.path.join(self._shard_directory(), name))
        except FileNotFoundError:
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def _delete(self, names: Sequence[str]) -> None:
        for name in names:
            path = self._file(name)
            try:
                with release.freed_later(path):  # the replaced shards' blocks are freed after we return
                    os.unlink(path)
            except FileNotFoundError:
                pass

    def _children(self) -> dict[str, list[str]]:
        children: dict[str, list[str]] = {}
        try:
            entries = list(os.scandir(self.checkpoint_id))
        except (FileNotFoundError, NotADirectoryError):
            return children
        beside = re.compile(rf"^\.(?P<name>.+?)(\.[0-9a-f]{{{TOKEN_HEX_DIGITS}}}{re.escape(STAGING_SUFFIX)}|"
                            rf"{re.escape(LOCK_NAME)})$")
        for entry in entries:
            # What a save puts beside a checkpoint (its lock, its files until it commits) counts as that
            # checkpoint's: removing it is remove_leftovers' of that checkpoint, under its lock.
            if match := beside.match(entry.name):
                names = children.setdefault(match["name"], [])
                if entry.name.endswith(LOCK_NAME):
                    names.append(LOCK_NAME)
                else:
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        names.extend(os.listdir(entry.path))
            elif entry.is_dir(follow_symlinks=False):  # a link (save_last="link") names another checkpoint
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    children.setdefault(entry.name, []).extend(os.listdir(entry.path))
        return children

    def _remove_dead_temporaries(self) -> int:
        # A writer holds its temporary's flock until it renames it: a free one's writer is gone.
        return len(remove_stale_temporaries(self.checkpoint_id))

    def _removable(self, name: str) -> bool:
        return is_leftover(name) and not name.endswith(TEMP_SUFFIX)

    @override
    def _remove_unreferenced(self, until: float) -> int:
        removed = super()._remove_unreferenced(until)
        # Held under the save lock: the directories of this checkpoint's saves beside it are those of
        # saves killed before their commit (or after it, before they removed what they replaced).
        for path in _staging_dirs(self.checkpoint_id):
            files = len(os.listdir(path)) if os.path.isdir(path) else 1
            log.warning("%s: removing %s, what a save killed before it was over left beside it (%d files)",
                        self.checkpoint_id, os.path.basename(path), files)
            _remove_tree(path)
            removed += files
        return removed

    def _remove_location(self) -> None:
        # Holding the save lock: the directory goes when it holds nothing, or only a lock file inside
        # it (where earlier saves kept their lock). Whoever opened that file meanwhile finds it unlinked
        # once it gets the flock, and starts over.
        path = self.checkpoint_id
        with contextlib.suppress(OSError):  # anything else in it, or already gone: it stays as it is
            names = os.listdir(path)
            if names in ([], [LOCK_NAME]):
                for name in names:
                    os.unlink(os.path.join(path, name))
                os.rmdir(path)

    def remove(self) -> None:
        """Delete the checkpoint directory: ``.metadata`` first, then the rest. When the path is a
        symbolic link, only the link is removed: its target is left as it is.

        Raises:
            ConcurrentWriteError: a save to this checkpoint is in progress.
            ReentrantOperationError: this thread is inside a step of a save through this writer.
        """
        with self._step():
            self._remove_directory()

    def _remove_directory(self) -> None:
        path = self.checkpoint_id
        if os.path.islink(path):
            os.unlink(path)
            log.debug("removed the link %s (its target stays)", path)
            return
        if not os.path.isdir(path):
            return
        lock = self._lock_checkpoint()
        try:
            try:
                directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):  # replaced meanwhile: not ours to follow
                    return
                raise
            try:
                os.unlink(METADATA_NAME, dir_fd=directory)
            except FileNotFoundError:
                pass
            finally:
                os.close(directory)
            shutil.rmtree(path, ignore_errors=True)  # never follows a link, at the top or inside
            for staged in _staging_dirs(path):  # what saves killed before their commit left beside it
                _remove_tree(staged)
        finally:
            lock.release()


class FastPersistStorageReader(_DirectoryCheckpoint, ShardedStorageReader):
    """A DCP ``StorageReader`` for checkpoint directories written by :class:`FastPersistStorageWriter`
    or torch's ``FileSystemWriter``, reading each file with parallel aligned O_DIRECT reads.

    Args:
        path: the checkpoint directory.
        context: whose reading threads to use (default: a context made and closed for each load).
        weights_only: see :class:`~lightning_storage_plugins.dcp.ShardedStorageReader`.

    Raises:
        ValueError: ``path`` is not a local path.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, context: FastPersistContext | None = None,
                 weights_only: bool | None = None) -> None:
        super().__init__(path, weights_only=weights_only)
        self.context = context

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "context": None}

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        context = self.context or FastPersistContext()
        try:
            for name, items in per_file.items():
                self._read_file(name, items, context, planner)
        finally:
            if self.context is None:
                context.close()

    def _read_file(self, name: str, items: list[ReadItem], context: FastPersistContext, planner: LoadPlanner) -> None:
        """Read the items of one file in windows (see ``FIRST_READ_WINDOW_BYTES``): the next window's
        reads are in flight while the items of this one are copied into their targets. Windows are
        read into two buffers in turn: the halves of the context's staging buffer where the caller
        keeps that context (this reader was given it), else two allocated for this file."""
        pairs = sorted(((item, self.storage_data[item.storage_index]) for item in items), key=lambda p: p[1].offset)
        windows: list[list[tuple[ReadItem, Any]]] = [[]]
        limit = min(FIRST_READ_WINDOW_BYTES, READ_WINDOW_BYTES)
        for pair in pairs:
            window = windows[-1]
            if window and pair[1].offset + pair[1].length - window[0][1].offset > limit:
                windows.append([])
                limit = min(2 * limit, READ_WINDOW_BYTES)
            windows[-1].append(pair)
        path = self._file(name)
        with context.operation(f"loading {path}"):
            halves = _window_buffers(context, windows, staging=self.context is not None)
            file, buffered = _open_for_reading(path, self.checkpoint_id)
            try:
                reads = [_RangeRead(file, buffered, windows[0], context, halves[0])]
                for index, window in enumerate(windows):
                    read = reads.pop()
                    if index + 1 < len(windows):
                        reads.append(_RangeRead(file, buffered, windows[index + 1], context, halves[(index + 1) % 2]))
                    data = read.result()
                    view = memoryview(data.numpy())
                    for item, info in window:
                        first = info.offset - read.start
                        offset = data.storage_offset() + first
                        storage = data.untyped_storage()[offset : offset + info.length]
                        self._use(item, view[first : first + info.length], storage, name, planner)
            finally:
                for read in reads:
                    read.abandon()
                file.close()
                os.close(buffered)

    def _use(self, item: ReadItem, data: memoryview, storage: torch.UntypedStorage, name: str,
             planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            self.check_bytes(data, item.storage_index)
            planner.load_bytes(item, io.BytesIO(data))
            return
        loaded = _load_tensor(data, storage, f"{self.checkpoint_id}/{name}")
        stored = narrow(loaded, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != stored.size():
            raise ValueError(f"{self.checkpoint_id}/{name}: item {item.storage_index.fqn} holds "
                             f"{tuple(stored.size())}, the target is {tuple(target.size())}")
        target.copy_(stored)
        planner.commit_tensor(item, target)


def _load_tensor(data: memoryview, storage: torch.UntypedStorage, where: str) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``data``, its storage a view of ``storage`` (the same bytes):
    no copy. Unpickled with ``weights_only=True``, as torch's FileSystemReader does."""
    tensor = _torch_compat.load_tensor_item(data, storage, where)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: a tensor item holds a {type(tensor).__name__}")
    return tensor


def _window_buffers(context: FastPersistContext, windows: list[list[tuple[ReadItem, Any]]],
                    staging: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Two page-aligned buffers for ``windows`` to be read into in turn: the halves of the context's
    host staging buffer where ``staging`` (and it has one), else two as large as the largest window;
    ``(None, None)`` for a single window (a window too large for its buffer gets its own allocation).
    Reads go through the python engine, which needs no page-locked memory: a context that holds no
    locked buffer yet lends an unlocked one, so a process that only loads never loads DeepSpeed's
    aio op, locks memory or makes an aio handle (whose teardown waits on the kernel at ``close``).

    Why: a window's tensors are views of its bytes only until they are copied into their targets, so
    two buffers serve every window. Memory already faulted in (the staging buffer, kept across
    loads) is read into at the disk's speed; a fresh allocation per window is faulted in page by page
    by the reads, which on a small virtual machine took as long as the reads themselves (a 512 MiB
    load of 16 tensors: 0.8 s, against 0.3 s into the staging buffer and 0.3 s for the raw read).
    """
    largest = max(max(info.offset + info.length for _, info in window) - window[0][1].offset for window in windows)
    size = largest + 2 * ALIGNMENT_BYTES  # the window's first and last blocks, read whole
    if staging:
        buffer = context.staging_buffer("cpu", pinned=False, nbytes=2 * size)
        if buffer.device.type == "cpu":
            try:
                return split_halves(buffer)
            except ValueError:
                pass
    if len(windows) < 2:
        return None, None
    return aligned_empty(size), aligned_empty(size)


class _RangeRead:
    """Bytes ``[start, end)`` of a file (the span of ``window``'s items) on their way into page-aligned
    memory (``into`` where it is large enough, else a new allocation): the aligned part with parallel
    O_DIRECT reads (started here), the unaligned end with a buffered read (in :meth:`result`)."""

    def __init__(self, file: OpenFile, buffered: int, window: list[tuple[ReadItem, Any]],
                 context: FastPersistContext, into: torch.Tensor | None = None) -> None:
        self.file, self.buffered = file, buffered
        self.start = window[0][1].offset
        self.end = max(info.offset + info.length for _, info in window)
        size = file.size()
        if self.end > size:
            raise io_error(errno.EIO, "read", file, size, f"file is {size} bytes, the checkpoint needs {self.end}")
        self.first = round_down(self.start)
        aligned_size = round_down(size)
        self.direct_end = max(self.first, min(round_up(self.end), aligned_size)) if file.direct else self.first
        needed = max(self.end, self.direct_end) - self.first
        self.whole = into.narrow(0, 0, needed) if into is not None and into.numel() >= needed else aligned_empty(needed)
        self.engine = None
        if self.direct_end > self.first:
            self.engine = context.python_engine()
            span = self.whole.narrow(0, 0, self.direct_end - self.first)
            self.engine.submit(Transfer(file, span, self.first, write=False))

    def result(self) -> torch.Tensor:
        """The bytes, once every read has completed (and its byte count was checked)."""
        if self.engine is not None:
            self.engine.wait()
            self.engine = None
        tail = max(self.direct_end, self.first)
        if self.end > tail:
            target = memoryview(self.whole.narrow(0, tail - self.first, self.end - tail).numpy())
            got = os.preadv(self.buffered, [target], tail)
            if got != self.end - tail:
                raise io_error(errno.EIO, "read", self.file, tail + got, f"short read of {self.file.path}")
        return self.whole.narrow(0, self.start - self.first, self.end - self.start)

    def abandon(self) -> None:
        """Wait for reads still in flight (their buffer must outlive them); errors are not reported."""
        if self.engine is not None:
            try:
                self.engine.wait()
            except OSError:
                pass
