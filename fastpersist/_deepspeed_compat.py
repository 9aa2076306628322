"""Every version-dependent DeepSpeed API fastpersist uses (DeepSpeed 0.16 to 0.19), in one place.

- Op loading: DeepSpeed's JIT builder cannot parse ``TORCH_CUDA_ARCH_LIST`` entries with an
  architecture suffix (``9.0a``, ``10.0f``, as Hopper and Blackwell images set); the aio and gds
  ops are loaded with the suffixes dropped for the duration of the build only.
- aio handles: 0.16 writes through a file *name* (it opens the file per request) and cannot say
  whether a buffer is page-locked; 0.17+ writes through an open descriptor and has ``is_pinned``.
- Checkpoint engines: 0.16's ``create``/``commit`` take a tag, later ones a ``CheckpointCommitInfo``.
- Configuration: the raw ds_config dict behind an engine, for the ``checkpoint.writer`` and ``aio``
  blocks (0.16 does not parse the writer block itself).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

# Loading ops may rewrite TORCH_CUDA_ARCH_LIST for a moment; one load at a time.
_op_load_lock = threading.Lock()
_ARCH_SUFFIX = re.compile(r"^(\d+\.\d+)[a-zA-Z]+(\+PTX)?$")


def sanitized_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` without architecture suffixes DeepSpeed cannot parse (``9.0a`` -> ``9.0``)."""
    entries = [entry for entry in re.split(r"[;\s]+", value.strip()) if entry]
    cleaned: list[str] = []
    for entry in entries:
        match = _ARCH_SUFFIX.match(entry)
        plain = f"{match.group(1)}{match.group(2) or ''}" if match else entry
        if plain not in cleaned:
            cleaned.append(plain)
    return ";".join(cleaned)


@contextlib.contextmanager
def _parsable_arch_list() -> Iterator[None]:
    original = os.environ.get("TORCH_CUDA_ARCH_LIST")
    cleaned = sanitized_arch_list(original) if original is not None else None
    if cleaned == original:
        yield
        return
    log.info("building DeepSpeed ops with TORCH_CUDA_ARCH_LIST=%r (was %r)", cleaned, original)
    os.environ["TORCH_CUDA_ARCH_LIST"] = cleaned or ""
    try:
        yield
    finally:
        if original is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = original


def _load_op(builder_name: str) -> tuple[Any | None, str | None]:
    """``(op module, None)`` or ``(None, reason)`` for one of DeepSpeed's op builders."""
    try:
        from deepspeed.ops import op_builder

        builder = getattr(op_builder, builder_name)()
        with _op_load_lock, _parsable_arch_list(), _quiet_native_output():
            if not builder.is_compatible(verbose=False):
                return None, f"DeepSpeed's {builder.NAME} op is not compatible with this machine"
            return builder.load(verbose=False), None
    except ImportError as err:
        return None, f"DeepSpeed is not installed ({err})"
    except Exception as err:  # a failed JIT build raises many kinds of errors
        return None, f"DeepSpeed's {builder_name} op failed to build or load: {err}"


@contextlib.contextmanager
def _quiet_native_output() -> Iterator[None]:
    """Keep DeepSpeed's compatibility probes (which print) off the user's stdout."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


@functools.cache
def aio_op() -> tuple[Any | None, str | None]:
    """DeepSpeed's ``async_io`` op (loaded once, like an import), or ``None`` and the reason."""
    return _load_op("AsyncIOBuilder")


