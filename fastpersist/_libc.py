"""The C library calls Python's ``os`` module lacks: ``fallocate`` (reserve file blocks without
writing them), ``madvise(MADV_POPULATE_WRITE)`` (fault memory in ahead of its use) and
``renameat2(RENAME_EXCHANGE)`` (swap two names in one step)."""

from __future__ import annotations

import ctypes
import errno
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    try:  # glibc 2.28+
        lib.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    except AttributeError:
        pass
    return lib


def fallocate(fd: int, offset: int, length: int) -> int:
    """``fallocate(fd, 0, offset, length)``: 0, or the errno (ENOSYS where libc has no fallocate)."""
    lib = _libc()
    if lib is None:
        return errno.ENOSYS
    if lib.fallocate(fd, 0, offset, length) == 0:
        return 0
    return ctypes.get_errno()


MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate_write(address: int, length: int) -> int:
    """``madvise(address, length, MADV_POPULATE_WRITE)``: 0, or the errno (EINVAL before Linux 5.14).

    Faults every page of the range in for writing, in one call that releases the GIL.
    """
    lib = _libc()
    if lib is None:
        return errno.ENOSYS
    if lib.madvise(address, length, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


_AT_FDCWD = -100
RENAME_EXCHANGE = 2


def exchange(first: bytes, second: bytes) -> int:
    """``renameat2(AT_FDCWD, first, AT_FDCWD, second, RENAME_EXCHANGE)``: 0, or the errno (ENOSYS where
    libc has no ``renameat2``; EINVAL where the filesystem cannot exchange, NFS among them)."""
    lib = _libc()
    if lib is None or not hasattr(lib, "renameat2"):
        return errno.ENOSYS
    if lib.renameat2(_AT_FDCWD, first, _AT_FDCWD, second, RENAME_EXCHANGE) == 0:
        return 0
    return ctypes.get_errno()
