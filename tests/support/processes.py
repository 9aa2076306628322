"""Helpers for tests that start and signal real processes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def foreground_sigint() -> None:
    """``preexec_fn`` giving a child the SIGINT disposition of a foreground process.

    Python raises KeyboardInterrupt on SIGINT only if SIGINT was not ignored when it started, and a
    shell starts background jobs (CI runners among them) with SIGINT ignored.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """The process is stopped (SIGSTOP) inside the block: it keeps its sockets but answers nothing."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def call_within(seconds: float, fn: Callable[[], Any]) -> tuple[float, BaseException | None]:
    """Run ``fn`` with a deadline of its own: (seconds it took, what it raised); fails the test on a hang."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc
        outcome["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"still running after {seconds} s: {fn}")
    return outcome["elapsed"], outcome.get("error")


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 60.0,
             child: subprocess.Popen[Any] | None = None) -> None:
    """Poll ``condition`` (which reads a real service or file again each time) until it holds; fail
    naming ``what`` after ``timeout_s``, or at once when ``child``, which was to bring it about, exits."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert child is None or child.poll() is None, f"the child process exited before {what}"
        assert time.monotonic() < deadline, f"never saw {what} within {timeout_s} s"
        time.sleep(0.02)


_FORKSERVER_PRELOAD: list[str] = []


def forkserver_context(preload: Sequence[str]) -> Any:
    """The ``forkserver`` multiprocessing context, whose server imports ``preload`` once, so that each
    child costs a fork, not an interpreter's start-up and imports.

    There is one server per process: it imports what every caller asked for before it started (a
    server already running keeps what it imported; its children import the rest themselves).
    """
    context = multiprocessing.get_context("forkserver")
    _FORKSERVER_PRELOAD.extend(module for module in preload if module not in _FORKSERVER_PRELOAD)
    context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return context
