"""DeepSpeed's asynchronous I/O ops: the ``async_io`` (libaio) and ``gds`` (GPUDirect Storage) handles.

Handles made here start their I/O threads with every signal blocked but those of a fault. DeepSpeed's
threads wait for completions in ``io_getevents``, which a signal handled on that thread interrupts
(``EINTR``), and DeepSpeed then aborts the process (``deepspeed_aio_common.cpp: Assertion `n_completes
>= min_completes' failed``). The kernel hands a process-directed signal to any thread that does not
block it, an I/O thread too when the main thread already has one pending: a burst of ``SIGUSR1``
during aio saves aborted a process within seconds. With the I/O threads blocking them, signals go to
the threads that can take them; Python runs its handlers on the main thread in any case.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastpersist import _deepspeed_compat
from fastpersist.memory import MiB


@dataclass(frozen=True)
class AioConfig:
    """Tuning of a DeepSpeed aio/gds handle; the names are those of the ds_config ``"aio"`` block.

    Args:
        block_size: bytes per submitted I/O request.
        queue_depth: requests in flight per thread.
        intra_op_parallelism: threads that split one transfer between them.
        single_submit: submit requests one at a time instead of in batches.
        overlap_events: reap each completed request and submit the next one at once, instead of
            submitting ``queue_depth`` requests and reaping them together. Off by default: a save
            hands the handle whole staging halves (``queue_depth`` blocks or more), which fill the
            queue either way, and per-request reaping wakes DeepSpeed's thread once per block,
            taking CPU from the pickling and copying that run beside the write.
    """

    block_size: int = 1 * MiB
    queue_depth: int = 128
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = False

    @classmethod
    def from_ds_config(cls, aio: dict[str, Any] | None) -> AioConfig:
        """The settings of a ds_config ``"aio"`` block; keys it leaves out keep fastpersist's defaults.

        Raises:
            ValueError: a value has the wrong type or is not positive.
        """
        fields = {}
        for name, default in cls().__dict__.items():
            if aio and aio.get(name) is not None:
                value = aio[name]
                if isinstance(default, bool) != isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(
                        f'ds_config "aio.{name}" must be {type(default).__name__}, got {value!r}'
                    )
                if not isinstance(value, bool) and value <= 0:
                    raise ValueError(f'ds_config "aio.{name}" must be positive, got {value}')
                fields[name] = value
        return cls(**fields)

    def handle_args(self) -> tuple[int, int, bool, bool, int]:
        # Positional: the keyword names changed across DeepSpeed releases.
        return (
            self.block_size,
            self.queue_depth,
            self.single_submit,
            self.overlap_events,
            self.intra_op_parallelism,
        )


def aio_unavailable_reason() -> str | None:
    """Why DeepSpeed's ``async_io`` op cannot be used here, or ``None`` when it can."""
    return _deepspeed_compat.aio_op()[1]


def gds_unavailable_reason() -> str | None:
    """Why DeepSpeed's ``gds`` op cannot be used here, or ``None`` when it can."""
    return _deepspeed_compat.gds_op()[1]


def get_aio_handle(
    block_size: int = AioConfig.block_size,
    queue_depth: int = AioConfig.queue_depth,
    single_submit: bool = AioConfig.single_submit,
    overlap_events: bool = AioConfig.overlap_events,
    intra_op_parallelism: int = AioConfig.intra_op_parallelism,
) -> Any:
    """A new DeepSpeed aio handle (arguments as DeepSpeed's ``aio_handle``), whose I/O threads block
    every signal but those of a fault (see the module: a handle made with DeepSpeed's own
    ``aio_handle`` can abort the process when a signal lands on one of its threads).

    Raises:
        RuntimeError: DeepSpeed's ``async_io`` op cannot be loaded (the message says why).
    """
    op, reason = _deepspeed_compat.aio_op()
    if op is None:
        raise RuntimeError(f"DeepSpeed async_io op is unavailable: {reason}")
    config = AioConfig(block_size, queue_depth, intra_op_parallelism, single_submit, overlap_events)
    with _threads_started_without_signals():
        return op.aio_handle(*config.handle_args())


_FAULT_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}


@contextlib.contextmanager
def _threads_started_without_signals() -> Iterator[None]:
    """Block every signal on this thread for the block, so that threads started in it (a handle's I/O
    threads, which inherit the mask) never take one; signals that arrive meanwhile wait, pending,
    until the mask is restored. The signals of a thread's own fault stay open (blocked, the kernel
    would kill the process without running a handler such as ``faulthandler``'s)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _FAULT_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def new_gds_handle(config: AioConfig) -> Any:
    """A new DeepSpeed GPUDirect Storage handle.

    Raises:
        RuntimeError: DeepSpeed's ``gds`` op cannot be loaded (the message says why).
    """
    op, reason = _deepspeed_compat.gds_op()
    if op is None:
        raise RuntimeError(f"DeepSpeed gds op is unavailable: {reason}")
    with _threads_started_without_signals():
        return op.gds_handle(*config.handle_args())
