"""Removals and saves of one checkpoint path, kept in the order they were asked for.

Lightning's ``AsyncCheckpointIO`` queues saves on a worker thread but passes removals straight
through on the training thread. ``ModelCheckpoint`` therefore can remove a checkpoint whose save
has not been written yet; that save would publish it afterwards and it would never go away (a
``save_top_k=1`` run then fills the disk or bucket). Each storage plugin keeps one :class:`SaveOrder`
and asks it before and after every save and before every removal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["SaveOrder"]


class SaveOrder:
    """Cancels saves that a removal of the same path has overtaken.

    A removal of a path whose save is running, or, once saves have been seen on another thread
    than the remover's, of a path that does not exist yet, cancels that save: a save that has not
    started is skipped, a running one is removed as soon as it has landed.

    Args:
        exists: whether a checkpoint is stored at a path now (asked only while saves run on
            another thread).
    """

    def __init__(self, exists: Callable[[str], bool]) -> None:
        self._exists = exists
        self._lock = threading.Lock()
        self._saving: dict[str, int] = {}
        self._cancelled: set[str] = set()
        self._save_threads: set[int] = set()

    def begin_save(self, key: str) -> bool:
        """Whether to go on with a save of ``key`` (``False``: it was removed before it could run)."""
        with self._lock:
            if key in self._cancelled and key not in self._saving:
                self._cancelled.discard(key)
                return False
            self._saving[key] = self._saving.get(key, 0) + 1
            self._save_threads.add(threading.get_ident())
            return True

    def end_save(self, key: str) -> bool:
        """Whether the checkpoint just saved at ``key`` must be removed (a removal came while it ran)."""
        with self._lock:
            count = self._saving.pop(key) - 1
            if count:
                self._saving[key] = count
                return False
            if key in self._cancelled:
                self._cancelled.discard(key)
                return True
            return False

    def removing(self, key: str) -> None:
        """Record a removal of ``key``, cancelling a save of it that is running or still queued."""
        with self._lock:
            if key in self._saving:
                self._cancelled.add(key)
                return
            saves_elsewhere = bool(self._save_threads - {threading.get_ident()})
        if saves_elsewhere and not self._exists(key):
            with self._lock:
                self._cancelled.add(key)

    def reset(self) -> None:
        """Forget cancelled saves and the threads seen (at teardown: the next run starts clean)."""
        with self._lock:
            self._cancelled.clear()
            self._save_threads.clear()
