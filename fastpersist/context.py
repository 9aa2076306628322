"""``FastPersistContext``: the handle, staging buffer and lock of FastPersist I/O, owned by its user.

Modelled on DeepSpeed's ``FastFileWriterConfig`` (``deepspeed/io/``): the I/O handle and the pinned
buffer are passed explicitly rather than kept in module globals. A context creates them lazily on
first use and frees what it created in :meth:`FastPersistContext.close`. Whoever saves repeatedly
(a Lightning ``CheckpointIO``, a DeepSpeed checkpoint engine, a training script) keeps one context and
passes it to every :func:`~fastpersist.fastpersist_save` / :func:`~fastpersist.fastpersist_load`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fastpersist import _deepspeed_compat
from fastpersist.aio import AioConfig, aio_unavailable_reason, gds_unavailable_reason, new_gds_handle
from fastpersist.engines import (
    DEFAULT_ENGINE,
    ENGINE_NAMES,
    FALLBACK,
    PY_IO_THREADS,
    AioEngine,
    GdsEngine,
    IOEngine,
    PythonEngine,
)
from fastpersist.memory import (
    ALIGNMENT_BYTES,
    MiB,
    aligned_empty,
    get_pinned_buffer,
    release_pinned_buffer,
    round_up,
)
from lightning_storage_plugins.messages import warn_once
from lightning_storage_plugins.reentry import ReentrantOperationError

log = logging.getLogger(__name__)

DEFAULT_BUFFER_MB = 256
# The smallest staging buffer a context allocates for an operation that says how much it stages.
MIN_STAGING_BYTES = 1 * MiB


def check_engine_name(name: str | None) -> str | None:
    """``name`` if it names an engine (``None`` and ``"auto"`` mean the default).

    Raises:
        ValueError: unknown engine name.
    """
    if name in (None, "auto"):
        return None
    if name not in ENGINE_NAMES:
        raise ValueError(f"unknown fastpersist engine {name!r}; choose from {sorted(ENGINE_NAMES)}")
    return name


class ContextInUseError(ReentrantOperationError):
    """A save or load was asked of a :class:`FastPersistContext` by the thread that is using it for
    another (from a signal handler, or a callback that runs inside that operation). The handle and
    staging buffer serve one operation at a time, so it is refused before it touches them, and the
    operation in progress goes on. ``FastPersistCheckpointIO`` never meets it: it saves after the
    operation in progress instead.

    Attributes:
        busy: the operation in progress, e.g. ``"saving /nvme/last.ckpt"``.
        refused: the one refused, e.g. ``"saving /nvme/hpc_ckpt_1.ckpt"``.
    """


class FastPersistContext:
    """The I/O handle, staging buffer and lock that FastPersist saves and loads use.

    Everything is created on first use and owned by the context: :meth:`close` (or leaving a ``with``
    block) frees the buffer it allocated; a handle or buffer passed in stays the caller's. One context
    serves one save or load at a time (its :attr:`lock` is held for the whole operation), so threads
    sharing a context take turns. A save or load asked for on the thread that is using the context
    (a signal handler that interrupted a save, say) raises :class:`ContextInUseError` instead of
    sharing the handle and buffer in use. Pickling a context keeps its settings and drops handle and
    buffer.

    Args:
        engine: how saves write: ``"aio"`` (DeepSpeed libaio, the default), ``"python"`` (O_DIRECT +
            threads, no compiled op) or ``"gds"`` (GPUDirect Storage). An unavailable engine falls back
            (gds -> aio -> python) with one warning naming the reason. Host loads read straight into
            the tensors' memory whichever it is (see :func:`~fastpersist.fastpersist_load`).
        io_buffer_mb: the largest staging buffer (split in two halves: one fills while the other
            writes). A save gets one the size of what it writes, up to this (see :meth:`staging_buffer`).
        aio: handle tuning (block size, queue depth, threads), as in the ds_config ``"aio"`` block.
        aio_handle: an existing DeepSpeed aio handle to use instead of creating one (it stays the
            caller's: a forked child needs one of its own, where a created one is re-created there).
        pinned_buffer: existing staging memory (page-locked host memory; GPU memory for ``"gds"``).

    Raises:
        ValueError: unknown engine or a non-positive buffer size.
    """

    def __init__(
        self,
        *,
        engine: str | None = None,
        io_buffer_mb: float = DEFAULT_BUFFER_MB,
        aio: AioConfig | None = None,
        aio_handle: Any = None,
        pinned_buffer: torch.Tensor | None = None,
    ) -> None:
        if io_buffer_mb <= 0:
            raise ValueError(f"io_buffer_mb must be positive, got {io_buffer_mb}")
        self.engine = check_engine_name(engine)
        self.io_buffer_mb = io_buffer_mb
        self.aio = aio or AioConfig()
        self._given_handle = aio_handle
        self._given_buffer = pinned_buffer
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._holder: tuple[int, str] | None = None  # the thread in an operation, and what it does
        self._aio_handle: Any = None
        self._gds_handle: Any = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._locked_by_handle: dict[int, set[int]] = {}  # id(handle) -> addresses it page-locked
        self._pool: ThreadPoolExecutor | None = None
        self._warned: set[str] = set()
        self._gds_probes: dict[int, str | None] = {}  # st_dev -> why cuFile cannot write there

    def _in_this_process(self) -> None:
        """Start over in a forked child (``ddp_fork``, ``ddp_notebook``): the parent's aio handle and
        I/O threads did not survive the fork, and one of its threads may have held the lock. What
        the parent allocated stays the parent's (the child's copy is left to the child's exit)."""
        if self._pid != os.getpid():
            for handle in (self._aio_handle, self._gds_handle):
                if handle is not None:
                    _keep_for_life(handle)
            self._reset()

    @property
    def lock(self) -> threading.RLock:
        """Held for a whole save or load: the handle and buffer serve one operation at a time."""
        self._in_this_process()
        return self._lock

    @contextlib.contextmanager
    def operation(self, description: str) -> Iterator[None]:
        """Hold this context for one save or load (or :meth:`close`): another thread asking for it
        meanwhile waits its turn; the thread holding it is refused.

        Args:
            description: what the operation is, as errors name it, e.g. ``"saving /nvme/a.pt"``.

        Raises:
            ContextInUseError: this thread is inside an operation of this context (the new one was
                asked for from a signal handler or a callback that interrupted it).
        """
        lock = self.lock
        me = threading.get_ident()
        holder = self._holder
        if holder is not None and holder[0] == me:
            raise ContextInUseError(
                holder[1], description, "the context's aio handle and staging buffer are in use by that "
                "operation; use another FastPersistContext for this one, or ask for it after that one "
                "returns (FastPersistCheckpointIO saves it then by itself)")
        # A signal handler that runs between the check above and the line that marks this thread as
        # the holder (or after the mark is cleared) takes the lock again, being on the same thread,
        # and runs its whole operation there: safe, as this one has not begun (or has ended).
        with lock:
            self._holder = (me, description)
            try:
                yield
            finally:
                self._holder = None

    def aio_handle(self) -> Any:
        """The DeepSpeed aio handle (the one given, else one created on first use).

        Raises:
            RuntimeError: DeepSpeed's ``async_io`` op cannot be loaded.
        """
        with self.lock:
            if self._given_handle is not None:
                return self._given_handle
            if self._aio_handle is None:
                from fastpersist.aio import get_aio_handle

                config = self.aio
                self._aio_handle = get_aio_handle(
                    config.block_size,
                    config.queue_depth,
                    config.single_submit,
                    config.overlap_events,
                    config.intra_op_parallelism,
                )
            return self._aio_handle

    def staging_buffer(self, device: str = "cpu", pinned: bool = True, nbytes: int | None = None) -> torch.Tensor:
        """The staging buffer for an engine whose buffer lives on ``device`` (``"cpu"`` or ``"cuda"``).

        A buffer passed in is returned as given (engines check where it lives). Otherwise host memory is
        page-locked when ``pinned`` (with the aio handle where CUDA is absent; the python engine needs
        no locking), and GPU memory is plain device memory. Host memory is one buffer at a time: a
        locked one large enough serves where unlocked memory is asked for, and making a locked one
        gives back the unlocked one.

        Why sized: page-locking memory costs time in proportion to its size (on a small VM, locking
        the default 256 MiB took 0.5 s, twice a 16 MiB checkpoint's whole save), and a short-lived
        process pays it at its first save; so a save that says what it stages gets a buffer of that
        size, kept for the next operation and replaced by a larger one when one needs more.

        Args:
            device: where the engine's buffer lives.
            pinned: page-lock host memory.
            nbytes: about what the operation stages (a save: the bytes it writes). The buffer then
                holds that many bytes (at least ``MIN_STAGING_BYTES``, at most ``io_buffer_mb``,
                at least twice what it held before when it grows); ``None``: ``io_buffer_mb``.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"nbytes must not be negative, got {nbytes}")
        with self.lock:
            if self._given_buffer is not None:
                return self._given_buffer
            key = device if device != "cpu" else ("cpu-pinned" if pinned else "cpu")
            capacity = round_up(int(self.io_buffer_mb * MiB), 2 * ALIGNMENT_BYTES)
            wanted = capacity if nbytes is None else min(capacity, round_up(max(nbytes, MIN_STAGING_BYTES),
                                                                            2 * ALIGNMENT_BYTES))
            buffer = self._buffers.get(key)
            if buffer is not None and buffer.numel() >= wanted:
                return buffer
            locked = self._buffers.get("cpu-pinned") if key == "cpu" else None
            if locked is not None and locked.numel() >= wanted:
                return locked
            if buffer is not None:  # grown geometrically, so that saves that grow a little do not each replace it
                wanted = min(capacity, max(wanted, 2 * buffer.numel()))
                self._free_buffer(key, buffer)
            if key == "cpu-pinned":
                self._buffers.pop("cpu", None)
                handle = self.aio_handle() if aio_unavailable_reason() is None else None
                buffer = get_pinned_buffer(wanted / MiB, handle)
                if handle is not None and not torch.cuda.is_available():
                    self._locked_by_handle.setdefault(id(handle), set()).add(buffer.data_ptr())
            elif key == "cpu":
                buffer = aligned_empty(wanted)
            else:
                buffer = torch.empty(wanted, dtype=torch.uint8, device=device)
            self._buffers[key] = buffer
            return buffer

    def _free_buffer(self, key: str, buffer: torch.Tensor) -> None:
        """Give back a staging buffer this context allocated (unlocking what the aio handle locked)."""
        del self._buffers[key]
        if key == "cpu-pinned":
            release_pinned_buffer(buffer, self._aio_handle)
            if self._aio_handle is not None:
                self._locked_by_handle.get(id(self._aio_handle), set()).discard(buffer.data_ptr())

    def io_engine(self, name: str | None = None, directory: str | None = None) -> IOEngine:
        """A new engine instance: ``name``, else this context's engine, falling back where unavailable.

        Args:
            name: engine to use for this operation (overrides the context's).
            directory: where the file lives (GPUDirect Storage is probed per filesystem).

        Raises:
            ValueError: unknown engine name.
        """
        self._in_this_process()
        current = check_engine_name(name) or self.engine or DEFAULT_ENGINE
        while (reason := self._unavailable(current, directory)) is not None:
            fallback = FALLBACK[current]
            message = f"fastpersist engine {current!r} unavailable ({reason}); falling back to {fallback!r}"
            if current == "aio":  # the process's DeepSpeed build, the same for every context: say it once
                _warn_once_per_process(message)
            else:
                self.warn_once(message)
            current = fallback
        if current == "aio":
            handle = self.aio_handle()
            return AioEngine(handle, frozenset(self._locked_by_handle.get(id(handle), ())))
        if current == "gds":
            return GdsEngine(self._gds())
        return PythonEngine(self._python_pool())

    def python_engine(self) -> PythonEngine:
        """The plain-Python engine (always available)."""
        return PythonEngine(self._python_pool())

    def warn_once(self, message: str) -> None:
        """Log ``message`` as a warning the first time this process meets it, on global rank zero only."""
        if message not in self._warned:
            self._warned.add(message)
            warn_once(log, "%s", message)

    def _unavailable(self, engine: str, directory: str | None) -> str | None:
        if engine == "aio":
            return aio_unavailable_reason()
        if engine == "gds":
            return self.gds_unusable_reason(directory)
        return None

    def gds_unusable_reason(self, directory: str | None = None) -> str | None:
        """Why GPUDirect Storage cannot be used (in ``directory``'s filesystem, when given), or ``None``.

        The filesystem is probed once per context with a one-block write whose native (cuFile) output
        is captured, so a user sees one reason instead of raw C++ error lines.
        """
        return gds_unavailable_reason() or self._probe_gds(directory)

    def _gds(self) -> Any:
        if self._gds_handle is None:
            self._gds_handle = new_gds_handle(self.aio)
        return self._gds_handle

    def _probe_gds(self, directory: str | None) -> str | None:
        """Why cuFile cannot write in ``directory``'s filesystem (a one-block trial write), or ``None``."""
        if directory is None:
            return None
        device = os.stat(directory).st_dev
        if device not in self._gds_probes:
            self._gds_probes[device] = self._try_gds_write(directory)
        return self._gds_probes[device]

    def _try_gds_write(self, directory: str) -> str | None:
        handle = self._gds()
        block = torch.zeros(ALIGNMENT_BYTES, dtype=torch.uint8, device="cuda")
        fd, probe = tempfile.mkstemp(prefix=".fastpersist-gds-probe-", dir=directory)
        os.close(fd)
        try:
            with _deepspeed_compat.captured_native_output() as output:
                try:
                    done = handle.sync_pwrite(block, probe)
                except Exception as err:  # the op raises RuntimeError subclasses of its own
                    return f"cuFile cannot write to {directory}: {err}"
            if done != 1:
                said = output.read().strip().splitlines()
                return f"cuFile cannot write to {directory}" + (f": {said[-1]}" if said else "")
            return None
        finally:
            os.unlink(probe)

    def _python_pool(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=PY_IO_THREADS, thread_name_prefix="fastpersist-io"
                )
            return self._pool

    def close(self) -> None:
        """Free the staging buffers and threads this context created (a later use creates new ones).

        Raises:
            ContextInUseError: called on a thread that is saving or loading with this context (from
                a signal handler or a callback), whose buffers are in use.
        """
        with self.operation("closing the context"):
            for key, buffer in self._buffers.items():
                if key == "cpu-pinned":
                    release_pinned_buffer(buffer, self._aio_handle)
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._reset_resources()

    def _reset_resources(self) -> None:
        self._buffers = {}
        self._locked_by_handle = {}
        self._pool = None
        self._aio_handle = None
        self._gds_handle = None

    def __enter__(self) -> FastPersistContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "io_buffer_mb": self.io_buffer_mb,
            "aio": self.aio,
            "_given_handle": None,
            "_given_buffer": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        return f"FastPersistContext(engine={self.engine!r}, io_buffer_mb={self.io_buffer_mb}, aio={self.aio})"


def _keep_for_life(handle: Any) -> None:
    """Never destroy ``handle`` in this process: it was made before a fork, and destroying a DeepSpeed
    I/O handle joins its threads, which do not exist in the child (the process aborts; seen with
    DeepSpeed 0.16). A reference the interpreter never gives back outlives even its shutdown."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))


_warned_in_process: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once_per_process(message: str) -> None:
    with _warned_lock:
        if message in _warned_in_process:
            return
        _warned_in_process.add(message)
    log.warning("%s", message)
