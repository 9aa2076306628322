"""SmartRedis' ``Dataset`` (named tensors plus metadata) and how a dataset is laid out on Redis.

On Redis a dataset is laid out as SmartRedis 0.6.1 lays it out (see ``ACK_FIELD`` below), so that
datasets put by SmartRedis clients in any language are read here and the reverse. Every key of a
dataset shares the ``{name}`` hash tag (one shard in a cluster); a put is one MULTI/EXEC, so a reader
here sees the old dataset or the new one, never half.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis

from smartredis_io._client import _redispy, wire
from smartredis_io._client.connection import Database
from smartredis_io._client.helpers import typecheck
from smartredis_io.error import RedisKeyError, RedisRuntimeError
from smartredis_io.srobject import SRObject

__all__ = ["Dataset"]

META_SCALAR_DTYPES = tuple(np.dtype(t) for t in ("f8", "f4", "i4", "i8", "u4", "u8"))
META_SUFFIX = ".meta"


# How SmartRedis' to_string() names types, for str(dataset)
_TYPE_NAMES = {
    "float64": "double", "float32": "float", "float16": "half", "int8": "8 bit signed integer",
    "int16": "16 bit signed integer", "int32": "32 bit signed integer", "int64": "64 bit signed integer",
    "uint8": "8 bit unsigned integer", "uint16": "16 bit unsigned integer", "uint32": "32 bit unsigned integer",
    "uint64": "64 bit unsigned integer", "bool": "boolean",
}


def _type_name(dtype: np.dtype) -> str:
    return "bfloat16" if wire.is_bfloat16(dtype) else _TYPE_NAMES.get(dtype.name, dtype.name)


class Dataset(SRObject):
    """A named group of tensors and metadata fields, put and got as one unit."""

    def __init__(self, name: str) -> None:
        """Initialize a Dataset object

        :param name: name of dataset
        :type name: str
        :raises TypeError: if ``name`` is not a string
        """
        typecheck(name, "name", str)
        super().__init__(name)
        self._name = name
        self._tensors: dict[str, np.ndarray] = {}
        self._scalars: dict[str, list] = {}
        self._scalar_types: dict[str, np.dtype] = {}
        self._strings: dict[str, list[str]] = {}

    def __str__(self) -> str:
        """A readable summary: each tensor's type, dimensions and element count, each metadata field's type

        :return: the summary, as SmartRedis' ``to_string()`` lays it out
        :rtype: str
        """
        lines = [f"DataSet ({self._name}):", "Tensors:"]
        for name, array in self._tensors.items():
            dims = ", ".join(str(d) for d in array.shape)
            lines += [f"  {name}:", f"    type: {_type_name(array.dtype)}", f"    dimensions: [{dims}]",
                      f"    elements: {array.size}"]
        if not self._tensors:
            lines.append("  none")
        lines.append("Metadata:")
        for name in self.get_metadata_field_names():
            kind = "string" if name in self._strings else _type_name(self._scalar_types[name])
            lines += [f"  {name}:", f"    type: {kind}"]
        if not self._scalars and not self._strings:
            lines.append("  none")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return f"Dataset({self._name!r}, tensors={self.get_tensor_names()}, metadata={self.get_metadata_field_names()})"

    @staticmethod
    def from_pybind(dataset: Dataset) -> Dataset:
        """A new Dataset with the name, tensors and metadata of another

        SmartRedis takes its pybind object here; smartredis_io has none, so this takes what
        ``get_data()`` returns.

        :param dataset: the dataset to copy
        :type dataset: Dataset
        :return: the new Dataset
        :rtype: Dataset
        :raises TypeError: if the argument is not a Dataset
        """
        typecheck(dataset, "dataset", Dataset)
        result = Dataset(dataset.get_name())
        result.set_data(dataset)
        return result

    def get_data(self) -> Dataset:
        """The object holding this dataset's tensors and metadata (this Dataset itself)

        :return: the dataset
        :rtype: Dataset
        """
        return self

    def set_data(self, dataset: Dataset) -> None:
        """Take the name, tensors and metadata of another dataset (its arrays are shared, not copied)

        :param dataset: the dataset whose contents to take
        :type dataset: Dataset
        :raises TypeError: if the argument is not a Dataset
        """
        typecheck(dataset, "dataset", Dataset)
        self._name = dataset._name
        self._tensors = dict(dataset._tensors)
        self._scalars = {k: list(v) for k, v in dataset._scalars.items()}
        self._scalar_types = dict(dataset._scalar_types)
        self._strings = {k: list(v) for k, v in dataset._strings.items()}

    def get_name(self) -> str:
        """Get the name of a Dataset

        :return: the name of the in-memory dataset
        :rtype: str
        """
        return self._name

    def add_tensor(self, name: str, data: np.ndarray) -> None:
        """Add a named multi-dimensional data array (tensor) to this dataset

        The data are copied (C-ordered), so changing ``data`` afterwards does not change the dataset.
        A tensor of the same name is replaced.

        :param name: name associated to the tensor data
        :type name: str
        :param data: tensor data
        :type data: np.ndarray
        :raises TypeError: if an argument has the wrong type or the dtype is not supported
        """
        typecheck(name, "name", str)
        typecheck(data, "data", np.ndarray)
        wire.dtype_code(data.dtype)
        self._tensors[name] = np.array(data, order="C", copy=True)

    def _tensor(self, name: str) -> np.ndarray:
        typecheck(name, "name", str)
        try:
            return self._tensors[name]
        except KeyError:
            raise RedisKeyError(f"The tensor {name!r} does not exist in dataset {self._name!r}") from None

    def get_tensor(self, name: str) -> np.ndarray:
        """Get a tensor from the Dataset

        :param name: name of the tensor to get
        :type name: str
        :return: a new numpy array of the tensor's data
        :rtype: np.ndarray
        :raises TypeError: if ``name`` is not a string
        :raises RedisKeyError: if the dataset has no tensor of that name
        """
        return self._tensor(name).copy()

    def get_tensor_names(self) -> list[str]:
        """Get the names of all tensors in the Dataset

        :return: a list of tensor names
        :rtype: list[str]
        """
        return list(self._tensors)

    def get_tensor_type(self, name: str) -> type | np.dtype:
        """Get the type of a tensor in the Dataset

        :param name: The name used to reference the tensor in the Dataset
        :type name: str
        :return: the numpy type of the tensor (e.g. ``np.float32``; the ``bfloat16`` dtype for bfloat16)
        :rtype: type
        :raises TypeError: if ``name`` is not a string
        :raises RedisKeyError: if the dataset has no tensor of that name
        """
        dtype = self._tensor(name).dtype
        return dtype if wire.is_bfloat16(dtype) else dtype.type

    def get_tensor_dims(self, name: str) -> list[int]:
        """Get the dimensions of a tensor in the Dataset

        :param name: name associated to the tensor data
        :type name: str
        :return: a list of the tensor dimensions
        :rtype: list[int]
        :raises TypeError: if ``name`` is not a string
        :raises RedisKeyError: if the dataset has no tensor of that name
        """
        return list(self._tensor(name).shape)

    def add_meta_scalar(self, name: str, data: int | float | np.generic) -> None:
        """Add scalar (non-string) metadata to a field name if it exists; otherwise, create and add

        :param name: The name used to reference the scalar metadata field
        :type name: str
        :param data: scalar metadata input (float64, float32, int64, int32, uint64 or uint32)
        :type data: int | float
        :raises TypeError: if ``data`` is not a scalar of a supported type
        :raises RedisRuntimeError: if the field holds strings or scalars of another type
        """
        typecheck(name, "name", str)
        value = np.asarray(data)
        if value.size > 1:
            raise TypeError("Argument provided is not a scalar")
        if value.dtype not in META_SCALAR_DTYPES:
            raise TypeError(f"Incompatible metadata type provided {value.dtype}")
        if name in self._strings:
            raise RedisRuntimeError(f"The metadata field {name!r} holds strings")
        known = self._scalar_types.setdefault(name, value.dtype)
        if known != value.dtype:
            raise RedisRuntimeError(f"The metadata field {name!r} holds {known}, not {value.dtype}")
        self._scalars.setdefault(name, []).append(value.item())

    def add_meta_string(self, name: str, data: str) -> None:
        """Add string metadata to a field name if it exists; otherwise, create and add

        :param name: The name used to reference the string metadata field
        :type name: str
        :param data: string metadata input
        :type data: str
        :raises TypeError: if an argument is not a string
        :raises RedisRuntimeError: if the field holds scalars
        """
        typecheck(name, "name", str)
        typecheck(data, "data", str)
        if name in self._scalars:
            raise RedisRuntimeError(f"The metadata field {name!r} holds scalars")
        self._strings.setdefault(name, []).append(data)

    def _missing_field(self, name: str) -> RedisKeyError:
        return RedisKeyError(f"The metadata field {name!r} does not exist in dataset {self._name!r}")

    def get_meta_scalars(self, name: str) -> np.ndarray:
        """Get the scalar values from the DataSet assigned to a field name

        :param name: The field name to retrieve from
        :type name: str
        :return: the values, as an array of the field's type
        :rtype: np.ndarray
        :raises TypeError: if ``name`` is not a string
        :raises RedisKeyError: if there is no such field
        :raises RedisRuntimeError: if the field holds strings
        """
        typecheck(name, "name", str)
        if name in self._strings:
            raise RedisRuntimeError(f"The metadata field {name!r} is of type string. Use get_meta_strings method.")
        if name not in self._scalars:
            raise self._missing_field(name)
        return np.array(self._scalars[name], dtype=self._scalar_types[name])

    def get_meta_strings(self, name: str) -> list[str]:
        """Get the string values from the DataSet assigned to a field name

        :param name: The field name to retrieve from
        :type name: str
        :return: the strings
        :rtype: list[str]
        :raises TypeError: if ``name`` is not a string
        :raises RedisKeyError: if there is no such field
        :raises RedisRuntimeError: if the field holds scalars
        """
        typecheck(name, "name", str)
        if name in self._scalars:
            raise RedisRuntimeError(f"The metadata field {name!r} isn't a string type.")
        if name not in self._strings:
            raise self._missing_field(name)
        return list(self._strings[name])

    def get_metadata_field_names(self) -> list[str]:
        """Get all field names from the DataSet

        :return: a list of all metadata field names
        :rtype: list[str]
        """
        return [*self._scalars, *self._strings]

    def get_metadata_field_type(self, name: str) -> type:
        """Get the type of metadata for a field name (scalar or string)

        :param name: The name used to reference the metadata field in the DataSet
        :type name: str
        :return: the numpy type for the metadata field (``str`` for strings)
        :rtype: type
        :raises TypeError: if ``name`` is not a string
        :raises RedisKeyError: if there is no such field
        """
        typecheck(name, "name", str)
        if name in self._strings:
            return str
        if name in self._scalar_types:
            return self._scalar_types[name].type
        raise self._missing_field(name)

    # ---- layout on Redis (used by the client) ----------------------------------------------

    def _meta_fields(self) -> list[tuple[bytes, bytes]]:
        """The fields of the dataset's hash, serialized as SmartRedis' MetadataBuffer does."""
        fields = [(name.encode(), _pack_scalars(self._scalar_types[name], values)) for name, values in self._scalars.items()]
        fields += [(name.encode(), _pack_strings(values)) for name, values in self._strings.items()]
        if self._tensors:
            fields.append((TENSOR_NAMES_FIELD, _pack_strings(list(self._tensors))))
        return fields

    @classmethod
    def _from_meta(cls, name: str, fields: dict[bytes, bytes], key: str) -> tuple[Dataset, list[str]]:
        """A dataset with the metadata of a hash read from ``key``, and the names of its tensors."""
        dataset, tensors = cls(name), []
        for raw_field, value in fields.items():
            field = raw_field.decode()
            if raw_field == ACK_FIELD:
                continue
            if not value or value[0] not in _META_TYPES:
                raise RedisRuntimeError(f"The metadata field {field!r} of dataset {name!r} (key {key!r}) is not one "
                                        "SmartRedis writes")
            dtype = _META_TYPES[value[0]]
            if dtype is None:
                strings = _unpack_strings(value, field, key)
                if raw_field == TENSOR_NAMES_FIELD:
                    tensors = strings
                else:
                    dataset._strings[field] = strings
            else:
                if (len(value) - 1) % dtype.itemsize:
                    raise RedisRuntimeError(f"The metadata field {field!r} of dataset {name!r} (key {key!r}) is "
                                            f"truncated")
                dataset._scalar_types[field] = dtype.newbyteorder("=")
                dataset._scalars[field] = np.frombuffer(value, dtype=dtype, offset=1).tolist()
        return dataset, tensors


# SmartRedis 0.6.1's dataset layout, shared with every SmartRedis client (C, C++, Fortran, Python): a
# hash at ``<base>.meta`` holding each metadata field serialized (a type byte, then the values: scalars
# little-endian, strings each as a 64-bit length and its bytes), the tensor names in the string field
# ``.tensor_names`` and ``.COMPLETE`` = ``1`` once the dataset is whole; each tensor at
# ``<base>.<tensor>``, a tensor value of smartredis_io._client.wire (what AI.TENSORSET stores). ``<base>`` is
# ``<prefix>{<name>}``, so every key of a dataset lives on one cluster slot.
ACK_FIELD = b".COMPLETE"
TENSOR_NAMES_FIELD = b".tensor_names"
_META_STRING = 7
_META_CODES = {np.dtype("<f8"): 1, np.dtype("<f4"): 2, np.dtype("<i4"): 3, np.dtype("<i8"): 4, np.dtype("<u4"): 5,
               np.dtype("<u8"): 6}
_META_TYPES: dict[int, np.dtype | None] = {code: dtype for dtype, code in _META_CODES.items()} | {_META_STRING: None}
_LENGTH = struct.Struct("<Q")


def _pack_scalars(dtype: np.dtype, values: list) -> bytes:
    little = dtype.newbyteorder("<")
    return bytes([_META_CODES[little]]) + np.asarray(values, dtype=little).tobytes()


def _pack_strings(values: list[str]) -> bytes:
    parts = [bytes([_META_STRING])]
    for value in values:
        data = value.encode()
        parts += [_LENGTH.pack(len(data)), data]
    return b"".join(parts)


def _unpack_strings(value: bytes, field: str, key: str) -> list[str]:
    strings, at = [], 1
    while at < len(value):
        if at + _LENGTH.size > len(value):
            raise RedisRuntimeError(f"The metadata field {field!r} (key {key!r}) is truncated")
        (length,) = _LENGTH.unpack_from(value, at)
        at += _LENGTH.size
        if at + length > len(value):
            raise RedisRuntimeError(f"The metadata field {field!r} (key {key!r}) is truncated")
        strings.append(value[at:at + length].decode(errors="surrogateescape"))
        at += length
    return strings


def dataset_key(prefix: str, name: str) -> str:
    """The dataset's base key, SmartRedis style: ``<prefix>{<name>}``."""
    return f"{prefix}{{{name}}}"


