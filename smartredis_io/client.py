"""SmartRedis' ``Client`` on a stock Redis or Redis Cluster, models and scripts run by our workers."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import textwrap
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import redis

from smartredis_io import dataset as ds_layout
from smartredis_io import models, wire
from smartredis_io.configoptions import ConfigOptions, typecheck
from smartredis_io.connection import Database
from smartredis_io.dataset import Dataset
from smartredis_io.error import (
    RedisConnectionError,
    RedisKeyError,
    RedisReplyError,
    RedisRuntimeError,
    RedisTimeoutError,
)

__all__ = ["Client"]

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_MS = 5_000  # SR_CONN_TIMEOUT: how long construction keeps trying to connect
DEFAULT_MODEL_TIMEOUT_MS = 60_000  # SR_MODEL_TIMEOUT: deadline of run_model / run_script
BACKENDS = ("TF", "TFLITE", "TORCH", "ONNX")
EXECUTABLE_BACKENDS = ("TORCH",)

F = TypeVar("F", bound=Callable[..., Any])


def _translated(method: F) -> F:
    """Turn redis-py errors into SmartRedis' exception types, naming the method."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except redis.exceptions.TimeoutError as exc:
            raise RedisTimeoutError(str(exc), method.__name__) from exc
        except redis.exceptions.ConnectionError as exc:
            raise RedisConnectionError(f"{method.__name__}: {exc}") from exc
        except redis.exceptions.RedisError as exc:
            raise RedisReplyError(str(exc), method.__name__) from exc

    return wrapper  # type: ignore[return-value]


def _names(arg: str | list[str] | None, what: str) -> list[str]:
    if arg is None:
        return []
    if isinstance(arg, str):
        return [arg]
    typecheck(arg, what, list)
    for item in arg:
        typecheck(item, what, str)
    return arg


def _check_device(device: str) -> str:
    typecheck(device, "device", str)
    device = device.upper()
    if not device.startswith(("CPU", "GPU")):
        raise TypeError("Device argument must start with either CPU or GPU")
    return device


def _check_file(path: str) -> str:
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return path


