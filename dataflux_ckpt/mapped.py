"""Local files this package wrote, mapped into memory instead of read into it.

A mapping hands out the page cache's own pages: checksumming, uploading or loading a file that is
in the page cache then copies nothing (a read into new memory copies every byte once more, which on
a busy host costs as much as the transfer itself). Only files that are never changed in place are
mapped: the local tier's versions and shards, each written once under a name of its own. A file
truncated while it is mapped would kill the process (SIGBUS) on the next access past its new end.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

from dataflux_ckpt.checksums import crc32c_extend
from dataflux_ckpt.errors import DataCorruptionError

# Bytes checksummed (and read ahead) per call: large enough to amortize the call, small enough that
# a caller checking between blocks stops promptly.
MAP_BLOCK_BYTES = 8 * 2**20


def map_file(fd: int, size: int, what: str, *, private: bool = False) -> mmap.mmap:
    """The first ``size`` bytes (``size`` > 0) of the file open at ``fd``, mapped.

    Read-only and shared by default; with ``private``, writable and copy-on-write, so that tensors
    loaded as views of it can be changed without touching the file.

    Raises:
        DataCorruptionError: the file is shorter than ``size`` (``what`` names it).
        OSError: the file cannot be mapped.
    """
    if size <= 0:
        raise ValueError(f"{what}: only a non-empty file is mapped, not {size} bytes")
    actual = os.fstat(fd).st_size
    if actual < size:
        raise DataCorruptionError(f"{what}: the local file holds {actual} of its {size} bytes")
    if private:
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


def read_ahead(mapping: mmap.mmap, start: int, end: int) -> None:
    """Ask the kernel to start reading bytes ``start``-``end - 1`` of ``mapping`` from disk (a file
    not in the page cache is then read in large requests, not page fault by page fault)."""
    page = mmap.PAGESIZE
    first = start - start % page
    if end > first:
        mapping.madvise(mmap.MADV_WILLNEED, first, end - first)


def mapped_blocks(fd: int, size: int, what: str) -> Iterator[tuple[int, memoryview]]:
    """The first ``size`` bytes of the file open at ``fd``, mapped, as ``(offset, view)`` blocks of
    ``MAP_BLOCK_BYTES`` in order, the next block read ahead while the caller uses this one. A view is
    valid only until the next block is asked for (the file is unmapped once the walk ends, or once the
    caller stops it).

    Raises:
        DataCorruptionError: the file is shorter than ``size``.
        OSError: the file cannot be mapped.
    """
    if size == 0:
        return
    mapping = map_file(fd, size, what)
    try:
        with memoryview(mapping) as whole:
            read_ahead(mapping, 0, min(MAP_BLOCK_BYTES, size))
            for start in range(0, size, MAP_BLOCK_BYTES):
                end = min(start + MAP_BLOCK_BYTES, size)
                read_ahead(mapping, end, min(end + MAP_BLOCK_BYTES, size))
                with whole[start:end] as view:  # let go of before the unmapping
                    yield start, view
    finally:
        mapping.close()


def file_crc32c(fd: int, size: int, what: str) -> int:
    """The crc32c of the first ``size`` bytes of the file open at ``fd``, taken over a mapping.

    Raises:
        DataCorruptionError: the file is shorter than ``size``.
        OSError: the file cannot be read.
    """
    crc = 0
    for _, view in mapped_blocks(fd, size, what):
        crc = crc32c_extend(crc, view)
    return crc
