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

__all__ = ["Dataset"]

META_SCALAR_DTYPES = tuple(np.dtype(t) for t in ("f8", "f4", "i4", "i8", "u4", "u8"))
META_SUFFIX = ".meta"


class Dataset:
    """A named group of tensors and metadata fields, put and got as one unit."""

    def __init__(self, name: str) -> None:
        typecheck(name, "name", str)
        self._name = name
        self._tensors: dict[str, np.ndarray] = {}
        self._scalars: dict[str, list] = {}
        self._scalar_types: dict[str, np.dtype] = {}
        self._strings: dict[str, list[str]] = {}

    def get_name(self) -> str:
        return self._name

    def add_tensor(self, name: str, data: np.ndarray) -> None:
        """Add a tensor; the array is read when the dataset is put (no copy here)."""
        typecheck(name, "name", str)
        typecheck(data, "data", np.ndarray)
        wire.dtype_code(data.dtype)
        self._tensors[name] = data

    def get_tensor(self, name: str) -> np.ndarray:
        typecheck(name, "name", str)
        try:
            return self._tensors[name]
        except KeyError:
            raise RedisKeyError(f"The tensor {name!r} does not exist in dataset {self._name!r}") from None

    def get_tensor_names(self) -> list[str]:
        return list(self._tensors)

    def get_tensor_type(self, name: str) -> np.dtype:
        return self.get_tensor(name).dtype

    def get_tensor_dims(self, name: str) -> list[int]:
        return list(self.get_tensor(name).shape)

    def add_meta_scalar(self, name: str, data: int | float | np.generic) -> None:
        """Append a number to the metadata field ``name`` (created on first use)."""
        typecheck(name, "name", str)
        value = np.asarray(data)
        if value.size > 1:
            raise TypeError("Argument provided is not a scalar")
        if value.dtype not in META_SCALAR_DTYPES:
            raise TypeError(f"Unsupported metadata scalar type {value.dtype}")
        if name in self._strings:
            raise RedisRuntimeError(f"The metadata field {name!r} holds strings")
        known = self._scalar_types.setdefault(name, value.dtype)
        if known != value.dtype:
            raise RedisRuntimeError(f"The metadata field {name!r} holds {known}, not {value.dtype}")
        self._scalars.setdefault(name, []).append(value.item())

    def add_meta_string(self, name: str, data: str) -> None:
        """Append a string to the metadata field ``name`` (created on first use)."""
        typecheck(name, "name", str)
        typecheck(data, "data", str)
        if name in self._scalars:
            raise RedisRuntimeError(f"The metadata field {name!r} holds scalars")
        self._strings.setdefault(name, []).append(data)

    def get_meta_scalars(self, name: str) -> np.ndarray:
        typecheck(name, "name", str)
        if name not in self._scalars:
            raise RedisKeyError(f"The metadata field {name!r} does not exist in dataset {self._name!r}")
        return np.array(self._scalars[name], dtype=self._scalar_types[name])

    def get_meta_strings(self, name: str) -> list[str]:
        typecheck(name, "name", str)
        if name not in self._strings:
            raise RedisKeyError(f"The metadata field {name!r} does not exist in dataset {self._name!r}")
        return list(self._strings[name])

    def get_metadata_field_names(self) -> list[str]:
        return [*self._scalars, *self._strings]

    def get_metadata_field_type(self, name: str) -> np.dtype | type:
        if name in self._strings:
            return str
        if name in self._scalar_types:
            return self._scalar_types[name]
        raise RedisKeyError(f"The metadata field {name!r} does not exist in dataset {self._name!r}")

    def __repr__(self) -> str:
        return f"Dataset({self._name!r}, tensors={self.get_tensor_names()}, metadata={self.get_metadata_field_names()})"

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
