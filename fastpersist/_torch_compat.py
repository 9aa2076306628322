"""Every private torch serialization API fastpersist's saving relies on, in one place.

torch.save offers no public way to (a) learn where each storage's bytes sit in an archive, or (b)
pickle an object exactly as torch.save does while handing its storages to someone else. This module
does both for every supported torch (2.6 and newer). Each private name used here is listed in
``PRIVATE_APIS`` and checked by ``tests/fastpersist/test_torch_compat.py``, which fails loudly when
torch changes one of them underneath us. Loading (torch.load over bytes already in memory) is shared
with the other plugins and lives in :mod:`lightning_storage_plugins._torch_compat`; its names are
re-exported here for fastpersist's modules.

Saving mirrors ``torch.serialization._save``: the same pickle stream (``persistent_id`` tuples, storage
keys in first-seen order, the dtype-sharing check), so a fastpersist file's ``data.pkl`` is byte for
byte what torch.save would write. The archive around it is written by :mod:`fastpersist.archive`.
"""

from __future__ import annotations

import collections
import copyreg
import functools
import io
import os
import pickle
import struct
import types
import zipfile
from collections.abc import Callable
from typing import Any

import torch
import torch._utils as _utils
import torch.serialization as _serialization

from lightning_storage_plugins._torch_compat import LOAD_TAKES_WEIGHTS_ONLY as LOAD_TAKES_WEIGHTS_ONLY
from lightning_storage_plugins._torch_compat import LOCAL_HEADER_BYTES as LOCAL_HEADER_BYTES
from lightning_storage_plugins._torch_compat import RecordSizeError as RecordSizeError
from lightning_storage_plugins._torch_compat import StorageTable as StorageTable
from lightning_storage_plugins._torch_compat import check_records as check_records
from lightning_storage_plugins._torch_compat import data_entries as data_entries
from lightning_storage_plugins._torch_compat import data_offset as data_offset
from lightning_storage_plugins._torch_compat import describe_reader_error as describe_reader_error
from lightning_storage_plugins._torch_compat import is_torchscript as is_torchscript
from lightning_storage_plugins._torch_compat import load_tensor_item as load_tensor_item
from lightning_storage_plugins._torch_compat import mirror_holds, probe_state, saved_records
from lightning_storage_plugins._torch_compat import open_reader as open_reader
from lightning_storage_plugins._torch_compat import resolve_weights_only as resolve_weights_only
from lightning_storage_plugins._torch_compat import unpickle as unpickle
from lightning_storage_plugins.ziparchive import read_directory

# (object, attribute) pairs this module touches; the test suite asserts each exists.
PRIVATE_APIS: tuple[tuple[Any, str], ...] = (
    (_serialization, "location_tag"),
    (_serialization, "normalize_storage_type"),
    (_serialization, "DEFAULT_PROTOCOL"),
    (torch.storage.TypedStorage, "_pickle_storage_type"),
    (torch.storage.TypedStorage, "_size"),
    (torch.storage, "_new_dtypes"),
    (torch.Tensor, "_reduce_ex_internal"),
    (_serialization, "_serialization_tls"),
    (_utils, "_get_obj_state"),
    (_utils, "_rebuild_tensor_v2"),
    (_utils, "_rebuild_tensor_v3"),
)

DEFAULT_PROTOCOL: int = _serialization.DEFAULT_PROTOCOL


# ----------------------------------------------------------------------------------------------- save


# Exact types (not subclasses) that are never storages, the bulk of what a state dict pickles.
_NEVER_STORAGES = frozenset({str, int, float, bool, type(None), tuple, list, dict, bytes, collections.OrderedDict,
                             torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype, torch.device, type,
                             types.FunctionType, types.BuiltinFunctionType})


REDUCE_MIRRORS = "torch.Tensor._reduce_ex_internal"  # what reduce_plain_tensor mirrors


def _pickle_of(obj: Any, mirrored: bool) -> bytes:
    buffer = io.BytesIO()
    StoragePickler(buffer, DEFAULT_PROTOCOL, lambda key, storage: None, mirrored=mirrored).dump(obj)
    return buffer.getvalue()


