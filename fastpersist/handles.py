"""DeepSpeed aio handles and page-aligned pinned host buffers, with shared process-wide defaults."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import threading
from functools import cache
from typing import Any

import torch

log = logging.getLogger(__name__)

MiB = 1024**2
PAGE_BYTES = os.sysconf("SC_PAGESIZE")
# O_DIRECT offsets, lengths and buffer addresses are multiples of this (covers 512 B and 4 KiB devices).
ALIGNMENT_BYTES = 4096

HUGE_PAGE_BYTES = 2 * MiB
MADV_HUGEPAGE = 14  # <sys/mman.h>
DEFAULT_BLOCK_BYTES = 1 * MiB
DEFAULT_QUEUE_DEPTH = 128
DEFAULT_BUFFER_MB = 256

_CAP_IPC_LOCK_BIT = 14
_defaults_lock = threading.RLock()
_default_handle: Any = None
_default_buffer: torch.Tensor | None = None


_exclusive_locks: dict[Any, threading.RLock] = {}


def exclusive(key: Any) -> threading.RLock:
    """A process-wide lock for ``key`` (a shared handle or staging buffer used by one save at a time)."""
    with _defaults_lock:
        return _exclusive_locks.setdefault(key, threading.RLock())


@cache
def aio_op() -> Any | None:
    """DeepSpeed's ``async_io`` op module, or ``None`` where it cannot be built or loaded (logged)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            log.warning("DeepSpeed async_io op is not compatible here (libaio missing?)")
            return None
        return builder.load(verbose=False)
    except Exception as err:  # a failed JIT build raises many kinds of errors
        log.warning("DeepSpeed async_io op unavailable: %s", err)
        return None


def get_aio_handle(
    block_size: int = DEFAULT_BLOCK_BYTES,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    single_submit: bool = False,
    overlap_events: bool = True,
    intra_op_parallelism: int = 1,
) -> Any:
    """A new DeepSpeed aio handle.

    Arguments mirror DeepSpeed's and are passed positionally (their keyword names changed across versions).

    Raises:
        RuntimeError: DeepSpeed's ``async_io`` op cannot be loaded.
    """
    op = aio_op()
    if op is None:
        raise RuntimeError("DeepSpeed async_io op is unavailable; install libaio-dev and rebuild it")
    return op.aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)


def can_lock_memory(num_bytes: int) -> bool:
    """Whether this process may page-lock ``num_bytes`` more (CAP_IPC_LOCK or a large RLIMIT_MEMLOCK).

    DeepSpeed aborts the process when mlock fails, so this is checked before asking it for locked memory.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:") and int(line.split()[1], 16) >> _CAP_IPC_LOCK_BIT & 1:
                    return True
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY or soft >= num_bytes


def get_pinned_buffer(size_mb: int = DEFAULT_BUFFER_MB, aio_handle: Any = None) -> torch.Tensor:
    """Page-aligned, page-locked host memory of ``size_mb`` MiB as a flat uint8 tensor.

    Uses ``pin_memory()`` where CUDA is present, else the aio handle's ``new_cpu_locked_tensor``. Where
    neither is possible, page-aligned unlocked memory is returned with a warning (the plain-Python
    engine can use it; the aio engine cannot).

    Raises:
        ValueError: ``size_mb`` is not positive.
    """
    if size_mb <= 0:
        raise ValueError(f"pinned buffer size must be positive, got {size_mb} MiB")
    num_bytes = int(size_mb * MiB)
    if torch.cuda.is_available():
        return torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    if can_lock_memory(num_bytes) and aio_op() is not None:
        handle = aio_handle if aio_handle is not None else get_default_aio_handle()
        return handle.new_cpu_locked_tensor(num_bytes, torch.empty(0, dtype=torch.uint8))
    log.warning("cannot page-lock %d bytes here; using unlocked page-aligned memory", num_bytes)
    return aligned_empty(num_bytes)


def aligned_empty(num_bytes: int, alignment: int = PAGE_BYTES) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor whose first byte sits on an ``alignment`` boundary."""
    raw = torch.empty(num_bytes + alignment, dtype=torch.uint8)
    skip = -raw.data_ptr() % alignment
    return raw.narrow(0, skip, num_bytes)


def huge_page_empty(num_bytes: int) -> torch.Tensor:
    """Uninitialised host memory for loaded tensors, advised for transparent huge pages.

    Why: filling fresh memory costs a page fault per 4 KiB page; with 2 MiB pages a 1 GiB load takes
    512 faults instead of 262,144, which on a small machine is a large part of the load time.
    """
    tensor = aligned_empty(num_bytes, HUGE_PAGE_BYTES)
    if num_bytes >= HUGE_PAGE_BYTES:
        try:
            libc().madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(num_bytes), MADV_HUGEPAGE)
        except (OSError, AttributeError):  # no libc madvise: ordinary pages
            pass
    return tensor


@cache
def libc() -> ctypes.CDLL:
    """The C library, for calls Python's os module lacks (fallocate, madvise)."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return lib


def release_pinned_buffer(buffer: torch.Tensor, aio_handle: Any = None) -> None:
    """Give back memory locked by DeepSpeed's pinned-tensor manager (a no-op for other tensors)."""
    if buffer is _default_buffer or buffer.is_cuda or aio_op() is None:
        return
    handle = aio_handle if aio_handle is not None else get_default_aio_handle()
    handle.free_cpu_locked_tensor(buffer)


def get_default_aio_handle() -> Any:
    """The process-wide aio handle, created on first use."""
    global _default_handle
    with _defaults_lock:
        if _default_handle is None:
            _default_handle = get_aio_handle()
        return _default_handle


def get_default_pinned_buffer() -> torch.Tensor:
    """The process-wide pinned buffer (``DEFAULT_BUFFER_MB``), created on first use."""
    global _default_buffer
    with _defaults_lock:
        if _default_buffer is None:
            _default_buffer = get_pinned_buffer(DEFAULT_BUFFER_MB, _default_handle)
        return _default_buffer
