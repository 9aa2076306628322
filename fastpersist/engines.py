"""I/O engines behind one interface: DeepSpeed aio, plain Python (O_DIRECT + pwritev threads), GDS.

An engine moves whole aligned buffers between a staging tensor and a file offset, asynchronously:
``submit`` queues a transfer, ``wait`` completes every queued one and checks that each moved all of
its bytes, raising :class:`OSError` with the path and offset when one did not. DeepSpeed's aio does not
check completion results itself, so the aio engine checks the file's size after every write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import torch

from fastpersist.handles import ALIGNMENT_BYTES, MiB, aio_op, exclusive, get_default_aio_handle, libc

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
    preallocated: bool = False  # its blocks were reserved up front (see ``preallocate``)

    def __post_init__(self) -> None:
        self.label = self.label or self.path

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


def open_file(path: str, write: bool) -> OpenFile:
    """Open ``path`` with O_DIRECT; where the filesystem refuses it (tmpfs), open buffered and warn.

    A file opened for writing is created exclusively: it is always a fresh temporary name.
    """
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
    flags |= getattr(os, "O_CLOEXEC", 0)
    try:
        return OpenFile(path, os.open(path, flags | os.O_DIRECT, FILE_MODE), True)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
    log.warning("%s: filesystem refuses O_DIRECT; using buffered I/O", path)
    return OpenFile(path, os.open(path, flags, FILE_MODE), False)


def io_error(code: int, what: str, file: OpenFile, offset: int, detail: str) -> OSError:
    """An OSError that names the operation, the path and the byte offset."""
    return OSError(code, f"{what} failed at offset {offset} of {file.label}: {detail}", file.path)


def _is_disk_full(path: str, wanted: int) -> bool:
    """Whether the filesystem holding ``path`` has less than ``wanted`` bytes free."""
    try:
        fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize < wanted


class IOEngine(ABC):
    """Moves aligned staging buffers to and from files; one instance serves one save or load."""

    name: ClassVar[str]
    device: ClassVar[str] = "cpu"  # where its staging buffer must live

    def __init__(self) -> None:
        self._queued: list[Transfer] = []

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """Why this engine cannot run here, or ``None`` when it can."""

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        """Why this engine cannot move ``buffer`` to ``file``, or ``None`` when it can."""
        return None

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """Held for a whole save or load: engines whose handle is shared make other users wait."""
        return contextlib.nullcontext()

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


@cache
def _python_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=PY_IO_THREADS, thread_name_prefix="fastpersist-io")


def _move(transfer: Transfer, start: int, length: int) -> None:
    """Move ``length`` bytes of the transfer from byte ``start`` with pwritev/preadv, retrying partials."""
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
    """O_DIRECT + ``os.pwritev``/``os.preadv`` from a small shared thread pool (no compiled op needed)."""

    name = "python"

    def __init__(self) -> None:
        super().__init__()
        self._futures: list[Future[None]] = []

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if hasattr(os, "pwritev") else "os.pwritev is unavailable on this platform"

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        return None if buffer.device.type == "cpu" else f"staging buffer is on {buffer.device}"

    def _start(self, transfer: Transfer) -> None:
        pool = _python_pool()
        total = transfer.buffer.numel()
        for start in range(0, total, PY_CHUNK_BYTES):
            length = min(PY_CHUNK_BYTES, total - start)
            self._futures.append(pool.submit(_move, transfer, start, length))

    def _finish(self, queued: list[Transfer]) -> None:
        futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


class AioEngine(IOEngine):
    """DeepSpeed's libaio handle: parallel, deep-queue O_DIRECT transfers from page-locked memory."""

    name = "aio"

    def __init__(self, handle: Any = None) -> None:
        super().__init__()
        self.handle = handle if handle is not None else get_default_aio_handle()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if aio_op() is not None else "DeepSpeed async_io op cannot be loaded"

    def session(self) -> contextlib.AbstractContextManager[Any]:
        # wait() completes every request on the handle, so two users of one handle must take turns.
        return exclusive(("aio-handle", id(self.handle)))

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        if not file.direct:
            return f"{file.path} is not open with O_DIRECT"
        if buffer.device.type != "cpu" or not self.handle.is_pinned(buffer):
            # DeepSpeed would allocate a locked bounce buffer per request (and abort if mlock fails).
            return "staging buffer is not page-locked host memory"
        return None

    def _start(self, transfer: Transfer) -> None:
        if transfer.write:
            status = self.handle.async_pwrite(transfer.buffer, transfer.file.fd, transfer.offset)
        else:
            # DeepSpeed asserts (aborts) when a read runs past the end of the file: refuse it here.
            end = transfer.offset + transfer.buffer.numel()
            if end > transfer.file.size():
                raise io_error(errno.EINVAL, "read", transfer.file, transfer.offset, "past end of file")
            status = self.handle.async_pread(transfer.buffer, transfer.file.path, transfer.offset)
        if status != 0:
            self._queued.pop()
            what = "write" if transfer.write else "read"
            raise io_error(errno.EIO, what, transfer.file, transfer.offset, f"aio submit returned {status}")

    def _finish(self, queued: list[Transfer]) -> None:
        completed = self.handle.wait()
        if completed != len(queued):
            raise io_error(
                errno.EIO, "aio", queued[0].file, queued[0].offset, f"{completed} of {len(queued)} completed"
            )
        for transfer in queued:
            if transfer.write:
                verify_write(transfer)