def _reducer_differs() -> str | None:
    """Where :func:`reduce_plain_tensor` pickles the probe tensors otherwise than torch's own
    ``Tensor.__reduce_ex__`` (``None``: nowhere)."""
    probes = probe_state()
    theirs = _pickle_of(probes, mirrored=False)
    ours = _pickle_of(probes, mirrored=True)
    if ours != theirs:
        at = next(index for index, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
        return f"the probe pickles differ from byte {at}"
    return None


def reducer_holds() -> bool:
    """Whether :func:`reduce_plain_tensor` reduces tensors as this torch does (checked once per process)."""
    return mirror_holds(REDUCE_MIRRORS, _reducer_differs)


_NAMED_TENSORS = hasattr(torch.Tensor, "has_names")  # gone from newer torch


@functools.cache
def _v3_dtypes() -> frozenset[torch.dtype]:
    return frozenset(torch.storage._new_dtypes())


def reduce_plain_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """``tensor.__reduce_ex__(protocol)``, for an exact ``torch.Tensor``, without its per-call checks
    for every other kind of tensor.

    Mirrors the branch of ``Tensor.__reduce_ex__`` that every dense CPU or CUDA tensor without Python
    attributes or hooks takes (the ``else`` of ``_reduce_ex_internal``): the same rebuild function and
    the same arguments, so the pickle is byte for byte torch.save's. Any other tensor, and every
    tensor under torch's ``skip_data``, goes to ``Tensor.__reduce_ex__`` itself, as do all tensors
    where torch's source is not the one mirrored.
    """
    if (
        _utils._get_obj_state(tensor)  # as torch asks (reading ``__dict__`` would give each tensor one)
        or tensor._backward_hooks
        or tensor.device.type not in ("cpu", "cuda")
        or tensor.layout is not torch.strided
        or tensor.is_quantized
        or tensor.is_nested
        or (_NAMED_TENSORS and tensor.has_names())  # torch 2.6 refuses to save them
        or _serialization._serialization_tls.skip_data
    ):
        return tensor.__reduce_ex__(DEFAULT_PROTOCOL)
    if tensor.dtype in _v3_dtypes():
        rebuild: Any = _utils._rebuild_tensor_v3
        storage: Any = tensor.untyped_storage()
    else:
        rebuild = _utils._rebuild_tensor_v2
        storage = torch.storage.TypedStorage(
            wrap_storage=tensor.untyped_storage(), dtype=tensor.dtype, _internal=True
        )
    args: tuple[Any, ...] = (
        storage,
        tensor.storage_offset(),
        tuple(tensor.size()),
        tensor.stride(),
        tensor.requires_grad,
        collections.OrderedDict(),
    )
    if rebuild is _utils._rebuild_tensor_v3:
        args = (*args, tensor.dtype)
    metadata = _utils.get_tensor_metadata(tensor)
    if metadata:
        args = (*args, metadata)
    return rebuild, args


class StoragePickler(pickle.Pickler):
    """torch.save's pickler: storages become ``("storage", type, key, location, numel)`` persistent ids.

    Mirrors ``persistent_id`` inside ``torch.serialization._save`` (identical in torch 2.6 to 2.15).
    ``on_storage(key, untyped_storage)`` is called the first time each storage is met, while pickling
    goes on, so its bytes can be written before the pickle is complete. Plain tensors are reduced by
    :func:`reduce_plain_tensor` (through the pickler's own ``dispatch_table``, which otherwise holds
    what ``copyreg`` registered, as torch.save's pickler sees it).
    """

    def __init__(
        self, file: Any, protocol: int, on_storage: Callable[[str, torch.UntypedStorage], None],
        *, mirrored: bool | None = None,
    ) -> None:
        super().__init__(file, protocol=protocol)
        if mirrored is None:
            mirrored = reducer_holds()
        if mirrored and protocol == DEFAULT_PROTOCOL and torch.Tensor not in copyreg.dispatch_table:
            self.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: reduce_plain_tensor}
        self._on_storage = on_storage
        self._keys: dict[int, str] = {}
        self._dtypes: dict[int, torch.dtype] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _NEVER_STORAGES:  # the pickler asks about every object: answer most at once
            return None
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


class _NotPlain(Exception):
    """An object :class:`_DirectPickle` does not write: the pickler writes the whole object."""


_BATCH = 1000  # the pickler's batch of list items or dict entries
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_F64 = struct.Struct(">d")
_TUPLE_OF = (b"", b"\x85", b"\x86", b"\x87")  # TUPLE1, TUPLE2, TUPLE3


