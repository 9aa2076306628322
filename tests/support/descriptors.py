"""Which files this process holds open."""

from __future__ import annotations

import os
import time


def _held_by_this_process(identity: tuple[int, int]) -> bool:
    for name in os.listdir("/proc/self/fd"):
        try:
            found = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if (found.st_dev, found.st_ino) == identity:
            return True
    return False


def wait_until_released(identity: tuple[int, int], timeout_s: float = 60.0) -> None:
    """Until no descriptor of this process holds the file (the release thread has closed it)."""
    deadline = time.monotonic() + timeout_s
    while _held_by_this_process(identity):
        assert time.monotonic() < deadline, "the unlinked file is still held open"
        time.sleep(0.01)
