"""``collector_paused``: nested, overlapping across threads, or inside a caller's own pause, the
collector ends as the outermost caller found it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from lightning_storage_plugins.collector import collector_paused


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_pauses_enable_it_only_when_the_outer_one_ends() -> None:
    gc.enable()
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled_also_after_an_error() -> None:
    gc.disable()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("fails inside")
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("fails inside")
    assert gc.isenabled()


@pytest.mark.parametrize("first_to_end", ["first", "second"])
def test_pauses_overlapping_on_two_threads_leave_it_enabled(first_to_end: str) -> None:
    gc.enable()
    entered = {name: threading.Event() for name in ("first", "second")}
    leave = {name: threading.Event() for name in ("first", "second")}
    errors: list[BaseException] = []

    def pause(name: str) -> None:
        try:
            with collector_paused():
                entered[name].set()
                if not leave[name].wait(60):
                    raise TimeoutError(f"{name} was never told to leave")
        except BaseException as err:  # reported by the test thread
            errors.append(err)

    threads = {name: threading.Thread(target=pause, args=(name,)) for name in ("first", "second")}
    threads["first"].start()
    assert entered["first"].wait(60)
    threads["second"].start()
    assert entered["second"].wait(60)
    assert not gc.isenabled()
    last_to_end = "second" if first_to_end == "first" else "first"
    for name in (first_to_end, last_to_end):
        leave[name].set()
        threads[name].join(60)
    assert not errors
    assert gc.isenabled()
