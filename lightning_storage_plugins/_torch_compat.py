"""The one place lightning_storage_plugins touches torch's private names.

Two things torch offers no public way to do, which the plugins share:

* **DCP's storage record.** torch.distributed.checkpoint keeps the per-item storage record of its
  file-system format private (``filesystem._StorageInfo``), yet every DCP storage that torch's
  readers and planners can read back stores exactly that record (:data:`StorageInfo`).
* **torch.load over bytes already in memory.** :func:`unpickle` runs torch.load's zip branch
  (``torch.serialization._load``) over a :class:`StorageTable` whose storages are slices of memory the
  caller filled (a FastPersist read buffer, a downloaded GCS object), so tensors can be views of that
  memory instead of copies. Loading plain tensors to the CPU mirrors ``_load`` in a loop of its own
  (:func:`_load_plain_tensors`), without torch's per-tensor fake-tensor checks, and without reading
  any storage's bytes, so it can run while they are still arriving.

Fast paths that mirror a torch function are chosen by what the installed torch does, not by its
version: :func:`mirror_holds` checks each mirror once per process, at its first use, against torch's
own function on probe tensors that take every branch the mirror takes (:func:`probe_state`). Where
one differs, only its path falls back to torch's function, with one debug-level log line naming it.

Each private name reached here is listed in ``PRIVATE_APIS``, and
``tests/lightning_storage_plugins/test_torch_compat.py`` checks every one against the installed torch,
so that a torch release that renames or reshapes one fails there, loudly and by name.
"""

from __future__ import annotations

import collections
import functools
import inspect
import io
import logging
import os
import pickle
import re
import struct
import sys
import threading
import warnings
import zipfile
from collections.abc import Callable
from typing import Any

import torch
import torch._utils as _utils
import torch.serialization as _serialization

from lightning_storage_plugins.memoryfile import MemoryFile
from lightning_storage_plugins.ziparchive import read_directory

log = logging.getLogger(__name__)

# What torch.load (and the loads here) raise for bytes that are not a well-formed torch archive; a
# plugin reports these as its InvalidCheckpointError, naming the checkpoint.
LOAD_FAILURES = (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, KeyError)

# (object, attribute) pairs of torch.load's internals this module touches; ``PRIVATE_APIS`` adds DCP's.
_LOAD_PRIVATE_APIS: tuple[tuple[Any, str], ...] = (
    (_serialization, "_load"),
    (_serialization, "_weights_only_unpickler"),
    (_serialization, "_default_to_weights_only"),
    (torch._C, "PyTorchFileReader"),
    (torch._C.PyTorchFileReader, "get_all_records"),
    (torch._C.PyTorchFileReader, "get_record"),
    (_serialization, "_maybe_decode_ascii"),
    (_serialization, "_serialization_tls"),
    (_serialization, "StorageType"),
    (_utils, "_rebuild_tensor"),
    (_utils, "_rebuild_tensor_v2"),
    (_utils, "_rebuild_tensor_v3"),
    (_utils, "_element_size"),
    (_utils, "set_tensor_metadata"),
    (torch._guards, "detect_fake_mode"),
    (torch._C, "StorageBase"),
    (torch.storage, "_dtype_to_storage_type_map"),
    (torch.storage, "_new_dtypes"),
    (torch, "_neg_view"),
    (_utils, "_get_obj_state"),
    (_serialization, "DEFAULT_PROTOCOL"),
)



