"""Every private torch serialization API fastpersist relies on, in one place, with feature detection.

torch.save and torch.load offer no public way to (a) learn where each storage's bytes sit in an
archive, (b) run torch.load's unpickling over bytes that are already in memory, or (c) pickle an
object exactly as torch.save does while handing its storages to someone else. This module does those
three things for every supported torch (2.6 and newer). Each private name used here is listed in
``PRIVATE_APIS`` and checked by ``tests/fastpersist/test_torch_compat.py``, which fails loudly when
torch changes one of them underneath us.

Saving mirrors ``torch.serialization._save``: the same pickle stream (``persistent_id`` tuples, storage
keys in first-seen order, the dtype-sharing check), so a fastpersist file's ``data.pkl`` is byte for
byte what torch.save would write. The archive around it is written by :mod:`fastpersist.archive`.
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Callable
from typing import Any

import torch
import torch.serialization as _serialization

TORCH_VERSION = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])

# (object, attribute) pairs this module touches; the test suite asserts each exists.
PRIVATE_APIS: tuple[tuple[Any, str], ...] = (
    (_serialization, "_load"),
    (_serialization, "_weights_only_unpickler"),
    (_serialization, "_default_to_weights_only"),
    (_serialization, "location_tag"),
    (_serialization, "normalize_storage_type"),
    (_serialization, "DEFAULT_PROTOCOL"),
    (torch.storage.TypedStorage, "_pickle_storage_type"),
    (torch.storage.TypedStorage, "_size"),
    (torch._C, "PyTorchFileReader"),
    (torch._C.PyTorchFileReader, "get_all_records"),
    (torch._C.PyTorchFileReader, "get_record"),
)

DEFAULT_PROTOCOL: int = _serialization.DEFAULT_PROTOCOL

# torch.load gained ``_load(..., weights_only=...)`` in 2.7; 2.6 passes no such argument.
LOAD_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(_serialization._load).parameters
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, up to the name

_TRUE_VALUES = ("1", "y", "yes", "true")


# ----------------------------------------------------------------------------------------------- save


class StoragePickler(pickle.Pickler):
    """torch.save's pickler: storages become ``("storage", type, key, location, numel)`` persistent ids.

    Mirrors ``persistent_id`` inside ``torch.serialization._save`` (identical in torch 2.6 to 2.15).
    ``on_storage(key, untyped_storage)`` is called the first time each storage is met, while pickling
    goes on, so its bytes can be written before the pickle is complete.
    """

    def __init__(
        self, file: Any, protocol: int, on_storage: Callable[[str, torch.UntypedStorage], None]
    ) -> None:
        super().__init__(file, protocol=protocol)
        self._on_storage = on_storage
        self._keys: dict[int, str] = {}
        self._dtypes: dict[int, torch.dtype] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            storage_dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            storage_numel = obj._size()
        elif torch.is_storage(obj):
            storage = obj
            storage_dtype = torch.uint8
            storage_type = _serialization.normalize_storage_type(type(obj))
            storage_numel = storage.nbytes()
        else:
            return None
        if str(storage.device) != "meta" and storage.data_ptr() != 0:
            known = self._dtypes.setdefault(storage.data_ptr(), storage_dtype)
            if known != storage_dtype:
                raise RuntimeError(
                    "Cannot save multiple tensors or storages that view the same data as different types"
                )
        key = self._keys.get(storage._cdata)
        if key is None:
            key = self._keys[storage._cdata] = str(len(self._keys))
            self._on_storage(key, storage)
        fake_device = getattr(obj, "_fake_device", None)
        location = str(fake_device) if fake_device is not None else _serialization.location_tag(storage)
        return ("storage", storage_type, key, location, storage_numel)


def dump_pickle(obj: Any, protocol: int, on_storage: Callable[[str, torch.UntypedStorage], None]) -> bytes:
    """``obj``'s ``data.pkl`` as torch.save would write it; storages go to ``on_storage`` as they are met."""
    buffer = io.BytesIO()
    StoragePickler(buffer, protocol, on_storage).dump(obj)
    return buffer.getvalue()


@functools.cache
def archive_records() -> tuple[tuple[str, bytes], ...]:
    """The small records torch.save writes besides ``data.pkl`` and storages, that loaders need.

    Read once from a real torch.save of an empty dict: the archive format ``version`` this torch
    produces, and ``byteorder``. (``.format_version`` and ``.storage_alignment`` are left out on
    purpose: they promise torch's own record layout, which fastpersist does not follow, and without
    them every torch finds storages through the zip directory.)
    """
    buffer = io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        by_name = {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()}
    return tuple((name, by_name[name]) for name in ("byteorder", "version") if name in by_name)


# ----------------------------------------------------------------------------------------------- load


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


