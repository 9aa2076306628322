"""``fastpersist_save``: a torch.load-compatible file written as one aligned, double-buffered stream.

Write path (why): the object is pickled as torch.save pickles it, and every storage the pickler meets
is appended to the file at once (see :mod:`fastpersist.archive`), so disk writes overlap pickling.
The bytes go through the two halves of the staging buffer, and each quarter of a half goes out as one
large aligned write at the next sequential offset as soon as it is filled (so the disk starts after a
quarter of a half, not a whole one, and the last write waited for is a quarter): small tensors are
batched for free (10,000 tensors are still ``4 * size / half`` writes), every write is aligned, and
only the final tail is padded (then truncated off). Large host tensors skip the copy: the whole pages
of their bytes are written from their own memory (see :class:`~fastpersist.buffers.DoubleBuffer`).

Crash safety: the file is written under a temporary name in the target directory, fsynced and
renamed into place, so ``file_path`` only ever holds a complete checkpoint. Temporaries are locked
(``flock``) while their writer lives; the next save into the directory removes those whose writer
died (a killed process leaves its temporary behind, the lock goes with the process).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fastpersist import _torch_compat
from fastpersist.archive import ArchiveWriter, new_serialization_id
from fastpersist.buffers import DoubleBuffer, split_halves
from fastpersist.context import FastPersistContext
from fastpersist.engines import (
    FILE_MODE,
    AioEngine,
    IOEngine,
    OpenFile,
    PythonEngine,
    Transfer,
    io_error,
    link_unnamed,
    open_file,
    open_unnamed,
    reserve,
)
from fastpersist.memory import ALIGNMENT_BYTES, MiB, round_up
from lightning_storage_plugins import release
from lightning_storage_plugins.collector import collector_paused

log = logging.getLogger(__name__)

GB = 1024**3  # DeepNVMe's benchmarks report 2**30-byte "GB"; SaveStats.gbps follows them
TEMP_SUFFIX = ".fastpersist.tmp"
RESERVE_STEP_MAX = 1024 * MiB  # reserve ahead in steps of the size so far, at most this much
RESERVE_STEP_MIN = 64 * MiB
_CREATE_ATTEMPTS = 5
# Room estimated_bytes leaves for a save's pickle and the archive's small records.
ARCHIVE_OVERHEAD_BYTES = 256 * 1024


@dataclass(frozen=True)
class SaveStats:
    """What one save did: ``bytes`` written to ``path`` in ``seconds`` with ``engine``."""

    path: str
    bytes: int
    seconds: float
    engine: str
    num_storages: int
    num_writes: int

    @property
    def gbps(self) -> float:
        """Throughput in GiB per second."""
        return self.bytes / GB / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The fields and ``gbps`` as a plain dict (for JSON)."""
        return {**asdict(self), "gbps": self.gbps}


def fastpersist_save(
    obj: Any,
    file_path: str | os.PathLike[str],
    aio_handle: Any = None,
    pinned_buffer: torch.Tensor | None = None,
    *,
    engine: str | None = None,
    context: FastPersistContext | None = None,
    pickle_protocol: int = _torch_compat.DEFAULT_PROTOCOL,
    estimated_nbytes: int | None = None,
) -> SaveStats:
    """Save ``obj`` to ``file_path`` as a file ``torch.load`` reads, with large aligned async writes.

    The file is written under a temporary name in the same directory, fsynced and renamed into place:
    an error never leaves a partial file at ``file_path`` nor touches a previous one. A file it
    replaces keeps its permission bits; a new file gets ``0o666`` less the umask, like ``open()``.

    Args:
        obj: anything ``torch.save`` accepts (state dicts, nested containers, tensors on any device).
        file_path: destination; its directory must exist.
        aio_handle: a DeepSpeed aio handle (ignored when ``context`` is given).
        pinned_buffer: page-locked staging memory (ignored when ``context`` is given).
        engine: ``"aio"`` (default), ``"python"`` or ``"gds"``; an unavailable one falls back with a warning.
        context: handle, buffer and lock to use (and keep) across saves; without one, this call
            creates and frees its own.
        pickle_protocol: as for ``torch.save``.
        estimated_nbytes: :func:`estimated_bytes` of ``obj``, when the caller has it already (a
            walk over ``obj`` fewer); it sizes the staging buffer.

    Returns:
        :class:`SaveStats` (bytes, seconds, gbps, engine, path).

    Raises:
        FileNotFoundError: the directory does not exist.
        IsADirectoryError: ``file_path`` is a directory.
        ValueError: unknown engine, or a staging buffer too small or on the wrong device.
        OSError: a write failed or was short (ENOSPC when the disk is full), naming path and offset.
        ContextInUseError: ``context`` is saving or loading on this thread (this save was asked for
            from a signal handler or a callback that interrupted that); nothing was written.
    """
    return save_file(
        file_path,
        lambda stage: write_archive(obj, stage.put, lambda: stage.position, pickle_protocol,
                                    in_place_from=stage.in_place_from),
        aio_handle,
        pinned_buffer,
        engine=engine,
        context=context,
        nbytes=estimated_bytes(obj) if estimated_nbytes is None else estimated_nbytes,
    )