class Client:
    """Drop-in for ``smartredis.Client``.

    ``Client(cluster: bool, address: str | None = None, logger_name="Default")`` or
    ``Client(config_options: ConfigOptions | None = None, logger_name="Default")``; the address comes
    from ``SSDB`` when not given, standalone vs cluster from ``SR_DB_TYPE`` (``Clustered``).

    Raises:
        RedisConnectionError: no database answers at the address within ``SR_CONN_TIMEOUT`` ms.
    """

    def __init__(self, *a: Any, **kw: Any) -> None:
        if (a and isinstance(a[0], bool)) or (not a and ("address" in kw or "cluster" in kw)):
            for arg in kw:
                if arg not in ("cluster", "address", "logger_name"):
                    raise TypeError(f"__init__() got an unexpected keyword argument '{arg}'")
            self._address_construction(*a, **kw)
        elif not a or isinstance(a[0], ConfigOptions) or a[0] is None:
            self._standard_construction(*a, **kw)
        else:
            raise TypeError(f"Invalid type for argument 0: {type(a[0])}")

    def _address_construction(self, cluster: bool, address: str | None = None, logger_name: str = "Default") -> None:
        typecheck(cluster, "cluster", bool)
        if address:
            typecheck(address, "address", str)
            os.environ["SSDB"] = address  # as SmartRedis: the address given becomes SSDB
        if "SSDB" not in os.environ:
            raise RedisConnectionError("Could not connect to database. $SSDB not set")
        self._setup(ConfigOptions.create_from_environment(""), cluster, logger_name)

    def _standard_construction(self, config_options: ConfigOptions | None = None, logger_name: str = "Default") -> None:
        options = config_options or ConfigOptions.create_from_environment("")
        typecheck(options, "config_options", ConfigOptions)
        if not options.is_configured("SSDB"):
            raise RedisConnectionError("Could not connect to database. $SSDB not set")
        cluster = options.string_or("SR_DB_TYPE", "Standalone").lower() in ("clustered", "cluster")
        self._setup(options, cluster, logger_name)

    def _setup(self, options: ConfigOptions, cluster: bool, logger_name: str) -> None:
        self._options = options
        self._logger_name = logger_name
        self._log = logging.getLogger(f"{__name__}.{logger_name}")
        address = options.get_string_option("SSDB")
        connect_s = options.integer_or("SR_CONN_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_MS) / 1000
        self._model_timeout_s = options.integer_or("SR_MODEL_TIMEOUT", DEFAULT_MODEL_TIMEOUT_MS) / 1000
        self._db = Database(address, cluster, connect_s)
        keyin = options.string_or("SSKEYIN", "")
        self._get_prefixes = [p for p in keyin.split(",") if p]
        self._put_prefix = options.string_or("SSKEYOUT", "")
        self._get_prefix = self._get_prefixes[0] if self._get_prefixes else ""
        self._use = {"tensor": True, "dataset": True, "list": True, "model": False}
        self._log.debug("connected to %s (%s)", address, "cluster" if cluster else "standalone")

    def __str__(self) -> str:
        kind = "Clustered" if self._db.cluster else "Standalone"
        return f"Client (smartredis_io) logger {self._logger_name!r}: {kind} database at {self._db.address}"

    def close(self) -> None:
        """Close the connections (SmartRedis closes them when the client is destroyed)."""
        self._db.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- key prefixing (SSKEYIN / SSKEYOUT) --------------------------------------------------

    def _put_key(self, kind: str, name: str) -> str:
        return f"{self._put_prefix}.{name}" if self._use[kind] and self._put_prefix else name

    def _get_key(self, kind: str, name: str) -> str:
        return f"{self._get_prefix}.{name}" if self._use[kind] and self._get_prefix else name

    def _get_dataset_key(self, name: str) -> str:
        prefix = f"{self._get_prefix}." if self._use["dataset"] and self._get_prefix else ""
        return ds_layout.dataset_key(prefix, name)

    @_translated
    def set_data_source(self, source_id: str) -> None:
        """Read with prefix ``source_id``, which must be one of those in ``SSKEYIN``."""
        typecheck(source_id, "source_id", str)
        if source_id not in self._get_prefixes:
            raise RedisRuntimeError(
                f"Client error: data source {source_id} could not be found during client initialization"
            )
        self._get_prefix = source_id

    def use_tensor_ensemble_prefix(self, use_prefix: bool) -> None:
        typecheck(use_prefix, "use_prefix", bool)
        self._use["tensor"] = use_prefix

    def use_dataset_ensemble_prefix(self, use_prefix: bool) -> None:
        typecheck(use_prefix, "use_prefix", bool)
        self._use["dataset"] = use_prefix

    def use_list_ensemble_prefix(self, use_prefix: bool) -> None:
        typecheck(use_prefix, "use_prefix", bool)
        self._use["list"] = use_prefix

    def use_model_ensemble_prefix(self, use_prefix: bool) -> None:
        typecheck(use_prefix, "use_prefix", bool)
        self._use["model"] = use_prefix

    # ---- tensors -------------------------------------------------------------------------------

    @_translated
    def put_tensor(self, name: str, data: np.ndarray) -> None:
        """Store ``data`` (any supported dtype, any shape) at ``name``."""
        typecheck(name, "name", str)
        typecheck(data, "data", np.ndarray)
        wire.put_array(self._db, self._put_key("tensor", name), data)

    @_translated
    def get_tensor(self, name: str) -> np.ndarray:
        """A new array holding the tensor at ``name``; ``RedisKeyError`` when there is none."""
        typecheck(name, "name", str)
        return wire.get_array(self._db, self._get_key("tensor", name))

    @_translated
    def unpack_tensor(self, name: str, out_array: np.ndarray) -> None:
        """Read the tensor at ``name`` straight into ``out_array`` (same dtype and shape, C-contiguous).

        Raises:
            RedisRuntimeError: dtype or shape mismatch, or a non-contiguous / read-only array.
            RedisKeyError: no tensor at ``name``.
        """
        typecheck(name, "name", str)
        typecheck(out_array, "out_array", np.ndarray)
        wire.get_array(self._db, self._get_key("tensor", name), out_array)

    @_translated
    def delete_tensor(self, name: str) -> None:
        typecheck(name, "name", str)
        key = self._get_key("tensor", name)
        if not wire.delete_value(self._db, key):
            raise RedisKeyError(f"The tensor {key!r} does not exist")

    @_translated
    def copy_tensor(self, src_name: str, dest_name: str) -> None:
        typecheck(src_name, "src_name", str)
        typecheck(dest_name, "dest_name", str)
        array = wire.get_array(self._db, self._get_key("tensor", src_name))
        wire.put_array(self._db, self._put_key("tensor", dest_name), array)

    @_translated
    def rename_tensor(self, old_name: str, new_name: str) -> None:
        self.copy_tensor(old_name, new_name)
        wire.delete_value(self._db, self._get_key("tensor", old_name))

    @_translated
    def tensor_exists(self, name: str) -> bool:
        typecheck(name, "name", str)
        return bool(self._db.redis.exists(self._get_key("tensor", name)))

    @_translated
    def key_exists(self, key: str) -> bool:
        typecheck(key, "key", str)
        return bool(self._db.redis.exists(key))

    def _poll(self, check: Callable[[], bool], poll_frequency_ms: int, num_tries: int) -> bool:
        typecheck(poll_frequency_ms, "poll_frequency_ms", int)
        typecheck(num_tries, "num_tries", int)
        for attempt in range(num_tries):
            if check():
                return True
            if attempt + 1 < num_tries:
                time.sleep(poll_frequency_ms / 1000)
        return False

    def poll_key(self, key: str, poll_frequency_ms: int, num_tries: int) -> bool:
        """True once ``key`` exists, checking ``num_tries`` times ``poll_frequency_ms`` apart."""
        return self._poll(lambda: self.key_exists(key), poll_frequency_ms, num_tries)

    def poll_tensor(self, name: str, poll_frequency_ms: int, num_tries: int) -> bool:
        return self._poll(lambda: self.tensor_exists(name), poll_frequency_ms, num_tries)

    def poll_dataset(self, name: str, poll_frequency_ms: int, num_tries: int) -> bool:
        return self._poll(lambda: self.dataset_exists(name), poll_frequency_ms, num_tries)

    def poll_model(self, name: str, poll_frequency_ms: int, num_tries: int) -> bool:
        return self._poll(lambda: self.model_exists(name), poll_frequency_ms, num_tries)

    # ---- datasets ------------------------------------------------------------------------------

    def _dataset_put_base(self, name: str) -> str:
        prefix = f"{self._put_prefix}." if self._use["dataset"] and self._put_prefix else ""
        return ds_layout.dataset_key(prefix, name)

    @_translated
    def put_dataset(self, dataset: Dataset) -> None:
        """Store every tensor and metadata field of ``dataset``; readers see all of it or none."""
        typecheck(dataset, "dataset", Dataset)
        ds_layout.put(self._db, self._dataset_put_base(dataset.get_name()), dataset)

    @_translated
    def get_dataset(self, name: str) -> Dataset:
        typecheck(name, "name", str)
        return ds_layout.get(self._db, self._get_dataset_key(name), name)

    @_translated
    def delete_dataset(self, name: str) -> None:
        typecheck(name, "name", str)
        if not ds_layout.delete(self._db, self._get_dataset_key(name)):
            raise RedisKeyError(f"The dataset {name!r} does not exist")

    @_translated
    def copy_dataset(self, src_name: str, dest_name: str) -> None:
        typecheck(src_name, "src_name", str)
        typecheck(dest_name, "dest_name", str)
        source = ds_layout.get(self._db, self._get_dataset_key(src_name), src_name)
        source._name = dest_name
        ds_layout.put(self._db, self._dataset_put_base(dest_name), source)

    @_translated
    def rename_dataset(self, old_name: str, new_name: str) -> None:
        self.copy_dataset(old_name, new_name)
        ds_layout.delete(self._db, self._get_dataset_key(old_name))

    @_translated
    def dataset_exists(self, name: str) -> bool:
        typecheck(name, "name", str)
        return ds_layout.exists(self._db, self._get_dataset_key(name))

    # ---- aggregation lists ---------------------------------------------------------------------

    @_translated
    def append_to_list(self, list_name: str, dataset: Dataset) -> None:
        """Append a reference to ``dataset`` (which must have been put) to the list."""
        typecheck(list_name, "list_name", str)
        typecheck(dataset, "dataset", Dataset)
        self._db.redis.rpush(self._put_key("list", list_name), self._dataset_put_base(dataset.get_name()))

    @_translated
    def delete_list(self, list_name: str) -> None:
        typecheck(list_name, "list_name", str)
        self._db.redis.delete(self._get_key("list", list_name))

    @_translated
    def copy_list(self, src_name: str, dest_name: str) -> None:
        typecheck(src_name, "src_name", str)
        typecheck(dest_name, "dest_name", str)
        src = self._get_key("list", src_name)
        if not self._db.redis.exists(src):
            raise RedisKeyError(f"The list {src!r} does not exist")
        entries = self._db.redis.lrange(src, 0, -1)
        dest = self._put_key("list", dest_name)
        pipe = self._db.redis.pipeline(transaction=not self._db.cluster)
        pipe.delete(dest)
        pipe.rpush(dest, *entries)
        pipe.execute()

    @_translated
    def rename_list(self, src_name: str, dest_name: str) -> None:
        self.copy_list(src_name, dest_name)
        if self._get_key("list", src_name) != self._put_key("list", dest_name):
            self._db.redis.delete(self._get_key("list", src_name))

    @_translated
    def get_list_length(self, list_name: str) -> int:
        typecheck(list_name, "list_name", str)
        return int(self._db.redis.llen(self._get_key("list", list_name)))

    def _poll_length(self, name: str, accept: Callable[[int], bool], poll_frequency_ms: int, num_tries: int) -> bool:
        typecheck(name, "name", str)
        return self._poll(lambda: accept(self.get_list_length(name)), poll_frequency_ms, num_tries)

    def poll_list_length(self, name: str, list_length: int, poll_frequency_ms: int, num_tries: int) -> bool:
        typecheck(list_length, "list_length", int)
        return self._poll_length(name, lambda n: n == list_length, poll_frequency_ms, num_tries)

    def poll_list_length_gte(self, name: str, list_length: int, poll_frequency_ms: int, num_tries: int) -> bool:
        typecheck(list_length, "list_length", int)
        return self._poll_length(name, lambda n: n >= list_length, poll_frequency_ms, num_tries)

    def poll_list_length_lte(self, name: str, list_length: int, poll_frequency_ms: int, num_tries: int) -> bool:
        typecheck(list_length, "list_length", int)
        return self._poll_length(name, lambda n: n <= list_length, poll_frequency_ms, num_tries)

    @_translated
    def get_datasets_from_list(self, list_name: str) -> list[Dataset]:
        typecheck(list_name, "list_name", str)
        return self._datasets(self._db.redis.lrange(self._get_key("list", list_name), 0, -1))

    @_translated
    def get_dataset_list_range(self, list_name: str, start_index: int, end_index: int) -> list[Dataset]:
        """Datasets ``start_index``..``end_index`` (inclusive, negative from the end) of the list."""
        typecheck(list_name, "list_name", str)
        typecheck(start_index, "start_index", int)
        typecheck(end_index, "end_index", int)
        return self._datasets(self._db.redis.lrange(self._get_key("list", list_name), start_index, end_index))

    def _datasets(self, bases: list[bytes]) -> list[Dataset]:
        result = []
        for raw in bases:
            base = raw.decode()
            name = base[base.index("{") + 1:base.rindex("}")]
            result.append(ds_layout.get(self._db, base, name))
        return result

    # ---- models and scripts --------------------------------------------------------------------

    def _store(self, name: str, blob: bytes, manifest: models.Manifest) -> None:
        models.store(self._db, self._put_key("model", name), blob, manifest)

    @_translated
    def set_model(
        self,
        name: str,
        model: bytes,
        backend: str = "TORCH",
        device: str = "CPU",
        batch_size: int = 0,
        min_batch_size: int = 0,
        min_batch_timeout: int = 0,
        tag: str = "",
        inputs: str | list[str] | None = None,
        outputs: str | list[str] | None = None,
    ) -> None:
        """Store a serialized model (TorchScript bytes for ``TORCH``) for ``run_model``.

        Raises:
            TypeError: wrong argument types, unknown backend or device.
            RedisReplyError: a batching combination RedisAI rejects, or a backend no worker runs.
        """
        typecheck(name, "name", str)
        typecheck(model, "model", (bytes, bytearray, memoryview))
        manifest = self._model_manifest(backend, device, batch_size, min_batch_size, min_batch_timeout, tag,
                                        inputs, outputs)
        self._store(name, bytes(model), manifest)

    @staticmethod
    def _model_manifest(backend: str, device: str, batch_size: int, min_batch_size: int, min_batch_timeout: int,
                        tag: str, inputs: str | list[str] | None, outputs: str | list[str] | None) -> models.Manifest:
        typecheck(backend, "backend", str)
        typecheck(batch_size, "batch_size", int)
        typecheck(min_batch_size, "min_batch_size", int)
        typecheck(min_batch_timeout, "min_batch_timeout", int)
        typecheck(tag, "tag", str)
        device = _check_device(device)
        backend = backend.upper()
        if backend not in BACKENDS:
            raise TypeError(f"Backend type {backend} unsupported")
        if backend not in EXECUTABLE_BACKENDS:
            raise RedisReplyError(f"ERR unsupported backend {backend}: smartredis_io workers run TORCH models",
                                  "set_model")
        if min(batch_size, min_batch_size, min_batch_timeout) < 0:
            raise RedisReplyError("ERR BATCHSIZE, MINBATCHSIZE and MINBATCHTIMEOUT must be non-negative", "set_model")
        if min_batch_size and not batch_size:
            raise RedisReplyError("ERR MINBATCHSIZE specified without BATCHSIZE", "set_model")
        if min_batch_timeout and not min_batch_size:
            raise RedisReplyError("ERR MINBATCHTIMEOUT specified without MINBATCHSIZE", "set_model")
        if min_batch_size > batch_size:
            raise RedisReplyError("ERR MINBATCHSIZE must not exceed BATCHSIZE", "set_model")
        return models.Manifest(
            "model", models.new_version(), backend, device, batch_size, min_batch_size, min_batch_timeout, tag,
            _names(inputs, "inputs"), _names(outputs, "outputs"),
        )

    def set_model_from_file(
        self,
        name: str,
        model_file: str,
        backend: str = "TORCH",
        device: str = "CPU",
        batch_size: int = 0,
        min_batch_size: int = 0,
        min_batch_timeout: int = 0,
        tag: str = "",
        inputs: str | list[str] | None = None,
        outputs: str | list[str] | None = None,
    ) -> None:
        typecheck(model_file, "model_file", str)
        with open(_check_file(model_file), "rb") as f:
            blob = f.read()
        self.set_model(name, blob, backend, device, batch_size, min_batch_size, min_batch_timeout, tag, inputs,
                       outputs)

    def _manifest_of(self, name: str, kind: str) -> tuple[str, models.Manifest]:
        key = self._get_key("model", name)
        manifest = models.load_manifest(self._db, key)
        if manifest is None or manifest.kind != kind:
            raise RedisKeyError(f"No {kind} stored at key {key!r}")
        return key, manifest

    @_translated
    def get_model(self, name: str) -> bytes:
        typecheck(name, "name", str)
        key, manifest = self._manifest_of(name, "model")
        return models.load_blob(self._db, key, manifest)

    @_translated
    def model_exists(self, name: str) -> bool:
        """True when a model or script is stored at ``name``."""
        typecheck(name, "name", str)
        return models.load_manifest(self._db, self._get_key("model", name)) is not None

    @_translated
    def delete_model(self, name: str) -> None:
        typecheck(name, "name", str)
        self._manifest_of(name, "model")
        models.delete(self._db, self._get_key("model", name))

    @_translated
    def set_script(self, name: str, script: str, device: str = "CPU") -> None:
        """Store TorchScript source; its functions run with ``run_script``."""
        typecheck(name, "name", str)
        typecheck(script, "script", str)
        self._store(name, script.encode(), models.Manifest("script", models.new_version(), device=_check_device(device)))

    def set_function(self, name: str, function: Callable, device: str = "CPU") -> None:
        """Store the source of a TorchScript-compatible Python function as a script."""
        typecheck(name, "name", str)
        if not callable(function):
            raise TypeError(f"Argument provided for function, {type(function)}, is not callable")
        self.set_script(name, textwrap.dedent(inspect.getsource(function)), device)

    def set_script_from_file(self, name: str, file: str, device: str = "CPU") -> None:
        typecheck(file, "file", str)
        with open(_check_file(file)) as f:
            self.set_script(name, f.read(), device)

    @_translated
    def get_script(self, name: str) -> str:
        typecheck(name, "name", str)
        key, manifest = self._manifest_of(name, "script")
        return models.load_blob(self._db, key, manifest).decode()

    @_translated
    def delete_script(self, name: str) -> None:
        typecheck(name, "name", str)
        self._manifest_of(name, "script")
        models.delete(self._db, self._get_key("model", name))

    @_translated
    def run_model(self, name: str, inputs: str | list[str] | None = None, outputs: str | list[str] | None = None) -> None:
        """Run the model at ``name`` on the input tensors, storing the output tensors.

        Raises:
            RedisReplyError: the worker reports an error (unknown model or tensor, a model failure).
            RedisTimeoutError: no worker finished it within ``SR_MODEL_TIMEOUT`` ms.
        """
        typecheck(name, "name", str)
        self._run("model", name, "", _names(inputs, "inputs"), _names(outputs, "outputs"), "run_model")

    @_translated
    def run_script(self, name: str, fn_name: str, inputs: str | list[str], outputs: str | list[str]) -> None:
        """Run function ``fn_name`` of the script at ``name`` on the inputs, storing the outputs."""
        typecheck(name, "name", str)
        typecheck(fn_name, "fn_name", str)
        self._run("script", name, fn_name, _names(inputs, "inputs"), _names(outputs, "outputs"), "run_script")

    def _run(self, kind: str, name: str, fn_name: str, inputs: list[str], outputs: list[str], method: str) -> None:
        timeout_s = self._model_timeout_s
        request = models.Request(
            uuid.uuid4().hex, kind, self._get_key("model", name),
            [self._get_key("tensor", t) for t in inputs], [self._put_key("tensor", t) for t in outputs],
            time.time() + timeout_s, fn_name,
        )
        # One round trip: both keys share the {srio} tag, and the pop blocks until the reply.
        popped = self._db.exchange(
            [("RPUSH", models.QUEUE_KEY, request.encode()), ("BLPOP", request.reply_key, timeout_s)]
        )[1]
        if popped is None:
            raise RedisTimeoutError(
                f"{kind} {request.key!r} did not finish within {timeout_s * 1000:.0f} ms "
                "(no execution worker answered; is one running on this database?)", method,
            )
        reply = json.loads(popped[1])
        if not reply["ok"]:
            raise RedisReplyError(reply["error"], method)
