"""A read-only, seekable file over bytes already in memory, for readers that want a file object
(``torch.load``, ``torch._C.PyTorchFileReader``) without copying the bytes into a ``BytesIO`` first."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["MemoryFile"]


class MemoryFile(io.RawIOBase):
    """A seekable read-only file over a buffer, read with ``readinto`` (no copy besides the caller's).

    Args:
        buffer: any contiguous buffer (``bytes``, ``bytearray``, ``memoryview``, ``mmap``); it is
            read in place, as bytes, and released by :meth:`close`.
    """

    def __init__(self, buffer: Any) -> None:
        super().__init__()
        self._view = memoryview(buffer).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, target: Any) -> int:
        start = min(self._pos, len(self._view))
        end = min(start + memoryview(target).nbytes, len(self._view))
        memoryview(target).cast("B")[: end - start] = self._view[start:end]
        self._pos = end
        return end - start

    def close(self) -> None:
        """Release the buffer (its owner may then close or resize it)."""
        if not self.closed:
            self._view.release()
        super().close()