def verify_write(transfer: Transfer) -> None:
    """Check that a completed write put down all its bytes (DeepSpeed's aio reports no byte counts).

    In a preallocated file the written range must hold no hole (unwritten extents read as holes until a
    write lands); otherwise the file, written sequentially, must have grown to the write's end.

    Raises:
        OSError: ENOSPC when the filesystem is full, else EIO; the message names the path and offset.
    """
    file, expect = transfer.file, transfer.buffer.numel()
    end = transfer.offset + expect
    landed_end = os.lseek(file.fd, transfer.offset, os.SEEK_HOLE) if file.preallocated else file.size()
    if landed_end < end:
        landed = max(0, landed_end - transfer.offset)
        code = errno.ENOSPC if _is_disk_full(file.path, expect - landed) else errno.EIO
        detail = f"short write, {landed} of {expect} bytes ({os.strerror(code)})"
        raise io_error(code, "write", file, transfer.offset + landed, detail)


def preallocate(file: OpenFile, size: int) -> None:
    """Reserve ``size`` bytes for ``file`` where the filesystem has unwritten extents (ext4, xfs, btrfs).

    Why: O_DIRECT writes past the end of file are synchronous on ext4/xfs, which serialises the aio
    queue; inside a preallocated file they run in parallel. Completed writes stay verifiable there
    because unwritten ranges read as holes (``SEEK_HOLE``). Where that does not hold, nothing is reserved.

    Raises:
        OSError: ENOSPC (or another error) from fallocate, naming the path.
    """
    try:
        status = libc().fallocate(file.fd, 0, ctypes.c_int64(0), ctypes.c_int64(size))
    except (OSError, AttributeError):  # no libc fallocate here
        return
    if status != 0:
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise io_error(code, "preallocate", file, 0, f"{os.strerror(code)} ({size} bytes)")
    if os.lseek(file.fd, 0, os.SEEK_HOLE) != 0:  # reserved space reads as data: holes cannot verify writes
        os.ftruncate(file.fd, 0)
        return
    file.preallocated = True


class GdsEngine(AioEngine):
    """NVIDIA GPUDirect Storage through DeepSpeed's ``gds`` op: staging buffer in GPU memory."""

    name = "gds"
    device = "cuda"

    def __init__(self, handle: Any = None) -> None:
        IOEngine.__init__(self)
        self.handle = handle if handle is not None else _default_gds_handle()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None if _gds_op() is not None else "DeepSpeed gds op cannot be loaded"

    def accepts(self, buffer: torch.Tensor, file: OpenFile) -> str | None:
        if not file.direct:
            return f"{file.path} is not open with O_DIRECT"
        return None if buffer.is_cuda else "staging buffer is not in GPU memory"

    def _start(self, transfer: Transfer) -> None:
        torch.cuda.current_stream(transfer.buffer.device).synchronize()  # staged copies must land first
        if transfer.write:
            status = self.handle.async_pwrite(transfer.buffer, transfer.file.path, transfer.offset)
            if status != 0:
                self._queued.pop()
                raise io_error(
                    errno.EIO, "write", transfer.file, transfer.offset, f"gds submit returned {status}"
                )
        else:
            super()._start(transfer)


@cache
def _gds_op() -> Any | None:
    try:
        from deepspeed.ops.op_builder import GDSBuilder

        builder = GDSBuilder()
        return builder.load(verbose=False) if builder.is_compatible(verbose=False) else None
    except Exception as err:  # a failed JIT build raises many kinds of errors
        log.warning("DeepSpeed gds op unavailable: %s", err)
        return None


@cache
def _default_gds_handle() -> Any:
    op = _gds_op()
    if op is None:
        raise RuntimeError("DeepSpeed gds op is unavailable")
    return op.gds_handle(MiB, 128, False, True, 1)


ENGINES: dict[str, type[IOEngine]] = {"aio": AioEngine, "python": PythonEngine, "gds": GdsEngine}
FALLBACK: dict[str, str] = {"gds": "aio", "aio": "python"}
DEFAULT_ENGINE = "aio"


def create_engine(name: str | None = None, aio_handle: Any = None) -> IOEngine:
    """The engine called ``name`` (``None`` or ``"auto"``: aio), falling back with a warning.

    Raises:
        ValueError: unknown engine name.
    """
    wanted = DEFAULT_ENGINE if name in (None, "auto") else name
    if wanted not in ENGINES:
        raise ValueError(f"unknown fastpersist engine {name!r}; choose from {sorted(ENGINES)}")
    current = wanted
    while (reason := ENGINES[current].unavailable_reason()) is not None:
        fallback = FALLBACK[current]
        log.warning("fastpersist engine %r unavailable (%s); falling back to %r", current, reason, fallback)
        current = fallback
    if current == "aio":
        return AioEngine(aio_handle)
    return ENGINES[current]()


def engine_for(engine: IOEngine, buffer: torch.Tensor, file: OpenFile) -> IOEngine:
    """``engine`` if it can move ``buffer`` to ``file``, else the Python engine (with a warning)."""
    reason = engine.accepts(buffer, file)
    if reason is None:
        return engine
    log.warning("fastpersist engine %r cannot be used (%s); falling back to 'python'", engine.name, reason)
    return PythonEngine()
