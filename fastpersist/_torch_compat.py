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
import types
from collections.abc import Callable
from typing import Any

import torch
import torch._utils as _utils
import torch.serialization as _serialization

from lightning_storage_plugins._torch_compat import LOAD_TAKES_WEIGHTS_ONLY as LOAD_TAKES_WEIGHTS_ONLY
from lightning_storage_plugins._torch_compat import LOCAL_HEADER_BYTES as LOCAL_HEADER_BYTES
from lightning_storage_plugins._torch_compat import RecordSizeError as RecordSizeError
from lightning_storage_plugins._torch_compat import StorageTable as StorageTable
from lightning_storage_plugins._torch_compat import changed_sources, saved_records
from lightning_storage_plugins._torch_compat import check_records as check_records
from lightning_storage_plugins._torch_compat import data_entries as data_entries
from lightning_storage_plugins._torch_compat import data_offset as data_offset
from lightning_storage_plugins._torch_compat import describe_reader_error as describe_reader_error
from lightning_storage_plugins._torch_compat import is_torchscript as is_torchscript
from lightning_storage_plugins._torch_compat import load_tensor_item as load_tensor_item
from lightning_storage_plugins._torch_compat import open_reader as open_reader
from lightning_storage_plugins._torch_compat import resolve_weights_only as resolve_weights_only
from lightning_storage_plugins._torch_compat import source_digest as source_digest
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


# SHA-256 (first 16 hex digits) of the source of each torch function :func:`reduce_plain_tensor`
# mirrors, for every torch whose version of it was read (2.6 and 2.15). Where one differs, tensors are
# reduced by torch's own ``Tensor.__reduce_ex__``, and the test suite fails until the new source is
# read and its digest added here.
MIRRORED_SAVE_SOURCES: dict[str, frozenset[str]] = {
    "torch.Tensor.__reduce_ex__": frozenset({"74dfa3adff0affbe"}),
    "torch.Tensor._reduce_ex_internal": frozenset({"1e7dba5bd3dec68a", "5baf461434defcfd"}),
    "torch._utils._get_obj_state": frozenset({"c43ff89e16b738a7", "b778ec87d6224276"}),
}
_MIRRORED_SAVE_FUNCTIONS = {
    "torch.Tensor.__reduce_ex__": torch.Tensor.__reduce_ex__,
    "torch.Tensor._reduce_ex_internal": torch.Tensor._reduce_ex_internal,
    "torch._utils._get_obj_state": _utils._get_obj_state,
}


@functools.cache
def unmirrored_save_functions() -> tuple[str, ...]:
    """The torch functions in :data:`MIRRORED_SAVE_SOURCES` whose installed source was not mirrored."""
    return changed_sources(_MIRRORED_SAVE_FUNCTIONS, MIRRORED_SAVE_SOURCES)


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
        self, file: Any, protocol: int, on_storage: Callable[[str, torch.UntypedStorage], None]
    ) -> None:
        super().__init__(file, protocol=protocol)
        mirrored = not unmirrored_save_functions()
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
