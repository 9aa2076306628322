"""The staging buffer split into two aligned halves: one is filled while the other's I/O is in flight."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastpersist.handles import ALIGNMENT_BYTES
from fastpersist.image import Fill, Run

Segment = Run | torch.Tensor
SMALL_COPY_BYTES = 256 * 1024  # below this a memoryview copy beats a torch copy_ call


def flat_bytes(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` as a flat uint8 tensor sharing its memory."""
    if not buffer.is_contiguous():
        raise ValueError("pinned buffer must be contiguous")
    return buffer.reshape(-1).view(torch.uint8)


def split_halves(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two equal halves of ``buffer``, each starting on and sized in multiples of ``ALIGNMENT_BYTES``.

    Raises:
        ValueError: the buffer cannot hold two aligned halves of at least one alignment unit each.
    """
    flat = flat_bytes(buffer)
    skip = -flat.data_ptr() % ALIGNMENT_BYTES
    half = max(0, flat.numel() - skip) // 2 // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    if half == 0:
        raise ValueError(
            f"pinned buffer of {flat.numel()} bytes is too small: it must hold two "
            f"{ALIGNMENT_BYTES}-byte aligned halves (O_DIRECT alignment); use get_pinned_buffer()"
        )
    return flat.narrow(0, skip, half), flat.narrow(0, skip + half, half)


def segment_length(segment: Segment) -> int:
    return segment.numel() if isinstance(segment, torch.Tensor) else len(segment)


class DoubleBuffer:
    """Write-side staging: ``put`` appends bytes to the current half and calls ``drain`` when it is full.

    ``drain(nbytes)`` must submit ``current[:nbytes]`` for ``file_offset`` and then call :meth:`swap`.
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        self.halves = split_halves(buffer)
        self.capacity = self.halves[0].numel()
        self.index = 0
        self.filled = 0
        self.file_offset = 0
        self.has_device_copies = False  # non-blocking copies to or from a GPU are pending
        on_cpu = self.halves[0].device.type == "cpu"
        self._views = [memoryview(half.numpy()) if on_cpu else None for half in self.halves]

    @property
    def current(self) -> torch.Tensor:
        return self.halves[self.index]

    def swap(self, nbytes: int) -> None:
        """The current half was submitted: advance the file offset and fill the other half."""
        self.file_offset += nbytes
        self.index ^= 1
        self.filled = 0

    def put(self, segment: Segment, drain: Callable[[int], None]) -> None:
        length = segment_length(segment)
        done = 0
        while done < length:
            count = min(self.capacity - self.filled, length - done)
            self._copy(segment, done, count)
            self.filled += count
            done += count
            if self.filled == self.capacity:
                drain(self.capacity)

    def _copy(self, segment: Segment, start: int, count: int) -> None:
        view = self._views[self.index]
        if (
            view is not None
            and count <= SMALL_COPY_BYTES
            and not (isinstance(segment, torch.Tensor) and segment.is_cuda)
        ):
            # Small pieces (record headers, padding, small tensors) by memoryview: no torch op per piece.
            if isinstance(segment, torch.Tensor):
                source: Any = memoryview(segment.numpy())[start : start + count]
            elif isinstance(segment, Fill):
                source = bytes((segment.value,)) * count
            else:
                source = memoryview(segment)[start : start + count]
            view[self.filled : self.filled + count] = source
            return
        target = self.current.narrow(0, self.filled, count)
        if isinstance(segment, torch.Tensor):
            device_copy = segment.is_cuda or target.is_cuda
            # Straight into the pinned half (device-to-host DMA for GPU tensors): no whole-tensor .cpu().
            target.copy_(segment.narrow(0, start, count), non_blocking=device_copy)
            self.has_device_copies |= device_copy
        elif isinstance(segment, Fill):
            target.fill_(segment.value)
        else:
            target.copy_(torch.frombuffer(segment[start : start + count], dtype=torch.uint8))