def estimated_bytes(obj: Any) -> int:
    """About the bytes :func:`fastpersist_save` writes for ``obj``: each storage of a tensor found in
    its dicts, lists, tuples and sets (shared storages once), each padded to the alignment, and room
    for the pickle and the archive's records. Tensors held elsewhere (attributes of other objects)
    are not counted: the staging buffer is then smaller, and the save still whole."""
    with collector_paused():  # a storage object per tensor: see collector_paused
        return _estimated_bytes(obj)


def _estimated_bytes(obj: Any) -> int:
    seen: set[int] = set()
    storages: set[tuple[str, int]] = set()
    total = ARCHIVE_OVERHEAD_BYTES
    pending = [obj]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
            except (NotImplementedError, RuntimeError):
                # Sparse tensors have no storage of their own; their dense size bounds what is saved.
                total += round_up(value.numel() * value.element_size()) + ALIGNMENT_BYTES
                continue
            key = (str(storage.device), storage.data_ptr())
            if key not in storages:
                storages.add(key)
                total += round_up(storage.nbytes()) + ALIGNMENT_BYTES  # its record's header, padding
            continue
        if id(value) in seen or not isinstance(value, (dict, list, tuple, set, frozenset)):
            continue
        seen.add(id(value))
        pending.extend(value.values() if isinstance(value, dict) else value)
    return total


def save_file(
    file_path: str | os.PathLike[str],
    content: Callable[[DoubleBuffer], int],
    aio_handle: Any = None,
    pinned_buffer: torch.Tensor | None = None,
    *,
    engine: str | None = None,
    context: FastPersistContext | None = None,
    nbytes: int | None = None,
) -> SaveStats:
    """Write a file whose bytes ``content`` puts into the staging buffer (and returns how many storages
    it wrote), as :func:`fastpersist_save` writes one: temporary name, aligned writes, fsync, rename.

    ``nbytes``, about the file's size, sizes the context's staging buffer (see
    :meth:`FastPersistContext.staging_buffer`); ``None``: its full ``io_buffer_mb``.

    Raises:
        As :func:`fastpersist_save`.
    """
    start = time.perf_counter()
    path = _check_target(file_path)
    owned = context is None
    ctx = context or FastPersistContext(engine=engine, aio_handle=aio_handle, pinned_buffer=pinned_buffer)
    try:
        with ctx.operation(f"saving {path}"):
            io_engine, buffer = _engine_and_buffer(ctx, engine, os.path.dirname(path), nbytes)
            remove_stale_temporaries(os.path.dirname(path))
            temp, file = _create_temporary(path)
            in_place: PythonEngine | None = None
            try:
                # Tensor bytes written straight from their memory go through the python engine's
                # threads: DeepSpeed's aio copies memory it did not page-lock into a bounce buffer.
                if file.direct and buffer.device.type == "cpu":
                    in_place = ctx.python_engine()
                reason = io_engine.accepts(buffer, file)
                if reason is not None:
                    ctx.warn_once(
                        f"fastpersist engine {io_engine.name!r} cannot be used ({reason}); using 'python'"
                    )
                    io_engine = ctx.python_engine()
                with collector_paused():
                    size, num_storages, num_writes = _write(content, io_engine, file, buffer, in_place)
                os.fsync(file.fd)
                # Renamed while the lock is held: unlocked, the finished temporary would look like a
                # dead writer's to a clean-up in another process (another rank saving beside us).
                with release.freed_later(path):  # the replaced file's blocks are freed after we return
                    os.replace(temp, path)
            except BaseException:
                io_engine.abandon()
                if in_place is not None:
                    in_place.abandon()  # its threads write from the caller's tensors into this file
                _unlink_quietly(temp)
                raise
            finally:
                file.close()
            fsync_dir(os.path.dirname(path))
    finally:
        if owned:
            ctx.close()
    stats = SaveStats(path, size, time.perf_counter() - start, io_engine.name, num_storages, num_writes)
    log.info(
        "saved %s: %d bytes in %.3f s (%.2f GB/s, engine %s)",
        path,
        size,
        stats.seconds,
        stats.gbps,
        stats.engine,
    )
    return stats