def renamed(dataset: Dataset, name: str) -> Dataset:
    """``dataset`` (one just read, owned by the caller) under a new name."""
    dataset._name = name
    return dataset


def _tensor_key(base: str, tensor: str) -> str:
    return f"{base}.{tensor}"


def _command(*args: bytes | str) -> bytes:
    encoded = [a.encode() if isinstance(a, str) else a for a in args]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in encoded)


def _set_command(key: str, parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """``SET key <parts joined>`` as RESP buffers, the parts sent as they are (no copy)."""
    total = sum(memoryview(p).nbytes for p in parts)
    bkey = key.encode()
    return [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(bkey), bkey, total), *parts, b"\r\n"]


def _transaction(db: Database, key: str, buffers: list[bytes | memoryview], count: int) -> list:
    """Run ``count`` commands (packed in ``buffers``, all on the slot of ``key``) in MULTI/EXEC on the
    node holding ``key``; the replies EXEC gives."""
    db.check_deadline()
    pool = _redispy.node_pool(db.redis, key)
    with _redispy.pooled_connection(pool) as conn:
        _redispy.send_buffers(conn, [_command("MULTI"), *buffers, _command("EXEC")])
        replies = [_redispy.read_reply(conn) for _ in range(count + 2)]
    for reply in replies[:-1]:
        if isinstance(reply, Exception):
            raise RedisRuntimeError(f"Storing the dataset at {key!r} failed: {reply}")
    if isinstance(replies[-1], Exception):
        raise RedisRuntimeError(f"Storing the dataset at {key!r} failed: {replies[-1]}")
    for reply in replies[-1]:
        if isinstance(reply, Exception):
            raise RedisRuntimeError(f"Storing the dataset at {key!r} failed: {reply}")
    return replies[-1]