def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint takes a second to import: only the DCP layers, which import it
    # anyway, pay for it, not every single-file load.
    from torch.distributed.checkpoint import filesystem as dcp_filesystem

    if name == "StorageInfo":
        # The storage record torch's FileSystemReader expects for every item: ``(relative_path,
        # offset, length)``, the first three fields, in that order (newer torch adds optional ones).
        return dcp_filesystem._StorageInfo
    if name == "PRIVATE_APIS":
        # (object, attribute) pairs this module touches; the test suite asserts each exists.
        return ((dcp_filesystem, "_StorageInfo"), *_LOAD_PRIVATE_APIS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Fast paths that mirror torch ----------------------------------------------------------------------
_verdicts: dict[str, bool] = {}
_verdicts_lock = threading.RLock()  # a check may ask for another's verdict


def mirror_holds(function: str, differs: Callable[[], str | None]) -> bool:
    """Whether the fast path that mirrors torch's ``function`` (a dotted name) may run in this process.

    The first call for ``function`` runs ``differs()``, which gives the mirror and torch's own function
    the same probe inputs (see :func:`probe_state`) and returns ``None`` where every result is torch's,
    else what differed. The verdict holds for the life of the process. A mirror that differs (or whose
    check fails) is off: its callers use torch's function instead, and one debug-level line names
    ``function``. Safety never rests on a verdict: what a fast load accepts is what torch's
    ``weights_only`` rules accept, whichever path runs.
    """
    verdict = _verdicts.get(function)
    if verdict is not None:
        return verdict
    with _verdicts_lock:
        verdict = _verdicts.get(function)
        if verdict is None:
            try:
                with warnings.catch_warnings():  # probes of experimental dtypes make torch warn
                    warnings.simplefilter("ignore")
                    difference = differs()
            except Exception as err:  # a probe this torch handles otherwise: the mirror is not its behaviour
                difference = f"the check raised {type(err).__name__}: {err}"
            verdict = difference is None
            if not verdict:
                log.debug("torch %s: %s does not behave as mirrored (%s); its fast path is off, torch's own "
                          "function runs instead", torch.__version__, function, difference)
            _verdicts[function] = verdict
    return verdict


def mirror_verdicts() -> dict[str, bool]:
    """The verdicts :func:`mirror_holds` has reached in this process, by torch function."""
    with _verdicts_lock:
        return dict(_verdicts)


_QUANTIZED = ("torch.qint", "torch.quint")


def _probe_dtypes() -> list[torch.dtype]:
    """Every dtype of plain tensors this torch saves: through ``_rebuild_tensor_v2`` (typed storages)
    and ``v3`` (quantized tensors take a path of their own)."""
    found = [dtype for dtype in torch.storage._dtype_to_storage_type_map() if not str(dtype).startswith(_QUANTIZED)]
    return found + [dtype for dtype in torch.storage._new_dtypes() if dtype not in found]


def _probe_tensor(dtype: torch.dtype, numel: int = 3) -> torch.Tensor:
    """``numel`` elements of ``dtype`` with distinct bytes (valid ones for ``bool``)."""
    raw = torch.arange(1, numel * dtype.itemsize + 1, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def probe_state() -> dict[str, Any]:
    """A state dict that takes every branch of the mirrored save and load paths.

    Every dtype this torch saves; one storage under several tensors (the same tensor twice, slices
    at offsets, transposed and stepped views, one storage seen in several shapes); 0-dim and 0-size
    tensors; ``requires_grad``; Parameters, trainable and frozen; conjugate and negative bits; and the
    containers and values a checkpoint holds around them (an ``OrderedDict`` with attributes, as
    ``Module.state_dict`` returns, nested lists and tuples, ints of every width, floats, strings,
    ``torch.Size``, dtypes, and a dict of more than a pickler's batch of items).
    """
    base = torch.arange(24, dtype=torch.float32)
    weights = collections.OrderedDict(
        [("base", base), ("same", base), ("slice", base[3:11]), ("transposed", base.view(4, 6).t()),
         ("stepped", base[::5]), ("reshaped", base.view(2, 3, 4)), ("scalar", torch.tensor(2.5)),
         ("empty", torch.zeros(0)), ("empty_2d", torch.zeros(3, 0, dtype=torch.int64)),
         ("requires_grad", torch.ones(3, requires_grad=True)),
         ("parameter", torch.nn.Parameter(torch.ones(2, 2))),
         ("frozen", torch.nn.Parameter(torch.ones(2), requires_grad=False)),
         ("conj", torch.tensor([1 + 2j, 3 - 1j]).conj()), ("neg", torch._neg_view(torch.tensor([1.0, -2.0])))]
    )  # fmt: skip
    weights._metadata = collections.OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    wide = _probe_tensor(torch.int64, 6)
    return {
        "weights": weights,
        "dtypes": [_probe_tensor(dtype) for dtype in _probe_dtypes()],
        "views": (wide, wide[2:], wide.view(2, 3)[:, 1]),
        "values": [None, True, False, 0, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 2**31, 2**70, -(2**70),
                   0.5, "", "text", "ünï", torch.Size([2, 3]), torch.float16, (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
        "batched": {index: index for index in range(1001)},
        "empty": ({}, [], ()),
    }


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes() if storage.nbytes() else b""


def load_difference(got: Any, want: Any) -> str | None:
    """What differs between two loaded objects (``None``: nothing): types, values (of tensors, the
    bytes of their storages), container order and attributes, and of each tensor its dtype, shape,
    strides, offset, device, autograd flags, bits, hooks, Python attributes and which other tensors
    share its storage."""
    pairs: dict[int, int] = {}  # got's storages to want's, one to one
    taken: set[int] = set()

    def compare(g: Any, w: Any, where: str) -> str | None:
        if type(g) is not type(w):
            return f"{where or 'the object'}: a {type(g).__name__}, torch gives a {type(w).__name__}"
        if isinstance(w, torch.Tensor):
            return compare_tensors(g, w, where)
        if isinstance(w, dict):
            if list(g) != list(w):
                return f"{where}: keys {list(g)}, torch gives {list(w)}"
            if getattr(g, "__dict__", {}) != getattr(w, "__dict__", {}):
                return f"{where}: attributes {vars(g)}, torch gives {vars(w)}"
            children = [(g[key], w[key], f"{where}[{key!r}]") for key in w]
        elif isinstance(w, (list, tuple)):
            if len(g) != len(w):
                return f"{where}: {len(g)} items, torch gives {len(w)}"
            children = [(gi, wi, f"{where}[{index}]") for index, (gi, wi) in enumerate(zip(g, w, strict=True))]
        else:
            return None if g == w else f"{where}: {g!r}, torch gives {w!r}"
        return next((found for found in (compare(*child) for child in children) if found), None)

    def compare_tensors(g: torch.Tensor, w: torch.Tensor, where: str) -> str | None:
        for what, of_g, of_w in (
            ("dtype", g.dtype, w.dtype), ("shape", g.shape, w.shape), ("stride", g.stride(), w.stride()),
            ("offset", g.storage_offset(), w.storage_offset()), ("device", g.device, w.device),
            ("requires_grad", g.requires_grad, w.requires_grad), ("leaf", g.is_leaf, w.is_leaf),
            ("view", g._is_view(), w._is_view()), ("conj", g.is_conj(), w.is_conj()), ("neg", g.is_neg(), w.is_neg()),
            ("hooks", g._backward_hooks, w._backward_hooks),
            ("attributes", _utils._get_obj_state(g), _utils._get_obj_state(w)),
            ("storage size", g.untyped_storage().nbytes(), w.untyped_storage().nbytes()),
        ):  # fmt: skip
            if type(of_g) is not type(of_w) or of_g != of_w:
                return f"{where}: {what} {of_g!r}, torch gives {of_w!r}"
        mine, theirs = g.untyped_storage()._cdata, w.untyped_storage()._cdata
        if mine in pairs:
            if pairs[mine] != theirs:
                return f"{where}: shares a storage that torch's tensors do not share"
        elif theirs in taken:
            return f"{where}: has a storage of its own where torch's shares one"
        else:
            pairs[mine] = theirs
            taken.add(theirs)
            if _storage_bytes(g) != _storage_bytes(w):
                return f"{where}: its bytes differ from torch's"
        return None

    return compare(got, want, "")


# torch.load gained ``_load(..., weights_only=...)`` in 2.7; 2.6 passes no such argument.
LOAD_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(_serialization._load).parameters
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, up to the name
LOCAL_HEADER_BYTES = _LOCAL_HEADER.size
_LOCAL_SIGNATURE_AND_LENGTHS = struct.Struct("<I22xHH")  # what locating a record's bytes needs of it
_LOCAL_SIGNATURE = 0x04034B50

_TRUE_VALUES = ("1", "y", "yes", "true")

def default_weights_only() -> bool:
    """torch.load's ``weights_only`` when the caller passes none (environment overrides included)."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES:
        return True
    if os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES:
        return False
    return bool(_serialization._default_to_weights_only(None))


def resolve_weights_only(weights_only: bool | None) -> bool:
    """An explicit choice as given (unless torch is forced to weights-only); ``None``: torch's default."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES:
        return True
    return default_weights_only() if weights_only is None else bool(weights_only)


def open_reader(source: str | Any) -> Any:
    """torch's own zip reader over ``source``: a path (C++ file I/O, not a Python stream) or a readable,
    seekable binary file object (``read``/``readinto``/``seek``/``tell``)."""
    return torch._C.PyTorchFileReader(source)


def data_entries(entries: list[Any], file_size: int) -> dict[str, tuple[int, int]]:
    """``name -> (local header offset, size)`` of the ``data/`` records of a zip directory.

    Raises:
        zipfile.BadZipFile: a record is compressed, or its local header would start past the file's end.
    """
    found = {}
    for entry in entries:
        if not entry.name.startswith("data/"):
            continue
        if entry.method != zipfile.ZIP_STORED or entry.compressed_size != entry.size:
            raise zipfile.BadZipFile(f"record {entry.name} is compressed; torch stores storages uncompressed")
        if entry.header_offset + _LOCAL_HEADER.size > file_size:
            raise zipfile.BadZipFile(f"no local header for {entry.name} at offset {entry.header_offset}")
        found[entry.name] = (entry.header_offset, entry.size)
    return found


def data_offset(buffer: Any, at: int, header_offset: int, name: str) -> int:
    """Where a record's bytes start, from its local header found at ``buffer[at:]``.

    Raises:
        zipfile.BadZipFile: no local header there.
    """
    if len(buffer) < at + _LOCAL_HEADER.size:
        raise zipfile.BadZipFile(f"no local header for {name} at offset {header_offset}")
    signature, name_length, extra_length = _LOCAL_SIGNATURE_AND_LENGTHS.unpack_from(buffer, at)
    if signature != _LOCAL_SIGNATURE:
        raise zipfile.BadZipFile(f"no local header for {name} at offset {header_offset}")
    return header_offset + _LOCAL_HEADER.size + name_length + extra_length


def check_records(records: list[tuple[int, int, str]], file_size: int) -> None:
    """Refuse records (sorted by offset) that end past ``file_size`` or overlap one another.

    Raises:
        zipfile.BadZipFile: naming the first such record.
    """
    end, previous = 0, ""
    for offset, size, name in records:
        if offset + size > file_size:
            raise zipfile.BadZipFile(
                f"record {name} ({size} bytes at offset {offset}) ends past the end of the "
                f"file ({file_size} bytes)"
            )
        if size and offset < end:
            raise zipfile.BadZipFile(f"record {name} at offset {offset} overlaps record {previous}")
        if size:
            end, previous = offset + size, name


class RecordSizeError(ValueError):
    """A storage record does not hold the bytes its tensor needs (``torch.load``: "record size does not
    match")."""


# ``UntypedStorage.__getitem__`` without the Python-level check for meta storages (ours are in memory).
_slice_storage = torch._C.StorageBase.__getitem__


class StorageTable:
    """torch's zip reader with every storage record answered from bytes fastpersist has read.

    ``torch.serialization._load`` asks ``get_storage_from_record(name, nbytes, ...)`` once per storage
    (the plain-tensor loop asks :meth:`storage`). The answer is the record's bytes only if the record
    holds exactly ``nbytes``; otherwise :class:`RecordSizeError`, as torch's own reader refuses such a
    record, so no caller ever sees bytes from outside the record (nor memory that no read filled).
    Lookups are by name, not through the reader's linear scan.

    Args:
        reader: torch's ``PyTorchFileReader`` of the archive (for everything but storages).
        locate: ``name -> (offset, size)`` of a ``data/`` record's bytes, ``None`` for no such record.
        storages: for each non-empty record, either a flat uint8 tensor of its bytes, or absent to
            slice it out of ``whole`` (indexed by file offset).
        whole: one storage holding the file's bytes at their file offsets.
    """

    def __init__(
        self,
        reader: Any,
        locate: Callable[[str], tuple[int, int] | None],
        storages: dict[str, torch.Tensor] | None = None,
        whole: torch.UntypedStorage | None = None,
    ) -> None:
        self._reader = reader
        self._locate = locate
        self._storages = storages or {}
        self._whole = whole

    def storage(self, name: str, nbytes: int) -> torch.UntypedStorage:
        """Record ``name``'s bytes, which must be exactly ``nbytes`` (else :class:`RecordSizeError`)."""
        found = self._locate(name)
        if found is None:
            raise RecordSizeError(f"the archive has no record {name}")
        offset, size = found
        if size != nbytes:
            raise RecordSizeError(f"record {name} holds {size} bytes, its storage needs {nbytes}")
        if size == 0:
            return torch.UntypedStorage(0)
        preloaded = self._storages.get(name)
        if preloaded is not None:
            return preloaded.untyped_storage()
        if self._whole is None:
            raise RecordSizeError(f"record {name} was not read")
        return _slice_storage(self._whole, slice(offset, offset + size))

    def get_storage_from_record(self, name: str, nbytes: int, dtype: Any) -> torch.Tensor:
        storage = self.storage(name, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def get_record_offset(self, name: str) -> int:
        found = self._locate(name)
        return found[0] if found is not None else self._reader.get_record_offset(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._reader, attr)


def is_torchscript(reader: Any) -> bool:
    """Whether the archive is a TorchScript module (torch.load hands those to torch.jit.load)."""
    return "constants.pkl" in reader.get_all_records()


class _OutsideFastPath(pickle.UnpicklingError):
    """The pickle names a global the fast weights-only path does not resolve."""


# Globals a state dict of plain tensors needs. The fast path resolves only those of them that torch's
# own weights-only unpickler allows too (checked at run time), so it never permits more than torch.
_FAST_GLOBALS = (
    "collections.OrderedDict",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter",
    "torch.Size",
    "torch.device",
    "builtins.set",
    "builtins.frozenset",
)


@functools.cache
def _fast_allowed_globals() -> dict[str, Any]:
    from torch import _weights_only_unpickler as wou

    allowed = dict(wou._get_allowed_globals())
    fast = {name: allowed[name] for name in _FAST_GLOBALS if name in allowed}
    fast.update({name: obj for name, obj in allowed.items() if isinstance(obj, torch.dtype)})
    return fast


class _FastWeightsOnlyUnpickler(pickle.Unpickler):
    """The C unpickler with globals restricted to plain-tensor rebuilding (Python's documented way of
    restricting unpickling); anything else raises :class:`_OutsideFastPath`."""

    def find_class(self, module: str, name: str) -> Any:
        found = _fast_allowed_globals().get(f"{module}.{name}")
        if found is None:
            raise _OutsideFastPath(f"{module}.{name}")
        return found


_FAST_PICKLE_MODULE = type(pickle)("fastpersist_weights_only")
_FAST_PICKLE_MODULE.Unpickler = _FastWeightsOnlyUnpickler  # type: ignore[attr-defined]


class WeightsOnlyError(pickle.UnpicklingError):
    """``weights_only`` loading refused something in the file."""


class _NotMirrored(Exception):
    """The plain-tensor loop met a case whose rules differ between torch versions (a record referred
    to again as another dtype, an empty record referred to twice, a storage placed off the CPU):
    torch's own ``_load`` decides it."""


_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _prototype(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``dtype`` on ``device``: its ``new_empty((0,))`` is ``torch.empty((0,),
    dtype=dtype, device=device)`` at a third of the cost."""
    prototype = _EMPTY.get((dtype, device))
    if prototype is None:
        prototype = _EMPTY[(dtype, device)] = torch.empty((0,), dtype=dtype, device=device)
    return prototype


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` without its fake-mode device fix-up, which does nothing
    outside a fake mode (the plain-tensor loop runs only outside one) and costs three pytree walks
    per tensor."""
    untyped = storage._untyped_storage
    dtype, device = storage.dtype, untyped.device
    prototype = _EMPTY.get((dtype, device))
    if prototype is None:
        prototype = _prototype(dtype, device)
    tensor = prototype.new_empty((0,)).set_(untyped, storage_offset, size, stride)
    tensor.requires_grad = requires_grad
    if metadata:
        _utils.set_tensor_metadata(tensor, metadata)
    # As torch: weights-only pickles can only hold an empty OrderedDict of hooks here.
    tensor._backward_hooks = backward_hooks
    return tensor


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v3`` without its fake-mode device fix-up (see
    :func:`_rebuild_tensor_v2`)."""
    untyped = storage._untyped_storage
    tensor = _prototype(dtype, untyped.device).new_empty((0,), requires_grad=requires_grad)
    tensor.set_(untyped, storage_offset, size, stride)
    if metadata:
        _utils.set_tensor_metadata(tensor, metadata)
    tensor._backward_hooks = backward_hooks
    return tensor


_REBUILD_MIRRORS = {"_rebuild_tensor_v2": _rebuild_tensor_v2, "_rebuild_tensor_v3": _rebuild_tensor_v3}


def _probe_tensors() -> list[torch.Tensor]:
    """The plain tensors of :func:`probe_state` (Parameters rebuild through their data)."""
    found: list[torch.Tensor] = []
    stack: list[Any] = [probe_state()]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item.data if isinstance(item, torch.nn.Parameter) else item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _rebuild_differs(name: str) -> Callable[[], str | None]:
    """The check of our mirror of ``torch._utils.<name>``: both rebuild each probe tensor that torch
    reduces to that function, from the arguments torch reduces it to."""

    def differs() -> str | None:
        theirs, mine = getattr(_utils, name), _REBUILD_MIRRORS[name]
        rebuilt = 0
        for index, tensor in enumerate(_probe_tensors()):
            function, args = tensor.__reduce_ex__(_serialization.DEFAULT_PROTOCOL)
            if getattr(function, "__name__", None) != name:
                continue
            rebuilt += 1
            if isinstance(args[0], torch.UntypedStorage):  # as torch.load hands it over
                args = (torch.storage.TypedStorage(wrap_storage=args[0], dtype=torch.uint8, _internal=True), *args[1:])
            found = load_difference(mine(*args), theirs(*args))
            if found is not None:
                return f"probe tensor {index} ({tensor.dtype}){found}"
        return None if rebuilt else "no probe tensor is rebuilt by it"

    return differs


def _loop_differs() -> str | None:
    """The check of the plain-tensor loop: it and ``torch.load(weights_only=True)`` load the same
    ``torch.save`` archive of the probe state."""
    buffer = io.BytesIO()
    torch.save(probe_state(), buffer)
    data = bytearray(buffer.getvalue())
    whole = torch.frombuffer(data, dtype=torch.uint8)
    table = _memory_table(memoryview(data), whole.untyped_storage())
    if table is None:
        return "torch.save's archive of the probes is not one the loop reads"
    want = torch.load(io.BytesIO(data), weights_only=True)
    return load_difference(_load_plain_tensors(table, None), want)


def _rebuild_functions() -> dict[str, Any]:
    """Each rebuild function the loop resolves: our mirror where it holds, else torch's own."""
    return {
        f"torch._utils.{name}": mirror if mirror_holds(f"torch._utils.{name}", _rebuild_differs(name))
        else getattr(_utils, name)
        for name, mirror in _REBUILD_MIRRORS.items()
    }


@functools.cache
def _plain_tensor_globals() -> dict[str, Any]:
    """The fast path's globals, plus torch's storage types, with the rebuild functions mirrored where
    the mirrors hold (each resolved only where torch's own weights-only unpickler allows it)."""
    from torch import _weights_only_unpickler as wou

    found = dict(_fast_allowed_globals())
    allowed = wou._get_allowed_globals()
    found.update({name: obj for name, obj in allowed.items()
                  if isinstance(obj, _serialization.StorageType) or obj is torch.UntypedStorage})
    found.update({name: function for name, function in _rebuild_functions().items() if name in found})
    return found


class _PlainTensorUnpickler(pickle.Unpickler):
    """The C unpickler restricted to :func:`_plain_tensor_globals` (each one torch's weights-only
    unpickler allows too); anything else raises :class:`_OutsideFastPath`."""

    def find_class(self, module: str, name: str) -> Any:
        found = _plain_tensor_globals().get(f"{module}.{name}")
        if found is None:
            raise _OutsideFastPath(f"{module}.{name}")
        return found


_LOAD_ENDIANNESS_BYTEORDER = {
    None: "little",
    _serialization.LoadEndianness.LITTLE: "little",
    _serialization.LoadEndianness.BIG: "big",
    _serialization.LoadEndianness.NATIVE: sys.byteorder,
}
LOOP_MIRRORS = "torch.serialization._load"  # what the plain-tensor loop mirrors (persistent_load, load_tensor)


def _plain_tensor_loop_applies(zip_reader: Any, map_location: Any) -> bool:
    """Whether ``torch.serialization._load`` would, for this archive and ``map_location``, do nothing
    per storage but slice its record, wrap it in a ``TypedStorage`` and keep it on the CPU (and the
    loop that does only that holds on this torch)."""
    if not isinstance(zip_reader, StorageTable):
        return False
    on_cpu = (
        map_location is None
        or (type(map_location) is str and map_location == "cpu")
        or (isinstance(map_location, torch.device) and map_location.type == "cpu" and map_location.index is None)
    )
    if not on_cpu or getattr(_serialization._serialization_tls, "skip_data", False):
        return False
    if torch._guards.detect_fake_mode(None) is not None:
        return False
    if zip_reader.has_record("byteorder"):
        byteorder = zip_reader.get_record("byteorder")
    else:
        byteorder = _LOAD_ENDIANNESS_BYTEORDER.get(_serialization.get_default_load_endianness(), "").encode()
    if byteorder != sys.byteorder.encode():
        return False
    probe = torch.UntypedStorage(0)
    if _serialization.default_restore_location(probe, "cpu") is not probe:
        return False
    return mirror_holds(LOOP_MIRRORS, _loop_differs)


def _load_plain_tensors(table: StorageTable, map_location: Any) -> Any:
    """``torch.serialization._load`` for a pickle of plain CPU tensors, without its per-tensor costs.

    Mirrors ``_load``'s ``persistent_load`` and ``load_tensor`` for the case
    :func:`_plain_tensor_loop_applies` admits: a storage is its record's bytes, which must be exactly
    ``numel * element size`` (else :class:`RecordSizeError`), wrapped in a ``TypedStorage``; one record
    referred to by several tensors is one storage, so they share memory as torch.load's do. Where torch
    versions disagree (see :class:`_NotMirrored`) it gives up, and torch's ``_load`` decides.

    Raises:
        _OutsideFastPath: the pickle names a global outside :func:`_plain_tensor_globals`.
        _NotMirrored: see above.
        RecordSizeError: a record does not hold its storage's bytes.
    """
    loaded: dict[Any, torch.storage.TypedStorage] = {}
    empty_keys: set[Any] = set()
    kinds: dict[Any, tuple[torch.dtype, int]] = {}  # storage type -> its dtype and element size
    storage_of = table.storage
    typed_storage, new_object = torch.storage.TypedStorage, object.__new__
    untyped_type, storage_types = torch.UntypedStorage, _serialization.StorageType

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        if type(saved_id) is tuple and len(saved_id) == 5 and saved_id[0] == "storage":
            storage_type, key, location, numel = saved_id[1:]
        else:
            if not isinstance(saved_id, tuple):
                raise AssertionError(f"saved_id must be a tuple, got {type(saved_id).__name__}")
            typename = _serialization._maybe_decode_ascii(saved_id[0])
            if typename != "storage":
                raise AssertionError(
                    f"Unknown typename for persistent_load, expected 'storage' but got '{typename}'"
                )
            storage_type, key, location, numel = saved_id[1:]
        kind = kinds.get(storage_type) if type(storage_type) is storage_types or storage_type is untyped_type else None
        if kind is None:
            if type(storage_type) is not storage_types and storage_type is not untyped_type:
                raise _NotMirrored("a storage type that is not one")
            dtype = torch.uint8 if storage_type is untyped_type else storage_type.dtype
            kind = kinds[storage_type] = (dtype, _utils._element_size(dtype))
        dtype, element_size = kind
        cached = loaded.get(key)
        if cached is not None:
            if cached.dtype != dtype:
                raise _NotMirrored("a record referred to as two dtypes")
            if type(numel) is not int:  # newer torch computes its size before looking in its cache
                raise _NotMirrored("an element count that is not a number")
            return cached
        if key in empty_keys:
            raise _NotMirrored("an empty record referred to twice")
        if location != "cpu":
            if map_location is None and _serialization._maybe_decode_ascii(location) != "cpu":
                raise _NotMirrored(f"a storage saved on {location!r}")
        untyped = storage_of(f"data/{key}", numel * element_size)
        # TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True), less its argument checks
        typed = new_object(typed_storage)
        typed.dtype, typed._untyped_storage = dtype, untyped
        if untyped.nbytes():
            loaded[key] = typed
        else:
            empty_keys.add(key)
        return typed

    unpickler = _PlainTensorUnpickler(io.BytesIO(table.get_record("data.pkl")), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load()


def _nothing() -> None:
    return None


def unpickle(
    zip_reader: Any,
    map_location: Any,
    weights_only: bool,
    path: str,
    overall_storage: torch.UntypedStorage | None = None,
    data_ready: Callable[[], None] = _nothing,
) -> Any:
    """torch.load's zip branch (``torch.serialization._load``) over storages already in memory.

    With ``weights_only``, files that hold only plain tensors, containers, dtypes and sizes are
    unpickled by the C unpickler restricted to those globals; everything else goes through torch's
    own weights-only unpickler, so what loads and what is refused is exactly torch's decision. For
    CPU loads through a :class:`StorageTable`, that C unpickler runs in a loop of ours (see
    :func:`_load_plain_tensors`), which never reads a storage's bytes: the caller may still be
    reading them, and is told through ``data_ready`` before anything else here may read them.

    Raises:
        WeightsOnlyError: ``weights_only`` refused the file (the message names ``path``).
    """
    outside_fast_path = False
    if weights_only and overall_storage is None and _plain_tensor_loop_applies(zip_reader, map_location):
        try:
            return _load_plain_tensors(zip_reader, map_location)
        except _OutsideFastPath:
            outside_fast_path = True
        except _NotMirrored:
            pass
    data_ready()
    load_args: dict[str, Any] = {"encoding": "utf-8"}
    if overall_storage is not None:
        load_args["overall_storage"] = overall_storage
    if not weights_only:
        if LOAD_TAKES_WEIGHTS_ONLY:
            load_args["weights_only"] = False
        return _serialization._load(zip_reader, map_location, pickle, **load_args)
    if LOAD_TAKES_WEIGHTS_ONLY:
        load_args["weights_only"] = True
    if not outside_fast_path:
        try:
            return _serialization._load(zip_reader, map_location, _FAST_PICKLE_MODULE, **load_args)
        except _OutsideFastPath:
            pass
    try:
        return _serialization._load(
            zip_reader, map_location, _serialization._weights_only_unpickler, **load_args
        )
    except pickle.UnpicklingError as err:
        raise WeightsOnlyError(
            f"weights-only load of {path} refused: {err}\nLoad with weights_only=False only if you trust "
            "the file's source, or allow the global with torch.serialization.add_safe_globals()."
        ) from None


def load_tensor_item(data: memoryview, storage: torch.UntypedStorage, where: str) -> Any:
    """``torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)`` for one ``torch.save``
    archive in memory (a DCP tensor item), its storages views of ``storage`` (the same bytes: no copy).

    A DCP checkpoint holds one such archive per tensor item, so what torch's reader and ``_load``
    cost per archive is paid per item. A well-formed archive of plain CPU tensors that this torch can
    read is read here, from its zip directory, by the plain-tensor loop (:func:`_load_plain_tensors`);
    anything else goes to torch's reader and :func:`unpickle`, so what loads and what is refused stays
    torch's decision.

    Raises:
        RecordSizeError: a record does not hold the bytes its storage needs (the message names
            ``where``).
        WeightsOnlyError: weights-only loading refused the item.
    """
    return _load_views(_memory_table(data, storage), data, storage, "cpu", True, where)


def load_archive(data: memoryview, storage: torch.UntypedStorage, map_location: Any, weights_only: bool | None,
                 where: str) -> Any:
    """``torch.load`` of the checkpoint whose bytes are ``data`` (the bytes of ``storage``), with its
    CPU tensors views of ``storage`` instead of copies, as ``torch.load(mmap=True)`` makes them views
    of a file: the memory lives as long as one of them does.

    A stored, well-formed zip archive this torch can read goes through :func:`unpickle`, so what loads
    and what is refused stays torch's decision; anything else (torch's legacy format, a TorchScript
    archive, compressed or damaged records, a newer archive version) goes to ``torch.load`` itself,
    which copies.

    Raises:
        RecordSizeError: a record does not hold the bytes its storage needs (the message names ``where``).
        WeightsOnlyError: weights-only loading refused something in the checkpoint.
    """
    weights_only = resolve_weights_only(weights_only)
    table = _memory_table(data, storage)
    if table is None or table.has_record("constants.pkl"):
        return torch.load(MemoryFile(data), map_location=map_location, weights_only=weights_only)
    return _load_views(table, data, storage, map_location, weights_only, where)


def _load_views(table: StorageTable | None, data: memoryview, storage: torch.UntypedStorage, map_location: Any,
                weights_only: bool, where: str) -> Any:
    """The archive in ``data`` (the bytes of ``storage``; ``table``: :func:`_memory_table` of it) loaded
    with its storages views of ``storage``: by the plain-tensor loop where it applies, else by torch's
    reader and :func:`unpickle`."""
    if table is not None and weights_only and _plain_tensor_loop_applies(table, map_location):
        try:
            return _load_plain_tensors(table, map_location)
        except (_OutsideFastPath, _NotMirrored):
            pass
        except RecordSizeError as err:
            raise RecordSizeError(f"{where}: {err}") from None
    return unpickle(open_reader(MemoryFile(data)), map_location, weights_only, where, overall_storage=storage)


class _MemoryArchive:
    """The records of a zip archive in memory, answering what the plain-tensor loop asks torch's
    reader for (``data.pkl``, ``byteorder``)."""

    def __init__(self, data: memoryview, records: dict[str, tuple[int, int]]) -> None:
        self._data = data
        self._records = records

    def has_record(self, name: str) -> bool:
        return name in self._records

    def get_record(self, name: str) -> bytes:
        offset, size = self._records[name]
        return bytes(self._data[offset : offset + size])


def _memory_table(data: memoryview, storage: torch.UntypedStorage) -> StorageTable | None:
    """A :class:`StorageTable` over the archive in ``data`` (records at their offsets in ``storage``);
    ``None`` where torch's own reader must decide: a damaged or compressed archive, no ``data.pkl``,
    or an archive format version newer than this torch writes."""
    size = len(data)
    try:
        records = {}
        for entry in read_directory(lambda length, offset: bytes(data[offset : offset + length]), size):
            if entry.method != zipfile.ZIP_STORED or entry.compressed_size != entry.size:
                return None
            records[entry.name] = (data_offset(data, entry.header_offset, entry.header_offset, entry.name), entry.size)
        check_records(sorted((offset, length, name) for name, (offset, length) in records.items()), size)
    except zipfile.BadZipFile:
        return None
    if "data.pkl" not in records:
        return None
    archive = _MemoryArchive(data, records)
    # This torch reads every archive format version up to the one it writes.
    written = int(saved_records()["version"])
    versions = [archive.get_record(name).strip() for name in ("version", ".data/version") if name in records]
    if not versions or not all(version.isdigit() and 0 < int(version) <= written for version in versions):
        return None
    return StorageTable(archive, records.get, whole=storage)


@functools.cache
def saved_records() -> dict[str, bytes]:
    """The records of a real ``torch.save`` of an empty dict (``version``, ``byteorder``, ...), by
    name without the archive folder: what this torch writes around a pickle."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()}


_NEWER_VERSION = re.compile(r"version (\d+), but the maximum supported version for reading is (\d+)")


def describe_reader_error(err: BaseException) -> str:
    """A plain reason for a failure of torch's zip reader (torch's C++ messages are long)."""
    text = str(err)
    newer = _NEWER_VERSION.search(text)
    if newer:
        return (
            f"written by a newer torch (archive format version {newer.group(1)}; torch "
            f"{torch.__version__} reads up to {newer.group(2)})"
        )
    if "central directory" in text:
        return "truncated or damaged (its zip directory is missing)"
    first_line = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return f"damaged archive ({first_line[:200]})"