def _engine_and_buffer(
    ctx: FastPersistContext, engine: str | None, directory: str, nbytes: int | None
) -> tuple[IOEngine, torch.Tensor]:
    io_engine = ctx.io_engine(engine, directory)
    buffer = ctx.staging_buffer(io_engine.device, pinned=not isinstance(io_engine, PythonEngine), nbytes=nbytes)
    on_gpu = buffer.device.type != "cpu"
    if io_engine.device == "cpu" and on_gpu:
        raise ValueError(
            f"staging buffer is on {buffer.device}, but the {io_engine.name!r} engine stages through "
            "page-locked host memory (use get_pinned_buffer(), or engine='gds')"
        )
    if io_engine.device != "cpu" and not on_gpu:
        ctx.warn_once(
            f"fastpersist engine 'gds' needs a GPU staging buffer, got one on {buffer.device}; using 'aio'"
        )
        io_engine = ctx.io_engine("aio", directory)
        buffer = ctx.staging_buffer("cpu", pinned=not isinstance(io_engine, PythonEngine), nbytes=nbytes)
    split_halves(buffer)  # refuse a too-small buffer before any work
    return io_engine, buffer


def write_archive(obj: Any, put: Callable[[bytes | torch.Tensor | torch.UntypedStorage], None], position: Callable[[], int],
                  protocol: int = _torch_compat.DEFAULT_PROTOCOL, *, alignment: int = ALIGNMENT_BYTES,
                  base: int = 0, in_place_from: int = 0) -> int:
    """Put ``obj``'s torch.save archive, as fastpersist writes it, through ``put`` (``position``: the
    offset of the next byte put, relative to the archive's start, which is at ``base`` in the file;
    storages start on ``alignment`` boundaries of the file, or, from ``in_place_from`` bytes, where
    their memory can be written from in place: see :class:`ArchiveWriter`); returns the number of
    storages."""
    archive = ArchiveWriter(put, position, alignment=alignment, base=base, in_place_from=in_place_from)
    pickled = _torch_compat.dump_pickle(obj, protocol, archive.add_storage)
    archive.add_bytes("data.pkl", pickled)
    for name, data in _torch_compat.archive_records():
        archive.add_bytes(name, data)
    archive.add_bytes(".data/serialization_id", new_serialization_id())
    archive.finish()
    return archive.num_storages


def _write(
    content: Callable[[DoubleBuffer], int],
    io_engine: IOEngine,
    file: OpenFile,
    buffer: torch.Tensor,
    in_place: PythonEngine | None = None,
) -> tuple[int, int, int]:
    """Stream what ``content`` puts through the double buffer; returns (size, storages, writes).

    With ``in_place``, large host tensors' aligned pages are written by it straight from their memory.
    """
    writes = 0

    def submit(engine: IOEngine, chunk: torch.Tensor, offset: int) -> None:
        nonlocal writes
        nbytes = chunk.numel()
        _reserve_ahead(file, offset + nbytes)
        if offset + nbytes > file.reserved and isinstance(engine, AioEngine):
            _check_free_space(file, offset, nbytes)
        engine.submit(Transfer(file, chunk, offset, write=True))
        writes += 1

    def drain(chunk: torch.Tensor, offset: int, ends_half: bool) -> None:
        if stage.has_device_copies:
            torch.cuda.synchronize()  # non-blocking device-to-host copies must land before the write
            stage.has_device_copies = False
        if ends_half:
            io_engine.wait()  # the other half's writes are done: it may be refilled after this submit
        if chunk.numel():
            submit(io_engine, chunk, offset)

    write_in_place = None if in_place is None else lambda view, offset: submit(in_place, view, offset)
    stage = DoubleBuffer(buffer, drain, write_in_place)
    try:
        num_storages = content(stage)
        size = stage.position
        stage.flush(ALIGNMENT_BYTES if file.direct else 1)
    finally:
        # ``drain`` and the stage refer to each other: break the cycle, so that the engine (an aio
        # handle, whose kernel contexts take a grace period each to destroy) goes when its context
        # closes it, not at a garbage collection in the middle of training.
        stage.close()
    io_engine.wait()
    if in_place is not None:
        in_place.wait()
    if file.size() != size:
        os.ftruncate(file.fd, size)  # drop the tail's alignment padding and unused reserved space
    if file.size() != size:
        raise io_error(errno.EIO, "write", file, file.size(), f"file is {file.size()} bytes, expected {size}")
    return size, num_storages, writes