def put(db: Database, base: str, dataset: Dataset) -> None:
    """Store a dataset in SmartRedis' layout, atomically: the tensors, the hash and the tensors it no
    longer has go in one MULTI/EXEC (a tensor too large for one value has its chunks written first).

    The chunks of the tensors it replaces or drops are leased in that MULTI/EXEC, then deleted: a
    writer killed at any point leaves nothing that does not expire."""
    meta_key = base + META_SUFFIX
    previous = db.redis.hget(meta_key, TENSOR_NAMES_FIELD)
    names: list[str] = []
    if previous:
        try:
            names = _unpack_strings(previous, ".tensor_names", meta_key)
        except RedisRuntimeError:
            names = []
    stale = [t for t in names if t not in dataset._tensors]
    heads, replaced = _chunk_keys(db, [_tensor_key(base, t) for t in names])
    buffers: list[bytes | memoryview] = []
    count = 0
    staged: list[str] = []
    try:
        for tensor, array in dataset._tensors.items():
            key = _tensor_key(base, tensor)
            header, payload, chunks = wire.stage_value(db, key, array)
            staged += chunks
            buffers += [_command("GETRANGE", key, "0", str(wire.HEADER_MAX_BYTES - 1)), *_set_command(key, [header, payload])]
            count += 2
        fields = dataset._meta_fields()
        buffers += [_command("PERSIST", chunk) for chunk in staged]  # the chunks live from here on
        lease = str(wire.lease_ms(db))
        buffers += [_command("PEXPIRE", chunk, lease) for chunk in replaced]
        count += len(staged) + len(replaced)
        buffers.append(_command("DEL", meta_key, *(_tensor_key(base, t) for t in stale)))
        buffers.append(_command("HSET", meta_key, *(item for pair in fields for item in pair), ACK_FIELD, b"1"))
        count += 2
        replies = _transaction(db, meta_key, buffers, count)
    except BaseException:
        if staged:
            db.redis.delete(*staged)
        raise
    if replaced:
        db.redis.delete(*replaced)
    # A writer that replaced the dataset since ``names`` were read: the chunks its tensors had.
    for tensor, old in zip(dataset._tensors, replies[0:2 * len(dataset._tensors):2], strict=True):
        key = _tensor_key(base, tensor)
        if old and old != heads.get(key):
            wire.delete_replaced_chunks(db, key, old)


