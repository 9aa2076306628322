"""I/O engines behind one interface: DeepSpeed aio, plain Python (O_DIRECT + pwritev threads), GDS.

An engine moves whole aligned buffers between a staging tensor and a file offset, asynchronously:
``submit`` queues a transfer, ``wait`` completes every queued one and checks that each moved all of
its bytes, raising :class:`OSError` with the path and offset when one did not. DeepSpeed's aio does not
report byte counts, so the aio engine checks the file itself after every write (see ``verify_write``).

Engines hold no process-wide state: handles and thread pools come from the
:class:`~fastpersist.context.FastPersistContext` that creates them.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fastpersist import _deepspeed_compat, _libc
from fastpersist.memory import ALIGNMENT_BYTES, MiB

log = logging.getLogger(__name__)

PY_IO_THREADS = 4
PY_CHUNK_BYTES = 16 * MiB  # one pwritev/preadv per chunk, spread over the thread pool
FILE_MODE = 0o666  # before umask, as open(path, "wb") would create it


@dataclass
class OpenFile:
    """A file descriptor with the path it names (for error messages) and whether it bypasses the cache."""

    path: str
    fd: int
    direct: bool
    label: str = ""  # how errors name the file (a temporary file names its destination); default: path
    target: str = ""  # the path errors report as ``filename`` (a temporary file's destination); default: path
    reserved: int = 0  # bytes reserved with fallocate (see ``reserve``); unwritten ranges read as holes
    can_reserve: bool = True

    def __post_init__(self) -> None:
        self.label = self.label or self.path
        self.target = self.target or self.path

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Transfer:
    """One queued transfer: ``buffer`` to (write) or from (read) ``file`` at ``offset``."""

    file: OpenFile
    buffer: torch.Tensor
    offset: int
    write: bool
    # A read into memory never touched yet: the python engine faults it in from one thread, ahead of
    # the reads (see ``PythonEngine._start``).
    fresh: bool = False


def open_file(path: str, write: bool, mode: int = FILE_MODE) -> OpenFile:
    """Open ``path`` with O_DIRECT; where the filesystem refuses it (tmpfs), open buffered and warn.

    A file opened for writing is created exclusively: it is always a fresh temporary name.
    """
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
    return _open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)


def open_unnamed(directory: str, mode: int = FILE_MODE) -> OpenFile | None:
    """A new file in ``directory`` that has no name yet (``O_TMPFILE``), open for writing as
    :func:`open_file` opens one; ``None`` where the kernel or the filesystem cannot make one.

    Give it a name with :func:`link_unnamed`. Until then no other process can see it, and if this
    process dies, the kernel frees it.
    """
    if not hasattr(os, "O_TMPFILE"):
        return None
    try:
        return _open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, mode)
    except OSError as err:
        # EOPNOTSUPP: this filesystem has no unnamed files (NFS, many parallel filesystems); EISDIR
        # or EINVAL: a kernel without O_TMPFILE.
        if err.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        raise


def link_unnamed(file: OpenFile, path: str) -> bool:
    """Give a file from :func:`open_unnamed` the name ``path`` (which must not exist); ``False``
    where that cannot be done here (no ``/proc``), and the file is left as it was.

    Raises:
        OSError: ``path`` exists, or the directory refuses the new name.
    """
    try:
        descriptors = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        # linkat(AT_SYMLINK_FOLLOW) through /proc/self/fd: the unprivileged way to name an O_TMPFILE
        # file (os.link calls linkat, not link, only when given a directory descriptor)
        os.link(str(file.fd), path, src_dir_fd=descriptors, follow_symlinks=True)
    finally:
        os.close(descriptors)
    file.path = file.label = file.target = path
    return True


def _open(path: str, flags: int, mode: int) -> OpenFile:
    try:
        return OpenFile(path, os.open(path, flags | os.O_DIRECT, mode), True)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
    fd = os.open(path, flags, mode)  # where the EINVAL was not O_DIRECT's, this raises it again
    log.warning("%s: filesystem refuses O_DIRECT; using buffered I/O", path)
    return OpenFile(path, fd, False)


def io_error(code: int, what: str, file: OpenFile, offset: int, detail: str) -> OSError:
    """An OSError that names the operation, the path and the byte offset."""
    return OSError(code, f"{what} failed at offset {offset} of {file.label}: {detail}", file.target)


def _is_disk_full(path: str, wanted: int) -> bool:
    try:
        fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize < wanted


def reserve(file: OpenFile, end: int) -> None:
    """Reserve the file's blocks up to ``end`` where the filesystem has unwritten extents (ext4, xfs).

    Why: O_DIRECT writes past the end of file are synchronous on ext4/xfs, which serialises the aio
    queue; inside reserved space they run in parallel. Completed writes stay verifiable there because
    unwritten ranges read as holes (``SEEK_HOLE``). Where that does not hold, nothing is reserved.

    Raises:
        OSError: ENOSPC when the filesystem cannot hold ``end`` bytes, naming the path.
    """
    if not file.can_reserve or end <= file.reserved:
        return
    start = file.reserved
    code = _libc.fallocate(file.fd, start, end - start)
    if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        file.can_reserve = False
        return
    if code:
        detail = f"{os.strerror(code)} (reserving {end} bytes)"
        if code == errno.ENOSPC:
            detail = f"no space left on device for {end} bytes"
        raise io_error(code, "reserve", file, start, detail)
    if start == 0 and os.lseek(file.fd, 0, os.SEEK_HOLE) != 0:
        # Reserved space reads as data here, so holes cannot prove that a write landed.
        os.ftruncate(file.fd, 0)
        file.can_reserve = False
        return
    file.reserved = end


def verify_write(transfer: Transfer) -> None:
    """Check that a completed write put down all its bytes (DeepSpeed's aio reports no byte counts).

    In reserved space the written range must hold no hole (unwritten extents read as holes until a
    write lands); otherwise the file, written sequentially, must have grown to the write's end.

    Raises:
        OSError: ENOSPC when the filesystem is full, else EIO; the message names the path and offset.
    """
    file, expect = transfer.file, transfer.buffer.numel()
    end = transfer.offset + expect
    if end <= file.reserved:
        landed_end = os.lseek(file.fd, transfer.offset, os.SEEK_HOLE)
    else:
        landed_end = file.size()
    if landed_end < end:
        landed = max(0, landed_end - transfer.offset)
        code = errno.ENOSPC if _is_disk_full(file.path, expect - landed) else errno.EIO
        detail = f"short write, {landed} of {expect} bytes ({os.strerror(code)})"
        raise io_error(code, "write", file, transfer.offset + landed, detail)


class IOEngine(ABC):
    """Moves aligned staging buffers to and from files; one instance serves one save or load."""

    name: ClassVar[str]
    device: ClassVar[str] = "cpu"  # where its staging buffer must live

    def __init__(self) -> None:
        self._queued: list[Transfer] = []

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        """Why this engine cannot move ``buffer`` to ``file``, or ``None`` when it can."""
        return None

    def submit(self, transfer: Transfer) -> None:
        """Queue one transfer (returns before it completes)."""
        if transfer.file.direct:
            _check_aligned(transfer)
        self._queued.append(transfer)
        self._start(transfer)

    def wait(self) -> None:
        """Complete every queued transfer and verify its byte count.

        Raises:
            OSError: a transfer failed or moved fewer bytes than asked (path and offset in the message).
        """
        queued, self._queued = self._queued, []
        if queued:
            self._finish(queued)

    def abandon(self) -> None:
        """Wait for queued transfers without checking them (after an error, before buffers are reused)."""
        try:
            self.wait()
        except OSError:
            pass

    @abstractmethod
    def _start(self, transfer: Transfer) -> None: ...

    @abstractmethod
    def _finish(self, queued: list[Transfer]) -> None: ...


def _check_aligned(transfer: Transfer) -> None:
    # DeepSpeed's aio aborts the process on a misaligned O_DIRECT submit, so refuse it here.
    for what, value in (
        ("offset", transfer.offset),
        ("length", transfer.buffer.numel()),
        ("address", transfer.buffer.data_ptr()),
    ):
        if value % ALIGNMENT_BYTES:
            raise ValueError(f"O_DIRECT {what} {value} is not a multiple of {ALIGNMENT_BYTES}")


def _populate(buffer: torch.Tensor, chunk: int, populated: list[threading.Event]) -> None:
    """Fault ``buffer`` in, ``chunk`` bytes at a time, setting each chunk's event once it is done (or
    at once for every chunk left when the kernel cannot: the reads then fault the pages themselves)."""
    try:
        for index, event in enumerate(populated):
            start = index * chunk
            length = min(chunk, buffer.numel() - start)
            if _libc.populate_write(buffer.data_ptr() + start, length) != 0:
                break
            event.set()
    finally:
        for event in populated:
            event.set()


def _move(transfer: Transfer, start: int, length: int, ready: threading.Event | None = None) -> None:
    """Move ``length`` bytes of the transfer from byte ``start`` with pwritev/preadv, retrying partials
    (once ``ready`` is set, when given)."""
    if ready is not None:
        ready.wait()
    view = memoryview(transfer.buffer.numpy())[start : start + length]
    what = "write" if transfer.write else "read"
    done = 0
    while done < length:
        offset = transfer.offset + start + done
        try:
            if transfer.write:
                moved = os.pwritev(transfer.file.fd, [view[done:]], offset)
            else:
                moved = os.preadv(transfer.file.fd, [view[done:]], offset)
        except OSError as err:
            raise io_error(
                err.errno or errno.EIO, what, transfer.file, offset, err.strerror or str(err)
            ) from err
        if moved <= 0:
            raise io_error(errno.EIO, what, transfer.file, offset, f"short {what}, {done} of {length} bytes")
        done += moved


class PythonEngine(IOEngine):
    """O_DIRECT + ``os.pwritev``/``os.preadv`` from a small thread pool (no compiled op needed)."""

    name = "python"

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._pool = pool
        self._futures: list[Future[None]] = []
        self._starts: list[int] = []  # file offset each future's chunk starts at
        self._landed = 0  # leading futures known to have completed without error
        self._landed_to = 0.0  # file offset before which every queued chunk has landed

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        return None if buffer.device.type == "cpu" else f"staging buffer is on {buffer.device}"

    def _start(self, transfer: Transfer) -> None:
        total = transfer.buffer.numel()
        chunks = range(0, total, PY_CHUNK_BYTES)
        populated: list[threading.Event | None] = [None] * len(chunks)
        if transfer.fresh and not transfer.write and len(chunks) > 1:
            # O_DIRECT reads fault their pages in themselves, several threads at once; on a small
            # (virtual) machine one thread populating ahead of them is faster. Measured on a 2-core
            # VM, 1 GiB read into fresh memory: 0.55 s, against 0.57-0.90 s.
            populated = [threading.Event() for _ in chunks]
            self._pool.submit(_populate, transfer.buffer, PY_CHUNK_BYTES, populated)
        for index, start in enumerate(chunks):
            length = min(PY_CHUNK_BYTES, total - start)
            self._futures.append(self._pool.submit(_move, transfer, start, length, populated[index]))
            self._starts.append(transfer.offset + start)
            self._landed_to = min(self._landed_to, transfer.offset + start)

    def wait_until(self, end: int) -> None:
        """Block until every queued chunk starting before file offset ``end`` has moved (one file,
        transfers submitted in offset order: reading a file front to back while using what landed).

        Raises:
            OSError: one of those chunks failed (as :meth:`wait` would raise it).
        """
        if end <= self._landed_to:
            return
        while self._landed < len(self._futures) and self._starts[self._landed] < end:
            self._futures[self._landed].result()
            self._landed += 1
        self._landed_to = self._starts[self._landed] if self._landed < len(self._starts) else math.inf

    def _finish(self, queued: list[Transfer]) -> None:
        futures, self._futures = self._futures, []
        self._starts, self._landed, self._landed_to = [], 0, 0.0
        errors = [future.exception() for future in futures]
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first


class AioEngine(IOEngine):
    """DeepSpeed's libaio handle: parallel, deep-queue O_DIRECT transfers from page-locked memory."""

    name = "aio"

    def __init__(self, handle: Any, locked_by_handle: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.handle = handle
        self._locked_by_handle = locked_by_handle  # addresses of buffers this handle page-locked
        self._move_here: list[Transfer] = []  # transfers this DeepSpeed cannot do, done with pwritev/preadv in wait()

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        if not file.direct:
            return f"{file.path} is not open with O_DIRECT"
        locked = buffer.device.type == "cpu" and buffer.data_ptr() in self._locked_by_handle
        if not locked and not _deepspeed_compat.handle_is_pinned(self.handle, buffer):
            # DeepSpeed would allocate a locked bounce buffer per request (and abort if mlock fails).
            return "staging buffer is not page-locked host memory"
        return None

    def _start(self, transfer: Transfer) -> None:
        file = transfer.file
        # DeepSpeed asserts (aborts) when a read runs past the end of the file: refuse it here.
        if not transfer.write and transfer.offset + transfer.buffer.numel() > file.size():
            raise io_error(errno.EINVAL, "read", file, transfer.offset, "past end of file")
        if not self._handle_takes(transfer):
            self._queued.pop()
            self._move_here.append(transfer)
            return
        if transfer.write:
            status = _deepspeed_compat.async_pwrite(
                self.handle, transfer.buffer, file.fd, file.path, transfer.offset
            )
        else:
            status = self.handle.async_pread(transfer.buffer, file.path, transfer.offset)
        if status != 0:
            self._queued.pop()
            what = "write" if transfer.write else "read"
            raise io_error(errno.EIO, what, file, transfer.offset, f"aio submit returned {status}")

    def _handle_takes(self, transfer: Transfer) -> bool:
        """Whether this DeepSpeed's handle can move ``transfer`` (else it is moved in :meth:`wait`)."""
        if _deepspeed_compat.partial_file_transfers(self.handle):
            return True
        return transfer.write and transfer.offset == 0 and transfer.buffer.numel() >= transfer.file.size()

    def wait(self) -> None:
        move_here, self._move_here = self._move_here, []
        for transfer in move_here:
            _move(transfer, 0, transfer.buffer.numel())
        super().wait()

    def _finish(self, queued: list[Transfer]) -> None:
        completed = self.handle.wait()
        if completed != len(queued):
            first = queued[0]
            detail = f"{completed} of {len(queued)} requests completed"
            raise io_error(errno.EIO, "aio", first.file, first.offset, detail)
        for transfer in queued:
            if transfer.write:
                verify_write(transfer)


class GdsEngine(AioEngine):
    """NVIDIA GPUDirect Storage through DeepSpeed's ``gds`` op: the staging buffer lives in GPU memory."""

    name = "gds"
    device = "cuda"

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        if not file.direct:
            return f"{file.path} is not open with O_DIRECT"
        return None if buffer.is_cuda else f"staging buffer is on {buffer.device}, not in GPU memory"

    def _start(self, transfer: Transfer) -> None:
        torch.cuda.current_stream(transfer.buffer.device).synchronize()  # staged copies must land first
        file = transfer.file
        if transfer.write:
            status = self.handle.async_pwrite(transfer.buffer, file.path, transfer.offset)
        else:
            status = self.handle.async_pread(transfer.buffer, file.path, transfer.offset)
        if status != 0:
            self._queued.pop()
            what = "write" if transfer.write else "read"
            raise io_error(errno.EIO, what, file, transfer.offset, f"gds submit returned {status}")


ENGINE_NAMES = ("aio", "python", "gds")
FALLBACK: dict[str, str] = {"gds": "aio", "aio": "python"}
DEFAULT_ENGINE = "aio"
