"""Every version-dependent DeepSpeed API fastpersist uses (DeepSpeed 0.16 to 0.19), in one place.

- Op building and loading: nothing compiles at run time. DeepSpeed's own ``load()`` compiles an op
  just in time into torch's extension cache, which is keyed by Python and CUDA version but not by
  environment, so a second environment (or the same one reached through another path) rewrites its
  ``build.ninja`` and the next save recompiles for minutes. Instead the set-up builds each op once
  per environment (:func:`build_op`, run by ``python -m fastpersist.build_ops``) into a directory
  under ``sys.prefix``, and :func:`aio_op` / :func:`gds_op` only import what is there, or what a
  DeepSpeed installed with ``DS_BUILD_AIO=1`` / ``DS_BUILD_GDS=1`` carries. A missing op is a reason
  to fall back, never a compile.
- The build: DeepSpeed's JIT builder cannot parse ``TORCH_CUDA_ARCH_LIST`` entries with an
  architecture suffix (``9.0a``, ``10.0f``, as Hopper and Blackwell images set); ops are built with
  the suffixes dropped for the duration of the build only.
- DeepSpeed's once-per-process notice about NVMe write endurance (TBW), which its aio op logs at
  warning level on the first write, goes to fastpersist's log at debug level instead.
- aio handles: 0.16 writes through a file *name* (it opens the file per request) and cannot say
  whether a buffer is page-locked; 0.17+ writes through an open descriptor and has ``is_pinned``.
- Checkpoint engines: 0.16's ``create``/``commit`` take a tag, later ones a ``CheckpointCommitInfo``.
- Configuration: the raw ds_config dict behind an engine, for the ``checkpoint.writer`` and ``aio``
  blocks (0.16 does not parse the writer block itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import json
import logging
import os
import re
import sys
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


BUILD_COMMAND = "python -m fastpersist.build_ops"
_OP_NAMES = {"AsyncIOBuilder": "async_io", "GDSBuilder": "gds"}
# What DeepSpeed's aio op checks before logging its write-endurance notice (DeepSpeed >= 0.19).
_TBW_NOTICE_MARKER = "_deepspeed_nvme_write_warning_emitted"
_TBW_NOTICE = (
    "DeepSpeed notes that offloading to NVMe can generate heavy write traffic: repeated writes to "
    "consumer SSDs can exhaust their rated write endurance (TBW)"
)


def prebuilt_ops_dir() -> str:
    """This environment's directory of DeepSpeed ops built ahead of time, one per DeepSpeed and torch
    release (a venv reached through a symlink finds the same files)."""
    from importlib.metadata import version

    release = f"deepspeed-{version('deepspeed')}-torch-{torch.__version__}"
    return os.path.join(sys.prefix, "share", "fastpersist", "deepspeed-ops", release)


def prebuilt_op_path(op_name: str) -> str:
    """Where :func:`build_op` puts ``op_name`` (torch's extension layout: ``<dir>/<name>/<name>.so``)."""
    return os.path.join(prebuilt_ops_dir(), op_name, f"{op_name}.so")


def _loaded_ops() -> dict[str, Any]:
    """DeepSpeed's process-wide table of loaded ops (its own ``load()`` returns what is found there)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    return OpBuilder._loaded_ops


def _installed_with_deepspeed(op_name: str) -> bool:
    """Whether DeepSpeed itself was installed with this op prebuilt (``DS_BUILD_AIO=1`` and the like)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(op_name, False)) and accelerator_name == get_accelerator()._name


def load_op(builder_name: str) -> tuple[Any | None, str | None]:
    """``(op module, None)`` or ``(None, reason)`` for one of DeepSpeed's ops; never compiles."""
    op_name = _OP_NAMES[builder_name]
    try:
        from deepspeed.ops import op_builder
    except ImportError as err:
        return None, f"DeepSpeed is not installed ({err})"
    _quiet_tbw_notice()
    with _op_load_lock:
        loaded = _loaded_ops().get(op_name)
        if loaded is not None:
            return loaded, None
        try:
            if _installed_with_deepspeed(op_name):  # imports DeepSpeed's prebuilt module
                with _quiet_native_output():
                    return getattr(op_builder, builder_name)().load(verbose=False), None
        except Exception as err:  # a prebuilt op that does not import raises many kinds of errors
            log.debug("DeepSpeed's prebuilt %s op does not load", op_name, exc_info=True)
            return None, f"DeepSpeed's prebuilt {op_name} op does not load ({type(err).__name__})"
        order_path = _load_order_path(op_name)
        if not os.path.exists(order_path):
            log.debug("no prebuilt %s op: %s does not exist", op_name, order_path)
            return None, (
                f"DeepSpeed's {op_name} op is not built for this environment ({sys.prefix}); "
                f"build it once with `{BUILD_COMMAND}`"
            )
        try:
            with open(order_path) as stream:
                order = json.load(stream)["load_order"]
            for name in order:
                module = _import_prebuilt(name, global_symbols=name != op_name)
        except Exception as err:  # a stale or foreign build: ImportError, OSError, undefined symbols
            log.debug("the prebuilt %s op in %s does not load", op_name, prebuilt_ops_dir(), exc_info=True)
            return None, (
                f"DeepSpeed's {op_name} op built for this environment does not load "
                f"({type(err).__name__}); rebuild it with `{BUILD_COMMAND}`"
            )
        return module, None


