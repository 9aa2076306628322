"""Host memory for FastPersist: O_DIRECT alignment, page-locked staging buffers, page-aligned load buffers."""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

import torch

from fastpersist import _deepspeed_compat

log = logging.getLogger(__name__)

MiB = 1024**2
PAGE_BYTES = os.sysconf("SC_PAGESIZE")
# O_DIRECT offsets, lengths and buffer addresses are multiples of this (covers 512 B and 4 KiB devices).
ALIGNMENT_BYTES = 4096
_CAP_IPC_LOCK_BIT = 14


def round_up(num_bytes: int, multiple: int = ALIGNMENT_BYTES) -> int:
    """``num_bytes`` rounded up to a multiple of ``multiple``."""
    return -(-num_bytes // multiple) * multiple


def round_down(num_bytes: int, multiple: int = ALIGNMENT_BYTES) -> int:
    """``num_bytes`` rounded down to a multiple of ``multiple``."""
    return num_bytes // multiple * multiple


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


def aligned_empty(num_bytes: int, alignment: int = PAGE_BYTES) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor whose first byte sits on an ``alignment`` boundary."""
    raw = torch.empty(num_bytes + alignment, dtype=torch.uint8)
    skip = -raw.data_ptr() % alignment
    return raw.narrow(0, skip, num_bytes)


def get_pinned_buffer(size_mb: float = 256, aio_handle: Any = None) -> torch.Tensor:
    """Page-aligned, page-locked host memory of ``size_mb`` MiB as a flat uint8 tensor.

    Uses ``pin_memory()`` where CUDA is present, else ``aio_handle.new_cpu_locked_tensor`` (free it with
    :func:`release_pinned_buffer`). Where neither is possible, page-aligned unlocked memory is returned
    with a warning (the python engine can use it; the aio engine then falls back to python).

    Args:
        size_mb: size in MiB.
        aio_handle: the DeepSpeed aio handle that will write from the buffer (CPU-only machines).

    Raises:
        ValueError: ``size_mb`` is not positive.
    """
    if size_mb <= 0:
        raise ValueError(f"pinned buffer size must be positive, got {size_mb} MiB")
    num_bytes = int(size_mb * MiB)
    if torch.cuda.is_available():
        return torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    if aio_handle is not None and can_lock_memory(num_bytes):
        return aio_handle.new_cpu_locked_tensor(num_bytes, torch.empty(0, dtype=torch.uint8))
    log.warning("cannot page-lock %d bytes here; using unlocked page-aligned memory", num_bytes)
    return aligned_empty(num_bytes)


def release_pinned_buffer(buffer: torch.Tensor, aio_handle: Any = None) -> None:
    """Give back memory locked by ``aio_handle``'s pinned-tensor manager (a no-op for other memory)."""
    if aio_handle is None or buffer.device.type != "cpu" or torch.cuda.is_available():
        return
    if _deepspeed_compat.handle_is_pinned(aio_handle, buffer):
        aio_handle.free_cpu_locked_tensor(buffer)

