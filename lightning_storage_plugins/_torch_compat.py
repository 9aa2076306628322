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
  any storage's bytes, so it can run while they are still arriving. The torch sources it mirrors are
  pinned by digest in ``MIRRORED_SOURCES``; a torch whose sources differ gets torch's ``_load``.

Each private name reached here is listed in ``PRIVATE_APIS``, and
``tests/lightning_storage_plugins/test_torch_compat.py`` checks every one against the installed torch,
so that a torch release that renames or reshapes one fails there, loudly and by name.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import os
import pickle
import re
import struct
import sys
import zipfile
from collections.abc import Callable
from typing import Any

import torch
import torch._utils as _utils
import torch.serialization as _serialization

from lightning_storage_plugins.memoryfile import MemoryFile
from lightning_storage_plugins.ziparchive import read_directory

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


# SHA-256 (first 16 hex digits) of the source of each torch function the plain-tensor loop mirrors
# (see ``_load_plain_tensors``), for every torch whose version of it was read and mirrored. Where
# one differs, that torch gets ``torch.serialization._load`` instead, and the test suite fails
# until the new version is read and added here.
MIRRORED_SOURCES: dict[str, frozenset[str]] = {
    "torch.serialization._load": frozenset({"3d297b3b0aa1464c", "8f01a99f7324f2ac"}),
    "torch._utils._rebuild_tensor": frozenset({"f5acf47aa0dcb87b"}),
    "torch._utils._rebuild_tensor_v2": frozenset({"2282ad8a7acdbb46", "8033137e4761a0ef"}),
    "torch._utils._rebuild_tensor_v3": frozenset({"5f3c1ab6e02e2f60", "4a9b016245ff84fc"}),
}
_MIRRORED_FUNCTIONS = {
    "torch.serialization._load": _serialization._load,
    "torch._utils._rebuild_tensor": _utils._rebuild_tensor,
    "torch._utils._rebuild_tensor_v2": _utils._rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _utils._rebuild_tensor_v3,
}


def source_digest(function: Callable[..., Any]) -> str | None:
    """The first 16 hex digits of the SHA-256 of ``function``'s source (``None`` without source)."""
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return None


def changed_sources(
    functions: dict[str, Callable[..., Any]], mirrored: dict[str, frozenset[str]]
) -> tuple[str, ...]:
    """The names in ``functions`` whose installed source's digest is not among ``mirrored[name]``."""
    return tuple(name for name, function in functions.items() if source_digest(function) not in mirrored[name])


@functools.cache
def unmirrored_functions() -> tuple[str, ...]:
    """The torch functions in :data:`MIRRORED_SOURCES` whose installed source was not mirrored."""
    return changed_sources(_MIRRORED_FUNCTIONS, MIRRORED_SOURCES)

# torch.load gained ``_load(..., weights_only=...)`` in 2.7; 2.6 passes no such argument.
LOAD_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(_serialization._load).parameters
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, up to the name
LOCAL_HEADER_BYTES = _LOCAL_HEADER.size

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
    if len(buffer) < at + _LOCAL_HEADER.size or buffer[at : at + 4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local header for {name} at offset {header_offset}")
    name_length, extra_length = _LOCAL_HEADER.unpack_from(buffer, at)[-2:]
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
        return self._whole[offset : offset + size]

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
    tensor = torch.empty((0,), dtype=storage.dtype, device=storage._untyped_storage.device)
    tensor = tensor.set_(storage._untyped_storage, storage_offset, size, stride)
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
    tensor = torch.empty(
        (0,), dtype=dtype, device=storage._untyped_storage.device, requires_grad=requires_grad
    )
    tensor.set_(storage._untyped_storage, storage_offset, size, stride)
    if metadata:
        _utils.set_tensor_metadata(tensor, metadata)
    tensor._backward_hooks = backward_hooks
    return tensor


@functools.cache
def _plain_tensor_globals() -> dict[str, Any]:
    """The fast path's globals, plus torch's storage types, with the rebuild functions mirrored."""
    from torch import _weights_only_unpickler as wou

    found = dict(_fast_allowed_globals())
    allowed = wou._get_allowed_globals()
    found.update({name: obj for name, obj in allowed.items() if isinstance(obj, _serialization.StorageType)})
    for name, mirror in (
        ("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2),
        ("torch._utils._rebuild_tensor_v3", _rebuild_tensor_v3),
    ):
        if name in found:
            found[name] = mirror
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


def _plain_tensor_loop_applies(zip_reader: Any, map_location: Any) -> bool:
    """Whether ``torch.serialization._load`` would, for this archive and ``map_location``, do nothing
    per storage but slice its record, wrap it in a ``TypedStorage`` and keep it on the CPU."""
    if not isinstance(zip_reader, StorageTable) or unmirrored_functions():
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
    return _serialization.default_restore_location(probe, "cpu") is probe


def _load_plain_tensors(table: StorageTable, map_location: Any) -> Any:
    """``torch.serialization._load`` for a pickle of plain CPU tensors, without its per-tensor costs.

    Mirrors ``_load``'s ``persistent_load`` and ``load_tensor`` (torch 2.6 to 2.15: the sources listed
    in :data:`MIRRORED_SOURCES`) for the case :func:`_plain_tensor_loop_applies` admits: a storage
    is its record's bytes, which must be exactly ``numel * element size`` (else
    :class:`RecordSizeError`), wrapped in a ``TypedStorage``; one record referred to by several
    tensors is one storage, so they share memory as torch.load's do. Where torch versions disagree
    (see :class:`_NotMirrored`) it gives up, and torch's ``_load`` decides.

    Raises:
        _OutsideFastPath: the pickle names a global outside :func:`_plain_tensor_globals`.
        _NotMirrored: see above.
        RecordSizeError: a record does not hold its storage's bytes.
    """
    loaded: dict[Any, torch.storage.TypedStorage] = {}
    empty_keys: set[Any] = set()

    def persistent_load(saved_id: Any) -> torch.storage.TypedStorage:
        if not isinstance(saved_id, tuple):
            raise AssertionError(f"saved_id must be a tuple, got {type(saved_id).__name__}")
        typename = _serialization._maybe_decode_ascii(saved_id[0])
        data = saved_id[1:]
        if typename != "storage":
            raise AssertionError(
                f"Unknown typename for persistent_load, expected 'storage' but got '{typename}'"
            )
        storage_type, key, location, numel = data
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        cached = loaded.get(key)
        if cached is not None:
            if cached.dtype != dtype:
                raise _NotMirrored("a record referred to as two dtypes")
            try:  # newer torch computes this before looking in its cache
                numel * _utils._element_size(dtype)
            except Exception:
                raise _NotMirrored("an element count that is not a number") from None
            return cached
        if key in empty_keys:
            raise _NotMirrored("an empty record referred to twice")
        nbytes = numel * _utils._element_size(dtype)
        location = _serialization._maybe_decode_ascii(location)
        if map_location is None and location != "cpu":
            raise _NotMirrored(f"a storage saved on {location!r}")
        untyped = table.storage(f"data/{key}", nbytes)
        typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
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
    table = _memory_table(data, storage)
    if table is not None and _plain_tensor_loop_applies(table, "cpu"):
        try:
            return _load_plain_tensors(table, "cpu")
        except (_OutsideFastPath, _NotMirrored):
            pass
        except RecordSizeError as err:
            raise RecordSizeError(f"{where}: {err}") from None
    return unpickle(open_reader(MemoryFile(data)), "cpu", True, where, overall_storage=storage)


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