def _load_order_path(op_name: str) -> str:
    """The file :func:`build_op` writes: which ops to load, dependencies first, for ``op_name``."""
    return os.path.join(prebuilt_ops_dir(), f"{op_name}.json")


def _import_prebuilt(op_name: str, global_symbols: bool) -> Any:
    """Import one prebuilt op and enter it in DeepSpeed's table, so DeepSpeed's own ``load()`` finds it
    instead of compiling. A dependency's symbols are made global first, as DeepSpeed does for the
    ``pin_memory`` op the ``async_io`` op of DeepSpeed 0.19 links against."""
    loaded = _loaded_ops().get(op_name)
    if loaded is not None:
        return loaded
    path = prebuilt_op_path(op_name)
    if global_symbols:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    spec = importlib.util.spec_from_file_location(op_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded_ops()[op_name] = module
    return module


def _quiet_tbw_notice() -> None:
    """Keep DeepSpeed's write-endurance notice (logged once per process on the first aio write) at
    debug level: it would otherwise reach every user on every checkpointing run."""
    try:
        import deepspeed.utils as ds_utils
    except ImportError:
        return
    if not getattr(ds_utils, _TBW_NOTICE_MARKER, False):
        setattr(ds_utils, _TBW_NOTICE_MARKER, True)
        log.debug("%s", _TBW_NOTICE)


def build_op(builder_name: str, verbose: bool = False) -> str:
    """Compile one of DeepSpeed's ops into :func:`prebuilt_ops_dir` (minutes); returns its path.

    Run once per environment at set-up (``python -m fastpersist.build_ops``), never by a save.

    Raises:
        RuntimeError: the op is not compatible with this machine, or the build failed.
    """
    from deepspeed.ops import op_builder

    op_name = _OP_NAMES[builder_name]
    builder = getattr(op_builder, builder_name)()
    with _op_load_lock, _parsable_arch_list():
        if not builder.is_compatible(verbose=verbose):
            raise RuntimeError(f"DeepSpeed's {op_name} op is not compatible with this machine")
        before = set(_loaded_ops())
        saved = os.environ.get("TORCH_EXTENSIONS_DIR")
        os.environ["TORCH_EXTENSIONS_DIR"] = prebuilt_ops_dir()
        try:
            builder.load(verbose=verbose)  # its dependencies first (DeepSpeed 0.19: pin_memory)
        finally:
            if saved is None:
                os.environ.pop("TORCH_EXTENSIONS_DIR", None)
            else:
                os.environ["TORCH_EXTENSIONS_DIR"] = saved
        order = [name for name in _loaded_ops() if name not in before]  # dicts keep insertion order
        if op_name not in order:
            raise RuntimeError(
                f"DeepSpeed's {op_name} op was loaded before this build; run it in a fresh process"
            )
        with open(_load_order_path(op_name) + ".tmp", "w") as stream:
            json.dump({"load_order": order}, stream)
        os.replace(_load_order_path(op_name) + ".tmp", _load_order_path(op_name))
    return prebuilt_op_path(op_name)


@contextlib.contextmanager
def _quiet_native_output() -> Iterator[None]:
    """Keep DeepSpeed's compatibility probes (which print) off the user's stdout."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


@functools.cache
def aio_op() -> tuple[Any | None, str | None]:
    """DeepSpeed's ``async_io`` op (loaded once, like an import), or ``None`` and the reason."""
    return load_op("AsyncIOBuilder")


@functools.cache
def gds_op() -> tuple[Any | None, str | None]:
    """DeepSpeed's ``gds`` op (NVIDIA GPUDirect Storage), or ``None`` and the reason."""
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    return load_op("GDSBuilder")


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


def config_params_dict(config_params: Any) -> dict[str, Any] | None:
    """The ds_config dict behind a ``DeepSpeedConfig`` (its private ``_param_dict``), a dict as given, or
    ``None`` when ``config_params`` holds none."""
    if isinstance(config_params, dict):
        return config_params
    config = getattr(config_params, "_param_dict", None)
    return config if isinstance(config, dict) else None


def ds_config_dict(ds_engine: Any) -> dict[str, Any]:
    """The ds_config as the user wrote it (a dict), for a DeepSpeed engine of any supported release."""
    config = config_params_dict(getattr(ds_engine, "_config", None))
    if config is not None:
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
