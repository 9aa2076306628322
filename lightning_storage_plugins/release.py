"""Freeing the blocks of a local file that a save replaces or a removal unlinks, off the caller's path.

A file's blocks are freed when its last link and its last descriptor are gone, in the call that drops
the last of them: for a written checkpoint that is slow (ext4 on a virtio disk: 0.19 s per GiB), and
Lightning removes old checkpoints and saves over ``last.ckpt`` on the training thread. Held open
across the rename or unlink and closed on a thread of its own, the file is freed after the call has
returned.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator

__all__ = ["freed_later", "hold"]


@contextlib.contextmanager
def freed_later(path: str) -> Iterator[None]:
    """Hold the regular file at ``path`` (if any) through the block, which renames over it or
    unlinks it, and let it go on a thread of its own after."""
    fd = hold(path)
    try:
        yield
    finally:
        _release_later(fd)


def hold(path: str) -> int | None:
    """A descriptor of the regular file at ``path``, or ``None`` (nothing there, a link: the rename or
    unlink drops only the link, or a file this process may not read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _release_later(fd: int | None) -> None:
    """Close ``fd`` (of a file unlinked by now) on a thread of its own."""
    if fd is not None:
        threading.Thread(target=os.close, args=(fd,), name="free-unlinked-file", daemon=True).start()