@functools.cache
def gds_op() -> tuple[Any | None, str | None]:
    """DeepSpeed's ``gds`` op (NVIDIA GPUDirect Storage), or ``None`` and the reason."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    return _load_op("GDSBuilder")


def writes_by_descriptor(handle: Any) -> bool:
    """Whether ``handle.async_pwrite`` takes an open descriptor (DeepSpeed >= 0.17) or only a path."""
    return hasattr(handle, "get_alignment")


def partial_file_transfers(handle: Any) -> bool:
    """Whether ``handle.async_pread`` / ``async_pwrite`` can move part of a file.

    DeepSpeed 0.16's path-based transfers can leave ``wait()`` blocked forever when the buffer does
    not span the whole (preallocated) file: its reads always, its writes with many tensors through a
    small staging buffer. There such a transfer must not be submitted to it.
    """
    return writes_by_descriptor(handle)


def async_pwrite(handle: Any, buffer: torch.Tensor, fd: int, path: str, offset: int) -> int:
    """Queue one write on ``handle`` (by descriptor where DeepSpeed can, else by path)."""
    if writes_by_descriptor(handle):
        return handle.async_pwrite(buffer, fd, offset)
    return handle.async_pwrite(buffer, path, offset)


def handle_is_pinned(handle: Any, buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is page-locked memory ``handle`` can write from without a bounce buffer.

    DeepSpeed >= 0.17 asks the handle. 0.16 cannot: there a buffer counts as locked when CUDA pinned
    it, or when the kernel reports its whole mapping locked (``Locked:`` in /proc/self/smaps, which is
    what DeepSpeed's ``new_cpu_locked_tensor`` produces).
    """
    if buffer.device.type != "cpu":
        return False
    if hasattr(handle, "is_pinned"):
        return bool(handle.is_pinned(buffer))
    if torch.cuda.is_available() and buffer.is_pinned():
        return True
    return memory_is_locked(buffer.data_ptr(), buffer.numel() * buffer.element_size())


def memory_is_locked(address: int, num_bytes: int) -> bool:
    """Whether every page of ``[address, address + num_bytes)`` lies in mlock'ed mappings.

    Read from the mappings' ``VmFlags`` (``lo``) in ``/proc/self/smaps``: their ``Locked:`` sizes are
    proportional shares, which fall below the mapping's size once a page is shared with a forked child.
    """
    end_wanted = address + num_bytes
    covered = 0
    try:
        with open("/proc/self/smaps") as smaps:
            overlap = 0
            for line in smaps:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    start, end = (int(part, 16) for part in head.split("-"))
                    overlap = max(0, min(end, end_wanted) - max(start, address))
                elif overlap and head == "VmFlags:":
                    if "lo" not in line.split()[1:]:
                        return False
                    covered += overlap
                    overlap = 0
    except (OSError, ValueError):
        return False
    return num_bytes > 0 and covered == num_bytes


def commit_info_takes_object() -> bool:
    """Whether checkpoint engines' ``create``/``commit`` take a ``CheckpointCommitInfo`` (>= 0.17)."""
    from deepspeed.runtime.checkpoint_engine import checkpoint_engine

    return hasattr(checkpoint_engine, "CheckpointCommitInfo")


def checkpoint_engine_base() -> type:
    """DeepSpeed's ``CheckpointEngine`` base class."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    return CheckpointEngine


def commit_tag(info: Any) -> Any:
    """The checkpoint tag of a ``create``/``commit`` argument (a tag, or an object holding one)."""
    return getattr(info, "tag", info)


def ds_config_dict(ds_engine: Any) -> dict[str, Any]:
    """The ds_config as the user wrote it (a dict), for a DeepSpeed engine of any supported release."""
    config = getattr(getattr(ds_engine, "_config", None), "_param_dict", None)
    if isinstance(config, dict):
        return config
    config = getattr(ds_engine, "config", None)
    return config if isinstance(config, dict) else {}


class CapturedOutput:
    """What native code wrote to stdout and stderr while :func:`captured_native_output` was active."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def read(self) -> str:
        self._sink.seek(0)
        return self._sink.read().decode(errors="replace")


@contextlib.contextmanager
def captured_native_output() -> Iterator[CapturedOutput]:
    """Capture file descriptors 1 and 2 (where C++ ops print) instead of letting them reach the user."""
    import sys
    import tempfile

    with tempfile.TemporaryFile() as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield CapturedOutput(sink)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
