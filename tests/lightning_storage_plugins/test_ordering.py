"""SaveOrder: a removal overtaking a queued or running save of the same path wins, as the caller asked."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from lightning_storage_plugins.ordering import SaveOrder


class Store:
    """A dict-backed checkpoint store saving the way the plugins do: begin, write, end, maybe delete."""

    def __init__(self) -> None:
        self.objects: dict[str, str] = {}
        self.order = SaveOrder(lambda key: key in self.objects)

    def save(self, key: str, value: str, started: threading.Event | None = None,
             release: threading.Event | None = None) -> None:
        if not self.order.begin_save(key):
            return
        try:
            if started is not None:
                started.set()
            if release is not None:
                assert release.wait(10)
            self.objects[key] = value
        finally:
            remove = self.order.end_save(key)
        if remove:
            self.objects.pop(key, None)

    def remove(self, key: str) -> None:
        self.order.removing(key)
        self.objects.pop(key, None)


def test_removal_of_a_running_save_removes_it_once_it_lands() -> None:
    store = Store()
    started, release = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as worker:
        done = worker.submit(store.save, "a", "1", started, release)
        assert started.wait(10)
        store.remove("a")
        release.set()
        done.result(10)
    assert store.objects == {}


def test_removal_of_a_queued_save_skips_it_and_later_saves_still_run() -> None:
    store = Store()
    started, release = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as worker:
        worker.submit(store.save, "warm-up", "0").result(10)  # saves are seen on the worker thread
        blocker = worker.submit(store.save, "b", "1", started, release)
        queued = worker.submit(store.save, "a", "1")
        assert started.wait(10)
        store.remove("a")  # "a" is still queued behind "b"
        release.set()
        blocker.result(10)
        queued.result(10)
        assert "a" not in store.objects
        worker.submit(store.save, "a", "2").result(10)  # a save asked for after the removal is kept
    assert store.objects["a"] == "2"


def test_synchronous_saves_are_never_cancelled_by_removing_a_missing_path() -> None:
    store = Store()
    store.save("a", "1")
    store.remove("never-saved")
    store.save("never-saved", "2")
    assert store.objects == {"a": "1", "never-saved": "2"}


def test_reset_forgets_cancelled_saves() -> None:
    store = Store()
    with ThreadPoolExecutor(1) as worker:
        worker.submit(store.save, "warm-up", "0").result(10)
    store.remove("a")  # missing while saves ran elsewhere: a later save of "a" would be skipped
    store.order.reset()
    store.save("a", "1")
    assert store.objects["a"] == "1"