def _reserve_ahead(file: OpenFile, end: int) -> None:
    """Reserve blocks past ``end`` in growing steps; near a full disk, exactly up to ``end``."""
    if end <= file.reserved or not file.can_reserve:
        return
    step = min(max(file.reserved, RESERVE_STEP_MIN), RESERVE_STEP_MAX)
    try:
        reserve(file, round_up(end + step))
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        reserve(file, end)


def _check_free_space(file: OpenFile, offset: int, nbytes: int) -> None:
    """Refuse a write the filesystem has no room for: DeepSpeed's aio may never complete one."""
    fs = os.statvfs(os.path.dirname(file.path))
    free = fs.f_bavail * fs.f_frsize
    if free < nbytes:
        raise io_error(
            errno.ENOSPC,
            "write",
            file,
            offset,
            f"no space left on device ({free} bytes free, {nbytes} needed)",
        )


def _check_target(file_path: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(file_path))
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT, f"checkpoint directory does not exist (saving {path})", directory
        )
    return path


def _temp_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def _create_temporary(path: str) -> tuple[str, OpenFile]:
    """A new, locked temporary file next to ``path`` with the mode ``path`` will have.

    Where the filesystem has unnamed files (``O_TMPFILE``: ext4, xfs, btrfs, tmpfs), the file is
    locked before it gets its name, so a clean-up in another process (another rank saving into the
    same directory) never meets it unlocked, and a writer killed before naming it leaves nothing.
    Elsewhere it is created under its name and locked at once; a clean-up that takes it in between
    removes it, and a new one is made.
    """
    directory = os.path.dirname(path)
    mode = _mode_to_keep(path)
    for _ in range(_CREATE_ATTEMPTS):
        temp = _temp_name(path)
        try:
            file = _named_after_locking(temp, directory, FILE_MODE if mode is None else mode)
            named_first = file is None
            if named_first:
                file = open_file(temp, write=True, mode=FILE_MODE if mode is None else mode)
        except OSError as err:
            raise type(err)(
                err.errno, f"cannot create a file in {directory} to save {path}: {err.strerror}", directory
            ) from err
        file.label, file.target = f"{path} (temporary {os.path.basename(temp)})", path
        if named_first:
            try:
                locked = _lock(file)
            except BaseException:
                file.close()
                _unlink_quietly(temp)
                raise
            # Not locked, or unlinked before we locked it: a concurrent clean-up took it for a dead
            # writer's, and removes it (or has).
            if not locked or os.fstat(file.fd).st_nlink == 0:
                file.close()
                continue
        if mode is not None:
            os.fchmod(file.fd, mode)  # exactly the old file's bits, whatever the umask
        return temp, file
    raise OSError(errno.EAGAIN, f"could not create a temporary file in {directory} to save {path}", directory)


def _named_after_locking(temp: str, directory: str, mode: int) -> OpenFile | None:
    """An unnamed file, locked, then linked in as ``temp``; ``None`` where that cannot be done."""
    file = open_unnamed(directory, mode)
    if file is None:
        return None
    try:
        _lock(file)
        if link_unnamed(file, temp):
            return file
    except BaseException:
        file.close()
        raise
    file.close()
    return None


def _lock(file: OpenFile) -> bool:
    """Take the writer's exclusive lock on ``file``: ``False`` where another process holds it;
    ``True`` too on filesystems without ``flock`` (their temporaries are never cleaned up)."""
    try:
        fcntl.flock(file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
            raise
    return True


def _mode_to_keep(path: str) -> int | None:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporaries of dead fastpersist writers in ``directory``; returns the removed paths.

    A writer holds an exclusive ``flock`` on its temporary for the whole save and the kernel drops it
    when the process dies, so a temporary whose lock can be taken has no live writer. Temporaries on
    filesystems without ``flock`` are left alone.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX)):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(entry.path).st_ino:
                continue
            os.unlink(entry.path)
            removed.append(entry.path)
        except OSError:  # locked by a live writer, already gone, or no flock here
            continue
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d temporary file(s) left in %s by dead writers", len(removed), directory)
    return removed


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_dir(directory: str) -> None:
    """Flush ``directory``'s entries (a rename or a new file in it) to stable storage."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
