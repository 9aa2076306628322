"""SmartRedis' ``Dataset`` (named tensors plus metadata) and how a dataset is laid out on Redis.

On Redis a dataset ``name`` (after any prefix) is a manifest at ``{name}.meta`` and one tensor key per
tensor at ``{name}.<version>.<tensor>``, all sharing the ``{name}`` hash tag (one shard in a cluster).
The manifest is written last with one SET, so a reader sees the old dataset or the new one, never half.
"""

from __future__ import annotations

import json
import uuid

import numpy as np

from smartredis_io import wire
from smartredis_io.configoptions import typecheck
from smartredis_io.connection import Database
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

    def _manifest(self, version: str) -> bytes:
        return json.dumps({
            "name": self._name,
            "version": version,
            "tensors": list(self._tensors),
            "scalars": {k: [self._scalar_types[k].str, v] for k, v in self._scalars.items()},
            "strings": self._strings,
        }).encode()

    @classmethod
    def _from_manifest(cls, manifest: dict) -> Dataset:
        ds = cls(manifest["name"])
        for field, (dtype, values) in manifest["scalars"].items():
            ds._scalar_types[field] = np.dtype(dtype)
            ds._scalars[field] = values
        ds._strings = {k: list(v) for k, v in manifest["strings"].items()}
        return ds


def dataset_key(prefix: str, name: str) -> str:
    """The dataset's base key, SmartRedis style: ``<prefix>{<name>}``."""
    return f"{prefix}{{{name}}}"


def renamed(dataset: Dataset, name: str) -> Dataset:
    """``dataset`` (one just read, owned by the caller) under a new name."""
    dataset._name = name
    return dataset


def _tensor_key(base: str, version: str, tensor: str) -> str:
    return f"{base}.{version}.{tensor}"


def put(db: Database, base: str, dataset: Dataset) -> None:
    """Write the tensors under a new version, then the manifest, then drop the previous version."""
    version = uuid.uuid4().hex
    lease = wire.lease_ms(db)  # the tensors of a writer that dies before the manifest expire
    keys = [_tensor_key(base, version, tensor) for tensor in dataset._tensors]
    for key, array in zip(keys, dataset._tensors.values(), strict=True):
        wire.put_array(db, key, array, lease)
    wire.persist(db, keys)
    old = db.redis.set(base + META_SUFFIX, dataset._manifest(version), get=True)
    if old:
        _delete_parts(db, base, old)


def _delete_parts(db: Database, base: str, raw_manifest: bytes) -> None:
    try:
        manifest = json.loads(raw_manifest)
    except ValueError:
        return
    for tensor in manifest.get("tensors", ()):
        wire.delete_value(db, _tensor_key(base, manifest["version"], tensor))


def get(db: Database, base: str, name: str) -> Dataset:
    """Read a dataset; re-reads the manifest when an overwrite removed the version being read."""
    for _ in range(wire.READ_RETRIES):
        raw = db.redis.get(base + META_SUFFIX)
        if raw is None:
            raise RedisKeyError(f"The dataset {name!r} (key {base + META_SUFFIX!r}) does not exist")
        manifest = json.loads(raw)
        dataset = Dataset._from_manifest(manifest)
        try:
            for tensor in manifest["tensors"]:
                dataset._tensors[tensor] = wire.get_array(db, _tensor_key(base, manifest["version"], tensor))
        except RedisKeyError:
            continue
        return dataset
    raise RedisRuntimeError(f"The dataset {name!r} kept changing while being read")


def delete(db: Database, base: str) -> bool:
    raw = db.redis.get(base + META_SUFFIX)
    if raw is None:
        return False
    db.redis.delete(base + META_SUFFIX)
    _delete_parts(db, base, raw)
    return True


def exists(db: Database, base: str) -> bool:
    return bool(db.redis.exists(base + META_SUFFIX))