def storage_records(path: str, include_empty: bool = False) -> list[tuple[int, int, str]]:
    """``(offset, size, name)`` of every ``data/`` record (non-empty ones only by default), in file order.

    Read from the zip central directory and each record's local header (the numbers torch's reader
    uses too) rather than ``PyTorchFileReader.get_record_offset``: that looks each name up with a
    linear scan, which is quadratic over a checkpoint of many tensors, and ``get_record_size`` does
    not exist before torch 2.7.

    Raises:
        zipfile.BadZipFile: a record is compressed, reaches past the end of the file, or overlaps
            another (torch's writer produces none of these; reading them would hand out bytes that are
            not the record's).
    """
    records = []
    with open(path, "rb") as stream, zipfile.ZipFile(stream) as archive:
        fd = stream.fileno()
        file_size = os.fstat(fd).st_size
        for info in archive.infolist():
            name = info.filename.split("/", 1)[-1]
            if not name.startswith("data/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise zipfile.BadZipFile(f"record {name} is compressed; torch stores storages uncompressed")
            header = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
            if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"no local header for {name} at offset {info.header_offset}")
            name_length, extra_length = _LOCAL_HEADER.unpack(header)[-2:]
            offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            if offset + info.file_size > file_size:
                raise zipfile.BadZipFile(
                    f"record {name} ({info.file_size} bytes at offset {offset}) ends past the end of the "
                    f"file ({file_size} bytes)"
                )
            records.append((offset, info.file_size, name))
    records.sort()
    end, previous = 0, ""
    for offset, size, name in records:
        if size and offset < end:
            raise zipfile.BadZipFile(f"record {name} at offset {offset} overlaps record {previous}")
        if size:
            end, previous = offset + size, name
    return records if include_empty else [record for record in records if record[1]]


class RecordSizeError(ValueError):
    """A storage record does not hold the bytes its tensor needs (``torch.load``: "record size does not
    match")."""


class StorageTable:
    """torch's zip reader with every storage record answered from bytes fastpersist has already read.

    ``torch.serialization._load`` asks ``get_storage_from_record(name, nbytes, ...)`` once per storage.
    The answer is the record's bytes only if the record holds exactly ``nbytes``; otherwise
    :class:`RecordSizeError`, as torch's own reader refuses such a record, so no caller ever sees
    bytes from outside the record (nor memory that no read filled). Lookups are by name in a dict,
    not through the reader's linear scan.

    Args:
        reader: torch's ``PyTorchFileReader`` of the archive (for everything but storages).
        records: every ``data/`` record, empty ones included (see :func:`storage_records`).
        storages: for each non-empty record, either a flat uint8 tensor of its bytes, or ``None`` to
            slice it out of ``whole`` (indexed by file offset).
        whole: one storage holding the file's bytes at their file offsets.
    """

    def __init__(
        self,
        reader: Any,
        records: list[tuple[int, int, str]],
        storages: dict[str, torch.Tensor] | None = None,
        whole: torch.UntypedStorage | None = None,
    ) -> None:
        self._reader = reader
        self._records = {name: (offset, size) for offset, size, name in records}
        self._storages = storages or {}
        self._whole = whole

    def get_storage_from_record(self, name: str, nbytes: int, dtype: Any) -> torch.Tensor:
        found = self._records.get(name)
        if found is None:
            raise RecordSizeError(f"the archive has no record {name}")
        offset, size = found
        if size != nbytes:
            raise RecordSizeError(f"record {name} holds {size} bytes, its storage needs {nbytes}")
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        preloaded = self._storages.get(name)
        if preloaded is not None:
            return preloaded
        if self._whole is None:
            raise RecordSizeError(f"record {name} was not read")
        return torch.empty(0, dtype=torch.uint8).set_(self._whole[offset : offset + size])

    def get_record_offset(self, name: str) -> int:
        found = self._records.get(name)
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


def unpickle(
    zip_reader: Any,
    map_location: Any,
    weights_only: bool,
    path: str,
    overall_storage: torch.UntypedStorage | None = None,
) -> Any:
    """torch.load's zip branch (``torch.serialization._load``) over storages already in memory.

    With ``weights_only``, files that hold only plain tensors, containers, dtypes and sizes are
    unpickled by the C unpickler restricted to those globals; everything else goes through torch's
    own weights-only unpickler, so what loads and what is refused is exactly torch's decision.

    Raises:
        WeightsOnlyError: ``weights_only`` refused the file (the message names ``path``).
    """
    load_args: dict[str, Any] = {"encoding": "utf-8"}
    if overall_storage is not None:
        load_args["overall_storage"] = overall_storage
    if not weights_only:
        if LOAD_TAKES_WEIGHTS_ONLY:
            load_args["weights_only"] = False
        return _serialization._load(zip_reader, map_location, pickle, **load_args)
    if LOAD_TAKES_WEIGHTS_ONLY:
        load_args["weights_only"] = True
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
