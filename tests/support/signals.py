"""Signals that land inside a save, as Slurm's requeue signal lands inside a training job's save, and
a forked child in which a test's process may die (an abort) without taking pytest with it."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import gc
import logging
import multiprocessing
import os
import pickle
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

Result = TypeVar("Result")

#: Where the deferral of operations asked for inside another logs (when they start, land or fail).
DEFERRAL_LOG = "lightning_storage_plugins.ordering"

#: The signal the tests send: the one Slurm's ``--signal=B:USR1@90`` and Lightning's
#: ``SLURMEnvironment`` use (pytest-timeout keeps SIGALRM for itself).
REQUEUE_SIGNAL = signal.SIGUSR1


@contextlib.contextmanager
def handling(handler: Callable[[int, Any], None], signum: int = REQUEUE_SIGNAL) -> Iterator[None]:
    """``handler`` installed for ``signum`` inside the block; the previous handler after it."""
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


@contextlib.contextmanager
def deferral_log() -> Iterator[list[logging.LogRecord]]:
    """The records of :data:`DEFERRAL_LOG` inside the block, at INFO and above (also in a forked child)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(DEFERRAL_LOG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def to_main_thread(signum: int = REQUEUE_SIGNAL) -> None:
    """Send ``signum`` to this process' main thread, where Python runs the handler (between two of
    its bytecodes, wherever it then is). Sent to the process, the kernel may give it to another
    thread, and then a wait the main thread is blocked in (an ``Event.wait``) is not interrupted:
    the handler would run only when that wait ends."""
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signum)


def handler_ran(handled: threading.Event, timeout_s: float = 60.0) -> bool:
    """Whether ``handled`` is set within ``timeout_s``, waiting in the main thread in short slices: a
    signal that lands just before a long wait starts is not noticed until that wait ends (the
    interpreter runs handlers between bytecodes, and the blocked wait is not interrupted then), so a
    single 60 s wait would return False with the handler still to run."""
    deadline = time.monotonic() + timeout_s
    while not handled.wait(0.05):
        if time.monotonic() > deadline:
            return False
    return True


def signal_later(delay: float, signum: int = REQUEUE_SIGNAL) -> threading.Thread:
    """A started thread that sends ``signum`` to this process' main thread after ``delay`` seconds
    (see :func:`to_main_thread`)."""
    def send() -> None:
        if delay > 0:
            threading.Event().wait(delay)  # the delay is the point of the test: where the signal lands
        to_main_thread(signum)

    thread = threading.Thread(target=send, name="signal-later", daemon=True)
    thread.start()
    return thread


def spread(duration: float, count: int, seed: int) -> list[float]:
    """``count`` delays, one drawn at random in each of ``count`` equal slices of ``[0, duration)``:
    random points that cover the whole of an operation lasting ``duration``."""
    rng = random.Random(seed)
    return [duration * (index + rng.random()) / count for index in range(count)]


class Tripwire:
    """Sends ``signum`` to this process while a save pickles it (so the handler runs at that point of
    the save, with what came before it in the checkpoint already on its way), and is saved as an
    empty ``OrderedDict`` (which weights-only loading allows).

    Args:
        on_load: instead, pickle as a call that sends the signal when the checkpoint is unpickled
            (only a ``weights_only=False`` load runs it).
    """

    def __init__(self, on_load: bool = False, signum: int = REQUEUE_SIGNAL) -> None:
        self.on_load = on_load
        self.signum = signum

    def __reduce__(self) -> tuple[Any, ...]:
        if self.on_load:
            return (signal.raise_signal, (self.signum,))
        signal.raise_signal(self.signum)
        return (collections.OrderedDict, ())


class Refuses:
    """Fails the save that pickles it."""

    def __reduce__(self) -> tuple[Any, ...]:
        raise RuntimeError("this object refuses to be pickled")


def result_in_fork(check: Callable[[], Result], deadline_s: float = 120.0) -> Result:
    """What ``check`` returns when run in a forked child of this process (as Lightning's ``ddp_fork``
    runs ranks): a child that aborts fails the test, naming the signal, instead of ending pytest.

    Skipped where this process has initialized CUDA: a forked child cannot use it (pinning the
    staging buffer would fail there).

    Raises:
        AssertionError: the child raised (its traceback is in the message), died of a signal, or
            ran past ``deadline_s`` (its stacks are dumped, then it is ended).
    """
    if torch.cuda.is_initialized():
        pytest.skip("this process has initialized CUDA, which a forked child cannot use")
    gc.collect()  # what earlier tests left (DeepSpeed handles among it) is destroyed here, not in the child
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and its exit status
        os.close(reader)
        faulthandler.dump_traceback_later(deadline_s, exit=True)
        try:
            torch.set_num_threads(1)  # torch's OpenMP threads did not survive the fork
            payload = pickle.dumps(("returned", check()))
        except BaseException:  # noqa: BLE001 - reported to the parent
            payload = pickle.dumps(("raised", traceback.format_exc()))
        with os.fdopen(writer, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as source:
        payload = source.read()  # until the child exits: it ends itself past the deadline
    _, status = os.waitpid(pid, 0)
    return _child_result(pickle.loads(payload) if payload else None, os.waitstatus_to_exitcode(status))


def result_in_new_process(function: Callable[..., Result], *args: Any, deadline_s: float = 180.0) -> Result:
    """What ``function(*args)`` returns in a new Python process (spawned, not forked): for a check that
    trains, since a child forked from a process whose autograd has run cannot run backward ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing"), and this process may
    have trained in an earlier test. ``function`` is a module-level function; the child inherits the
    environment. A child that aborts fails the test, naming the signal, instead of ending pytest.

    Raises:
        AssertionError: the child raised (its traceback is in the message), died of a signal, or
            ran past ``deadline_s`` (its stacks are dumped, then it is ended).
    """
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_report_result, args=(writer, function, args, deadline_s), daemon=True)
    child.start()
    writer.close()
    try:
        report = reader.recv()  # until the child reports or exits: it ends itself past the deadline
    except EOFError:
        report = None
    child.join()
    return _child_result(report, child.exitcode)


def _child_result(report: tuple[str, Any] | None, exit_code: int) -> Any:
    """The value a child reported, or the AssertionError saying why there is none: it raised, died of
    a signal (a negative ``exit_code``), or exited without a report."""
    if exit_code < 0:
        raise AssertionError(f"the child process died of {signal.Signals(-exit_code).name}")
    if report is None:
        raise AssertionError(f"the child process exited with status {exit_code} without a result "
                             "(past its deadline?)")
    outcome, value = report
    if outcome == "raised":
        raise AssertionError(f"in the child process:\n{value}")
    return value


def _report_result(writer: Any, function: Callable[..., Any], args: tuple[Any, ...], deadline_s: float) -> None:
    faulthandler.dump_traceback_later(deadline_s, exit=True)
    try:
        report = ("returned", function(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        report = ("raised", traceback.format_exc())
    writer.send(report)
    writer.close()