@functools.cache
def _global_opcode(obj: Any) -> bytes:
    """The ``GLOBAL`` opcode the pickler writes for ``obj`` (a class, function or dtype) at protocol 2."""
    pickled = pickle.dumps(obj, protocol=DEFAULT_PROTOCOL)
    opcode = pickled[2:-3]
    if not (pickled.endswith(b"q\x00.") and opcode.startswith(b"c") and opcode.count(b"\n") == 2):
        raise _NotPlain(f"{obj!r} pickles otherwise")  # an extension code, or a reduction of its own
    return opcode


class _DirectPickle:
    """``torch.save``'s ``data.pkl`` of a plain checkpoint, written opcode by opcode.

    A plain checkpoint is made of exact dicts, ``OrderedDict``s (attributes included, as
    ``Module.state_dict`` returns them), lists, tuples, strings, ints, floats, bools, ``None``, dtypes
    and plain CPU tensors (those :func:`reduce_plain_tensor` reduces itself). This writes what
    torch.save's pickler writes for them at protocol 2 (the memo numbered as the pickler numbers it:
    by object identity, every tuple and reduced object included) without the pickler's calls into
    Python for every object (``persistent_id``, the reducers), which cost more than the pickling
    itself. Anything else raises :class:`_NotPlain`; storages met before it have been handed to
    ``on_storage`` (as the pickler hands them over, the first time each is met), and a pickler given
    :attr:`keys` and :attr:`dtypes` carries on from there.
    """

    def __init__(self, on_storage: Callable[[str, torch.UntypedStorage], None] = lambda key, storage: None) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self._gets: dict[int, bytes] = {}  # id -> BINGET of the objects whose identity the pickler sees
        self._kept: list[Any] = []  # those objects, alive until the end so that no other takes an id
        self._count = 0  # memo indices used, ours and those of the fresh objects torch's reducer makes
        self._on_storage = on_storage
        self.keys: dict[int, str] = {}
        self.dtypes: dict[int, torch.dtype] = {}
        self._v3 = _v3_dtypes()

    def dump(self, obj: Any) -> bytes:
        if _serialization._serialization_tls.skip_data or {torch.Tensor, collections.OrderedDict} & set(copyreg.dispatch_table):
            raise _NotPlain("tensors or OrderedDicts are reduced otherwise here")
        self._save(obj)
        self.out += b"."
        return bytes(self.out)

    def _put(self) -> None:
        self.out += _put_opcode(self._count)
        self._count += 1

    def _memoize(self, obj: Any) -> None:
        self._gets[id(obj)] = _get_opcode(self._count)
        self._kept.append(obj)
        self._put()

    def _global(self, obj: Any) -> None:
        got = self._gets.get(id(obj))
        if got is None:
            self.out += _global_opcode(obj)
            self._memoize(obj)
        else:
            self.out += got

    def _int(self, value: int) -> None:
        self.out += _int_opcode(value)

    def _save(self, obj: Any) -> None:
        kind = type(obj)
        if kind is int:
            self._int(obj)
            return
        if obj is None:
            self.out += b"N"
            return
        if kind is bool:
            self.out += b"\x88" if obj else b"\x89"
            return
        if kind is float:
            self.out += b"G" + _F64.pack(obj)
            return
        got = self._gets.get(id(obj))
        if got is not None:
            self.out += got
        elif kind is str:
            encoded = obj.encode("utf-8", "surrogatepass")
            self.out += b"X" + _U32.pack(len(encoded)) + encoded
            self._memoize(obj)
        elif kind is torch.Tensor:
            self._tensor(obj)
        elif kind is dict:
            self._dict(obj)
        elif kind is list:
            self._list(obj)
        elif kind is tuple:
            self._tuple(obj)
        elif kind is collections.OrderedDict:
            self._ordered_dict(obj)
        elif kind is torch.dtype:
            self._global(obj)
        else:
            raise _NotPlain(kind.__name__)

    def _tuple(self, items: tuple[Any, ...]) -> None:
        if not items:
            self.out += b")"
            return
        if len(items) > 3:
            self.out += b"("
        for item in items:
            self._save(item)
        if id(items) in self._gets:
            raise _NotPlain("a recursive tuple")
        self.out += _TUPLE_OF[len(items)] if len(items) <= 3 else b"t"
        self._memoize(items)

    def _list(self, items: list[Any]) -> None:
        self.out += b"]"
        self._memoize(items)
        if len(items) == 1:
            self._save(items[0])
            self.out += b"a"
            return
        for start in range(0, len(items), _BATCH):
            self.out += b"("
            for item in items[start : start + _BATCH]:
                self._save(item)
            self.out += b"e"

    def _dict(self, mapping: dict[Any, Any]) -> None:
        self.out += b"}"
        self._memoize(mapping)
        # One snapshot of the items, taken at once: a caller's thread may change the dict while it is
        # written (Lightning 2.5's AsyncCheckpointIO hands over ModelCheckpoint's live state).
        items = list(mapping.items())
        if len(items) == 1:
            self._save(items[0][0])
            self._save(items[0][1])
            self.out += b"s"
        elif items:
            # A full batch is followed by another, even an empty one (the pickler's loop for exact dicts).
            for start in range(0, len(items) // _BATCH * _BATCH + 1, _BATCH):
                self._items(items[start : start + _BATCH])

    def _items(self, items: list[tuple[Any, Any]]) -> None:
        self.out += b"("
        save = self._save
        for key, value in items:
            save(key)
            save(value)
        self.out += b"u"

    def _ordered_dict(self, mapping: collections.OrderedDict[Any, Any]) -> None:
        # OrderedDict.__reduce__: (OrderedDict, (), state, None, iter(items)), state its attributes or None
        state = mapping.__dict__ or None
        self._global(collections.OrderedDict)
        self.out += b")R"
        if id(mapping) in self._gets:
            raise _NotPlain("a recursive OrderedDict")
        self._memoize(mapping)
        items = list(mapping.items())
        start = 0
        while start < len(items):  # the pickler's loop for other mappings: no empty batch at the end
            if len(items) - start == 1:
                self._save(items[start][0])
                self._save(items[start][1])
                self.out += b"s"
                break
            self._items(items[start : start + _BATCH])
            start += _BATCH
        if state is not None:
            self._save(state)
            self.out += b"b"

    def _tensor(self, tensor: torch.Tensor) -> None:
        """``reduce_plain_tensor``'s reduction of a CPU tensor, its storage's persistent id in it."""
        if (
            not tensor.is_cpu
            or _utils._get_obj_state(tensor)
            or tensor._backward_hooks
            or tensor.layout is not torch.strided
            or tensor.is_quantized
            or tensor.is_nested
            or (_NAMED_TENSORS and tensor.has_names())
        ):
            raise _NotPlain("a tensor reduce_plain_tensor leaves to torch")
        dtype = tensor.dtype
        v3 = dtype in self._v3
        rebuild = _utils._rebuild_tensor_v3 if v3 else _utils._rebuild_tensor_v2
        storage_type = torch.UntypedStorage if v3 else _storage_type(dtype)
        gets = self._gets
        constants = (gets.get(id(rebuild)), gets.get(id("storage")), gets.get(id(storage_type)),
                     gets.get(id("cpu")), gets.get(id(collections.OrderedDict)))
        if None in constants or (v3 and id(dtype) not in gets):
            self._first_tensor(tensor, dtype, v3, rebuild, storage_type)
            return
        rebuild_get, storage_get, type_get, cpu_get, hooks_get = constants
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        numel = nbytes if v3 else nbytes // dtype.itemsize
        key = self._storage_key(storage, torch.uint8 if v3 else dtype)
        count = self._count
        key_get = gets.get(id(key))
        if key_get is None:
            encoded = key.encode()
            key_part = b"X" + _U32.pack(len(encoded)) + encoded + _put_opcode(count)
            gets[id(key)] = _get_opcode(count)
            self._kept.append(key)
            count += 1
        else:
            key_part = key_get
        size, stride = tuple(tensor.size()), tensor.stride()
        parts = [rebuild_get, b"((", storage_get, type_get, key_part, cpu_get, _int_opcode(numel), b"t",
                 _put_opcode(count), b"Q", _int_opcode(tensor.storage_offset())]
        count += 1
        for ints in (size, stride):
            if ints:
                parts.append(_ints_tuple(ints))
                parts.append(_put_opcode(count))
                count += 1
            else:
                parts.append(b")")
        parts += (b"\x88" if tensor.requires_grad else b"\x89", hooks_get, b")R", _put_opcode(count))
        count += 1
        self.out += b"".join(parts)
        self._count = count
        self._end_tensor(tensor, dtype, v3)

    def _first_tensor(self, tensor: torch.Tensor, dtype: torch.dtype, v3: bool, rebuild: Any,
                      storage_type: Any) -> None:
        """:meth:`_tensor` where the objects every tensor refers to are not in the memo yet."""
        self._global(rebuild)
        self.out += b"("
        storage = tensor.untyped_storage()
        key = self._storage_key(storage, torch.uint8 if v3 else dtype)
        self.out += b"("
        self._save("storage")
        self._global(storage_type)
        self._save(key)
        self._save("cpu")  # what location_tag gives every CPU storage
        self._int(storage.nbytes() if v3 else storage.nbytes() // dtype.itemsize)
        self.out += b"t"
        self._put()
        self.out += b"Q"
        self._int(tensor.storage_offset())
        for ints in (tuple(tensor.size()), tensor.stride()):
            if ints:
                self.out += _ints_tuple(ints)
                self._put()
            else:
                self.out += b")"
        self.out += b"\x88" if tensor.requires_grad else b"\x89"
        self._global(collections.OrderedDict)  # the empty OrderedDict of hooks
        self.out += b")R"
        self._put()
        self._end_tensor(tensor, dtype, v3)

    def _end_tensor(self, tensor: torch.Tensor, dtype: torch.dtype, v3: bool) -> None:
        """The reduction's last arguments (the dtype of a ``_rebuild_tensor_v3``, the conjugate and
        negative bits), its tuple and the tensor."""
        if v3:
            self._global(dtype)
        metadata = _utils.get_tensor_metadata(tensor)
        if metadata:
            self._save(metadata)
        self.out += b"t"
        self._put()
        self.out += b"R"
        self._memoize(tensor)

    def _storage_key(self, storage: torch.UntypedStorage, storage_dtype: torch.dtype) -> str:
        """The storage's key (a new one the first time it is met), as ``StoragePickler.persistent_id``
        gives it."""
        address = storage.data_ptr()
        if address and self.dtypes.get(address, storage_dtype) != storage_dtype:
            raise _NotPlain("a storage seen as two dtypes")  # the pickler raises torch's error for it
        key = self.keys.get(storage._cdata)
        if key is None:
            if address:
                self.dtypes[address] = storage_dtype
            key = self.keys[storage._cdata] = str(len(self.keys))
            self._on_storage(key, storage)
        return key


def _put_opcode(index: int) -> bytes:
    return _PUTS[index] if index < 256 else b"r" + _U32.pack(index)


def _get_opcode(index: int) -> bytes:
    return _GETS[index] if index < 256 else b"j" + _U32.pack(index)


_INT_OPCODES: dict[int, bytes] = {}


def _int_opcode(value: int) -> bytes:
    """The pickler's opcode for an int (``BININT1``, ``BININT2``, ``BININT``, ``LONG1``, ``LONG4``)."""
    found = _INT_OPCODES.get(value)
    if found is not None:
        return found
    if 0 <= value < 256:
        found = b"K" + value.to_bytes(1, "little")
    elif 0 <= value < 65536:
        found = b"M" + value.to_bytes(2, "little")
    elif -0x80000000 <= value <= 0x7FFFFFFF:
        found = b"J" + _I32.pack(value)
    else:
        encoded = pickle.encode_long(value)
        if len(encoded) < 256:
            found = b"\x8a" + len(encoded).to_bytes(1, "little") + encoded
        else:
            found = b"\x8b" + _I32.pack(len(encoded)) + encoded
    if len(_INT_OPCODES) < 65536:  # sizes and strides repeat; keep the cache bounded all the same
        _INT_OPCODES[value] = found
    return found


_TUPLE_OPCODES: dict[tuple[int, ...], bytes] = {}


def _ints_tuple(ints: tuple[int, ...]) -> bytes:
    """A non-empty tuple of ints as the pickler writes it, up to its ``BINPUT``."""
    found = _TUPLE_OPCODES.get(ints)
    if found is None:
        body = b"".join(map(_int_opcode, ints))
        found = body + _TUPLE_OF[len(ints)] if len(ints) <= 3 else b"(" + body + b"t"
        if len(_TUPLE_OPCODES) < 65536:
            _TUPLE_OPCODES[ints] = found
    return found


_PUTS = [b"q" + bytes((index,)) for index in range(256)]  # BINPUT
_GETS = [b"h" + bytes((index,)) for index in range(256)]  # BINGET
_BININT1 = [b"K" + bytes((value,)) for value in range(256)]


@functools.cache
def _storage_type(dtype: torch.dtype) -> Any:
    """The legacy storage class torch.save names for a typed storage of ``dtype``."""
    typed = torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(0), dtype=dtype, _internal=True)
    return getattr(torch, typed._pickle_storage_type())


WRITER_MIRRORS = "torch.serialization._save"  # what _DirectPickle mirrors (the pickler and persistent_id)


def _direct_probe() -> dict[str, Any]:
    """:func:`probe_state` less what :class:`_DirectPickle` leaves to the pickler (Parameters, sizes)."""
    probes = probe_state()
    weights = probes["weights"]
    plain = collections.OrderedDict((key, value) for key, value in weights.items() if type(value) is torch.Tensor)
    plain.__dict__.update(weights.__dict__)
    probes["weights"] = plain
    probes["values"] = [value for value in probes["values"] if type(value) is not torch.Size]
    return probes


def _writer_differs() -> str | None:
    """Where :class:`_DirectPickle` writes the probes' pickle otherwise than torch.save does."""
    probes = _direct_probe()
    buffer = io.BytesIO()
    torch.save(probes, buffer)
    with zipfile.ZipFile(buffer) as archive:
        theirs = archive.read(next(name for name in archive.namelist() if name.endswith("/data.pkl")))
    try:
        ours = _DirectPickle().dump(probes)
    except _NotPlain as err:
        return f"the probes were left to the pickler ({err})"
    if ours != theirs:
        at = next((index for index, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
        return f"the probe pickles differ from byte {at}"
    return None


def direct_writer_holds() -> bool:
    """Whether :class:`_DirectPickle` writes what torch.save writes on this torch (checked once per
    process, after the reducer it mirrors too)."""
    return reducer_holds() and mirror_holds(WRITER_MIRRORS, _writer_differs)


def dump_pickle(obj: Any, protocol: int, on_storage: Callable[[str, torch.UntypedStorage], None]) -> bytes:
    """``obj``'s ``data.pkl`` as torch.save would write it; storages go to ``on_storage`` as the pickle
    first refers to them, while pickling goes on.

    A plain checkpoint's pickle is written directly (:class:`_DirectPickle`); where the direct writer
    meets anything else, the pickler starts over and carries on with the storages already handed out.
    """
    pickler_state: tuple[dict[int, str], dict[int, torch.dtype]] | None = None
    if protocol == DEFAULT_PROTOCOL and direct_writer_holds():
        writer = _DirectPickle(on_storage)
        try:
            return writer.dump(obj)
        except (_NotPlain, RecursionError):
            pickler_state = writer.keys, writer.dtypes
    buffer = io.BytesIO()
    pickler = StoragePickler(buffer, protocol, on_storage)
    if pickler_state is not None:
        pickler._keys, pickler._dtypes = pickler_state
    pickler.dump(obj)
    return buffer.getvalue()


@functools.cache
def archive_records() -> tuple[tuple[str, bytes], ...]:
    """The small records torch.save writes besides ``data.pkl`` and storages, that loaders need.

    Read once from a real torch.save of an empty dict: the archive format ``version`` this torch
    produces, and ``byteorder``. (``.format_version`` and ``.storage_alignment`` are left out on
    purpose: they promise torch's own record layout, which fastpersist does not follow, and without
    them every torch finds storages through the zip directory.)
    """
    by_name = saved_records()
    return tuple((name, by_name[name]) for name in ("byteorder", "version") if name in by_name)


# ----------------------------------------------------------------------------------------------- load


def storage_records(path: str, include_empty: bool = False) -> list[tuple[int, int, str]]:
    """``(offset, size, name)`` of every ``data/`` record (non-empty ones only by default), in file order.

    Read from the zip central directory and each record's local header (the numbers torch's reader
    uses too) rather than ``PyTorchFileReader.get_record_offset``: that looks each name up with a
    linear scan, which is quadratic over a checkpoint of many tensors, and ``get_record_size`` does
    not exist before torch 2.7. Each local header is one small read; ``fastpersist_load``'s direct
    path instead finds them in the bytes it reads anyway (see :func:`data_entries`, :func:`check_records`).

    Raises:
        zipfile.BadZipFile: a record is compressed, reaches past the end of the file, or overlaps
            another (torch's writer produces none of these; reading them would hand out bytes that are
            not the record's).
    """
    with open(path, "rb") as stream:
        fd = stream.fileno()
        file_size = os.fstat(fd).st_size
        entries = data_entries(read_directory(fd, file_size), file_size)
        records = []
        for name, (header_offset, size) in entries.items():
            header = os.pread(fd, LOCAL_HEADER_BYTES, header_offset)
            records.append((data_offset(header, 0, header_offset, name), size, name))
    records.sort()
    check_records(records, file_size)
    return records if include_empty else [record for record in records if record[1]]