def _chunk_keys(db: Database, keys: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The headers read from ``keys`` (all in one slot), and the stored chunk keys they name (none
    for inline values)."""
    if not keys:
        return {}, []
    replies = db.exchange([("GETRANGE", key, 0, wire.HEADER_MAX_BYTES - 1) for key in keys], raise_on_error=False)
    heads = dict(zip(keys, replies, strict=True))
    read = functools.partial(db.exchange, raise_on_error=False)
    return heads, [name for key, head in heads.items() for name in wire.stored_chunk_keys(read, key, head)]


def _meta_and_tensors(db: Database, base: str, name: str, tensors: list[str]) -> tuple[dict[bytes, bytes], list]:
    """The hash and the tensor values of a dataset, read in one MULTI/EXEC (one consistent state)."""
    meta_key = base + META_SUFFIX
    buffers = [_command("HGETALL", meta_key), *(_command("GET", _tensor_key(base, t)) for t in tensors)]
    fields, *values = _transaction(db, meta_key, buffers, len(buffers))
    if isinstance(fields, list):  # RESP2 HGETALL: field, value, field, value...
        fields = dict(zip(fields[0::2], fields[1::2], strict=True))
    return fields, values


def get(db: Database, base: str, name: str) -> Dataset:
    """Read a dataset; reads again when a writer changed its tensors in the meantime."""
    meta_key = base + META_SUFFIX
    fields = db.redis.hgetall(meta_key)
    for _ in range(wire.READ_RETRIES):
        if not fields or ACK_FIELD not in fields:
            raise RedisKeyError(f"The dataset {name!r} (key {meta_key!r}) does not exist")
        tensors = Dataset._from_meta(name, fields, meta_key)[1]
        fields, values = _meta_and_tensors(db, base, name, tensors)
        if not fields or ACK_FIELD not in fields:
            continue
        dataset, now = Dataset._from_meta(name, fields, meta_key)
        if now != tensors:
            continue  # replaced between the two reads: read the new one
        try:
            for tensor, raw in zip(tensors, values, strict=True):
                key = _tensor_key(base, tensor)
                if raw is None:
                    raise RedisKeyError(f"The tensor {tensor!r} of dataset {name!r} (key {key!r}) does not exist")
                dataset._tensors[tensor] = wire.decode_value(db, key, raw)
        except RedisKeyError:
            fields = db.redis.hgetall(meta_key)
            continue
        return dataset
    raise RedisRuntimeError(f"The dataset {name!r} kept changing while being read")


def delete(db: Database, base: str) -> bool:
    """Delete a dataset, its hash and its tensors in one MULTI/EXEC that leases their chunks, which
    are deleted next; False when there is none.

    The hash and the tensors are WATCHed from before they are read, so a writer that replaces the
    dataset meanwhile makes the delete start again rather than leave its new chunks for good."""
    meta_key = base + META_SUFFIX
    found, chunks = [False], []

    def prepare(read: Callable[[Sequence[Any]], list[Any]]) -> list[Any]:
        (raw,) = read([("HGETALL", meta_key)])
        if isinstance(raw, Exception):
            raise raw
        fields = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=True))
        found[0], chunks[:] = bool(fields), []
        if not fields:
            return []
        try:
            tensors = Dataset._from_meta("", fields, meta_key)[1]
        except RedisRuntimeError:
            tensors = []
        keys = [_tensor_key(base, tensor) for tensor in tensors]
        if keys:
            read([("WATCH", *keys)])
            heads = read([("GETRANGE", key, 0, wire.HEADER_MAX_BYTES - 1) for key in keys])
            chunks[:] = [name for key, head in zip(keys, heads, strict=True)
                         for name in wire.stored_chunk_keys(read, key, head)]
        lease = wire.lease_ms(db)
        return [("DEL", meta_key, *keys), *(("PEXPIRE", chunk, lease) for chunk in chunks)]

    try:
        db.transaction(meta_key, [meta_key], prepare)
    except redis.exceptions.ResponseError as exc:
        raise RedisRuntimeError(f"Deleting the dataset at {meta_key!r} failed: {exc}") from None
    if chunks:
        db.redis.delete(*chunks)
    return found[0]


def exists(db: Database, base: str) -> bool:
    """Whether a whole dataset is stored at ``base`` (SmartRedis' check: the hash's ``.COMPLETE`` field)."""
    return bool(db.redis.hexists(base + META_SUFFIX, ACK_FIELD))
