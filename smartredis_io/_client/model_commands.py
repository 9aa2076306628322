"""Model and script commands of the SmartRedis client, run by ``smartredis_io.worker`` processes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from smartredis_io._client import export_policy, placement, protocol, torchscript_policy
from smartredis_io._client.client_base import ClientBase, command, poll
from smartredis_io._client.helpers import check_file, function_source, names, typecheck
from smartredis_io.error import RedisKeyError, RedisReplyError, RedisRuntimeError, RedisTimeoutError

__all__ = ["BACKENDS", "EXECUTABLE_BACKENDS", "ModelCommands"]

BACKENDS = ("TF", "TFLITE", "TORCH", "ONNX")
EXECUTABLE_BACKENDS = ("TORCH",)

log = logging.getLogger(__name__)


def checked_model(name: str, model: bytes | bytearray | memoryview, method: str) -> bytes:
    """The model's bytes, once its name is known not to be empty and the model safe to load."""
    if not name:
        raise ValueError("name is a required parameter of set_model.")
    blob = bytes(model)
    export_policy.check_model(blob, f"model {name!r}", method)
    return blob


def _check_device(device: str) -> str:
    typecheck(device, "device", str)
    device = device.upper()
    if not device.startswith(("CPU", "GPU")):
        raise TypeError("Device argument must start with either CPU or GPU")
    return device


def _check_batching(batch_size: int, min_batch_size: int, min_batch_timeout: int, method: str) -> None:
    """SmartRedis' checks of the batching arguments (and its warning for a minimum without a timeout)."""
    if min(batch_size, min_batch_size, min_batch_timeout) < 0:
        raise RedisRuntimeError("batch_size, min_batch_size and min_batch_timeout must be non-negative", method)
    if batch_size == 0 and (min_batch_size > 0 or min_batch_timeout > 0):
        raise RedisRuntimeError("batch_size must be non-zero if min_batch_size or min_batch_timeout is used; "
                                "otherwise batching will not be performed.", method)
    if min_batch_timeout > 0 and min_batch_size == 0:
        raise RedisRuntimeError("min_batch_size must be non-zero if min_batch_timeout is used; otherwise the "
                                "min_batch_timeout parameter is ignored.", method)
    if min_batch_size > batch_size:
        raise RedisRuntimeError("min_batch_size must not exceed batch_size", method)
    if min_batch_size > 0 and min_batch_timeout == 0:
        log.warning("min_batch_timeout was not set when a non-zero min_batch_size was selected: a model waits "
                    "for min_batch_size requests without a time limit. Setting a small value (~10 ms) for "
                    "min_batch_timeout may improve performance.")


class ModelCommands(ClientBase):
    """Models (TorchScript) and scripts (TorchScript source), stored in the database and run by workers."""

    _model_timeout_s: float
    #: the chunk size models are stored with (``set_model_chunk_size``); None: the bulk limit
    _model_chunk_bytes: int | None = None

    #: whether models and scripts go on every shard, as SmartRedis puts them (a cluster with the
    #: smartredis_io Redis module; see ``smartredis_io._client.placement``); None: not asked yet
    _on_every_shard: bool | None = None

    def _sharded(self) -> bool:
        if self._on_every_shard is None:
            self._on_every_shard = self._db.cluster and placement.module_loaded(self._db)
        return self._on_every_shard

    #: ``placement.shard_ranges`` of this cluster, looked up at the first run
    _shard_ranges: list | None = None

    def _copy_near(self, key: str, near: str | None, refresh: bool = False) -> str | bytes:
        """The key a run uses: in a cluster with the module, the copy of the model or script on the
        shard of its first input (as SmartRedis picks it), which the worker then finds with the input
        in its request; else ``key`` itself."""
        if not self._sharded():
            return key
        if self._shard_ranges is None or refresh:
            self._shard_ranges = placement.shard_ranges(self._db)
        slot = self._db.redis.keyslot(near) if near is not None else 0
        return placement.key_on_shard(self._shard_ranges, slot, key)

    def _store(self, name: str, blob: bytes, manifest: protocol.Manifest) -> None:
        if self._sharded():
            placement.store(self._db, self._put_key("model", name), blob, manifest, self._model_chunk_bytes)
            return
        protocol.store(self._db, self._put_key("model", name), blob, manifest, self._model_chunk_bytes)

    def _blob_of(self, name: str, kind: str) -> bytes:
        """The bytes of the stored model or script ``name``; ``RedisKeyError`` when there is none."""
        if self._sharded():
            return placement.get_blob(self._db, self._get_key("model", name), kind)
        key, manifest = self._manifest_of(name, kind)
        return protocol.load_blob(self._db, key, manifest)

    def _delete(self, name: str, kind: str) -> None:
        """Delete the stored model or script ``name``; ``RedisKeyError`` when there is none."""
        if self._sharded():
            placement.delete(self._db, self._get_key("model", name), kind)
            return
        self._manifest_of(name, kind)
        protocol.delete(self._db, self._get_key("model", name))

    @command
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
        """Put a serialized model to the database

        The model (for backend ``TORCH``: a ``torch.export.save`` archive of a program exported
        with ``torch.export.export``, or TorchScript from ``torch.jit.save``) is run by the
        execution workers with ``run_model()``; export the batch dimension as dynamic
        (``torch.export.Dim``) to run batched. With ``batch_size > 0`` the workers batch
        concurrent requests as RedisAI does: up to ``batch_size`` rows, waiting at most
        ``min_batch_timeout`` ms for ``min_batch_size`` of them. The key may be formed by applying a
        prefix to the name; see ``use_model_ensemble_prefix()``. Replacing a model is atomic: a
        request in flight runs either the old model or the new one.

        :param name: name to store the model under
        :type name: str
        :param model: the serialized model
        :type model: bytes
        :param backend: name of the backend (TORCH, TF, TFLITE, ONNX); workers run TORCH
        :type backend: str
        :param device: device to run the model on: CPU or GPU
        :type device: str
        :param batch_size: batch size for model execution (0: no batching)
        :type batch_size: int
        :param min_batch_size: minimum batch size for model execution
        :type min_batch_size: int
        :param min_batch_timeout: max time (ms) to wait for the minimum batch size
        :type min_batch_timeout: int
        :param tag: additional tag for model information
        :type tag: str
        :param inputs: model inputs (TF only), defaults to None
        :type inputs: str | list[str] | None
        :param outputs: model outputs (TF only), defaults to None
        :type outputs: str | list[str] | None
        :raises TypeError: if an argument has the wrong type, or the backend or device is unknown
        :raises ValueError: if ``name`` is empty, or inputs or outputs are given for another backend than TF
        :raises RedisRuntimeError: if the batching arguments are inconsistent
        :raises RedisReplyError: if no worker runs the backend, the model is neither a TorchScript
            nor a torch.export archive, it uses an op that touches files, processes or the network
            (see ``smartredis_io._client.torchscript_policy``), loading it would run code from it (see
            ``smartredis_io._client.export_policy``), or it fails to set
        """
        typecheck(name, "name", str)
        typecheck(model, "model", (bytes, bytearray, memoryview))
        manifest = self._model_manifest(backend, device, batch_size, min_batch_size, min_batch_timeout, tag,
                                        inputs, outputs)
        self._store(name, checked_model(name, model, "set_model"), manifest)

    @staticmethod
    def _model_manifest(backend: str, device: str, batch_size: int, min_batch_size: int, min_batch_timeout: int,
                        tag: str, inputs: str | list[str] | None, outputs: str | list[str] | None,
                        method: str = "set_model") -> protocol.Manifest:
        typecheck(backend, "backend", str)
        typecheck(batch_size, "batch_size", int)
        typecheck(min_batch_size, "min_batch_size", int)
        typecheck(min_batch_timeout, "min_batch_timeout", int)
        typecheck(tag, "tag", str)
        device = _check_device(device)
        backend = backend.upper()
        if backend not in BACKENDS:
            raise TypeError(f"Backend type {backend} unsupported")
        input_names, output_names = names(inputs, "inputs"), names(outputs, "outputs")
        if backend != "TF" and input_names:
            raise ValueError("INPUTS in the model set command is only valid for TF models")
        if backend != "TF" and output_names:
            raise ValueError("OUTPUTS in the model set command is only valid for TF models")
        if backend not in EXECUTABLE_BACKENDS:
            raise RedisReplyError(f"ERR unsupported backend {backend}: smartredis_io workers run TORCH models",
                                  method)
        _check_batching(batch_size, min_batch_size, min_batch_timeout, method)
        return protocol.Manifest(
            "model", protocol.new_version(), backend, device, batch_size, min_batch_size, min_batch_timeout, tag,
            input_names, output_names,
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
        """Put a serialized model from a file to the database

        As ``set_model()``, with the model read from ``model_file``.

        :param name: name to store the model under
        :type name: str
        :param model_file: path to the serialized model
        :type model_file: str
        :param backend: name of the backend (TORCH, TF, TFLITE, ONNX); workers run TORCH
        :type backend: str
        :param device: device to run the model on: CPU or GPU
        :type device: str
        :param batch_size: batch size for model execution (0: no batching)
        :type batch_size: int
        :param min_batch_size: minimum batch size for model execution
        :type min_batch_size: int
        :param min_batch_timeout: max time (ms) to wait for the minimum batch size
        :type min_batch_timeout: int
        :param tag: additional tag for model information
        :type tag: str
        :param inputs: model inputs (TF only), defaults to None
        :type inputs: str | list[str] | None
        :param outputs: model outputs (TF only), defaults to None
        :type outputs: str | list[str] | None
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if inputs or outputs are given for another backend than TF
        :raises FileNotFoundError: if ``model_file`` does not exist
        :raises RedisRuntimeError: if the batching arguments are inconsistent
        :raises RedisReplyError: if the model fails to set
        """
        typecheck(name, "name", str)
        typecheck(model_file, "model_file", str)
        self._model_manifest(backend, device, batch_size, min_batch_size, min_batch_timeout, tag, inputs, outputs,
                             "set_model_from_file")
        with open(check_file(model_file), "rb") as f:
            blob = f.read()
        self.set_model(name, blob, backend, device, batch_size, min_batch_size, min_batch_timeout, tag, inputs,
                       outputs)

    def _manifest_of(self, name: str, kind: str) -> tuple[str, protocol.Manifest]:
        key = self._get_key("model", name)
        manifest = protocol.load_manifest(self._db, key)
        if manifest is None or manifest.kind != kind:
            raise RedisKeyError(f"No {kind} stored at key {key!r}")
        return key, manifest

    @command
    def get_model(self, name: str) -> bytes:
        """Get a stored model

        :param name: name the model is stored under
        :type name: str
        :return: the serialized model
        :rtype: bytes
        :raises RedisKeyError: if there is no model at that name
        :raises RedisReplyError: if the retrieval fails
        """
        typecheck(name, "name", str)
        return self._blob_of(name, "model")

    @command
    def model_exists(self, name: str) -> bool:
        """Check whether a model or script exists in the database

        :param name: name the model or script would be stored under
        :type name: str
        :return: whether it exists
        :rtype: bool
        :raises RedisReplyError: if the check fails
        """
        typecheck(name, "name", str)
        if self._sharded():
            return placement.exists(self._db, self._get_key("model", name))
        return protocol.load_manifest(self._db, self._get_key("model", name)) is not None

    def poll_model(self, name: str, poll_frequency_ms: int, num_tries: int) -> bool:
        """Wait for a model or script to exist in the database

        :param name: name the model or script would be stored under
        :type name: str
        :param poll_frequency_ms: milliseconds between checks
        :type poll_frequency_ms: int
        :param num_tries: how many times to check
        :type num_tries: int
        :return: whether it was found
        :rtype: bool
        :raises RedisReplyError: if a check fails
        """
        return poll(lambda: self.model_exists(name), poll_frequency_ms, num_tries)

    @command
    def delete_model(self, name: str) -> None:
        """Delete a stored model

        :param name: name the model is stored under
        :type name: str
        :raises RedisKeyError: if there is no model at that name
        :raises RedisReplyError: if the deletion fails
        """
        typecheck(name, "name", str)
        self._delete(name, "model")

    def _alias_model(self, alias: str, target: str) -> None:
        """Point the model name ``alias`` at the model stored under ``target`` (one write; on every
        shard of a cluster, a copy of the model)."""
        if self._sharded():
            key = self._put_key("model", target)
            reply = self._db.redis.execute_command("AI.MODELGET", placement.first_shard_key(key), "META", "BLOB")
            meta = dict(zip(reply[0::2], reply[1::2], strict=True))
            blob = meta[b"blob"]
            manifest = protocol.Manifest(
                "model", protocol.new_version(), backend=meta[b"backend"].decode(), device=meta[b"device"].decode(),
                batch_size=int(meta[b"batchsize"]), min_batch_size=int(meta[b"minbatchsize"]),
                min_batch_timeout=int(meta[b"minbatchtimeout"]), tag=meta[b"tag"].decode())
            self._store(alias, b"".join(blob) if isinstance(blob, list) else blob, manifest)
            return
        protocol.alias(self._db, self._put_key("model", alias), self._put_key("model", target))

    @command
    def set_script(self, name: str, script: str, device: str = "CPU") -> None:
        """Put a TorchScript script to the database

        The functions of the script run with ``run_script()``.

        :param name: name to store the script under
        :type name: str
        :param script: TorchScript source code
        :type script: str
        :param device: device to run the script on: CPU or GPU
        :type device: str
        :raises TypeError: if an argument has the wrong type or the device is unknown
        :raises RedisReplyError: if the script uses an op that touches files, processes or the
            network (see ``smartredis_io._client.torchscript_policy``), or it fails to set
        """
        typecheck(name, "name", str)
        typecheck(script, "script", str)
        device = _check_device(device)
        torchscript_policy.check_source(script, f"script {name!r}", "set_script")
        self._store(name, script.encode(), protocol.Manifest("script", protocol.new_version(), device=device))

    def set_function(self, name: str, function: Callable, device: str = "CPU") -> None:
        """Put a TorchScript-compatible Python function to the database as a script

        The function's source is stored; run it with ``run_script(name, function.__name__, ...)``.

        :param name: name to store the script under
        :type name: str
        :param function: a TorchScript-compatible function
        :type function: callable
        :param device: device to run the function on: CPU or GPU
        :type device: str
        :raises TypeError: if the argument is not a callable function
        :raises RedisReplyError: if the function fails to set
        """
        typecheck(name, "name", str)
        self.set_script(name, function_source(function), device)

    def set_script_from_file(self, name: str, file: str, device: str = "CPU") -> None:
        """Put a TorchScript script from a file to the database

        :param name: name to store the script under
        :type name: str
        :param file: path to the TorchScript source file
        :type file: str
        :param device: device to run the script on: CPU or GPU
        :type device: str
        :raises TypeError: if an argument has the wrong type
        :raises FileNotFoundError: if ``file`` does not exist
        :raises RedisReplyError: if the script fails to set
        """
        typecheck(name, "name", str)
        typecheck(file, "file", str)
        _check_device(device)
        with open(check_file(file)) as f:
            self.set_script(name, f.read(), device)

    @command
    def get_script(self, name: str) -> str:
        """Get a stored script

        :param name: name the script is stored under
        :type name: str
        :return: the script's source
        :rtype: str
        :raises RedisKeyError: if there is no script at that name
        :raises RedisReplyError: if the retrieval fails
        """
        typecheck(name, "name", str)
        return self._blob_of(name, "script").decode()

    @command
    def delete_script(self, name: str) -> None:
        """Delete a stored script

        :param name: name the script is stored under
        :type name: str
        :raises RedisKeyError: if there is no script at that name
        :raises RedisReplyError: if the deletion fails
        """
        typecheck(name, "name", str)
        self._delete(name, "script")

    @command(timeout=lambda self: self._model_timeout_s + self._db.settings.command_timeout_s)
    def run_model(self, name: str, inputs: str | list[str] | None = None, outputs: str | list[str] | None = None) -> None:
        """Execute a stored model

        An execution worker runs the model on the input tensors and stores the outputs; the call
        returns when they are stored. Input keys are formed with the read prefix, output keys with
        the write prefix (see ``use_tensor_ensemble_prefix()``).

        :param name: name the model is stored under
        :type name: str
        :param inputs: names of the input tensors
        :type inputs: str | list[str]
        :param outputs: names to store the output tensors at
        :type outputs: str | list[str]
        :raises TypeError: if an argument has the wrong type
        :raises RedisReplyError: if the worker reports an error (unknown model or tensor, a
            failure of the model)
        :raises RedisTimeoutError: if no worker finished it within ``SR_MODEL_TIMEOUT`` ms
        """
        typecheck(name, "name", str)
        self._run("model", name, "", names(inputs, "inputs"), names(outputs, "outputs"), "run_model")

    @command(timeout=lambda self: self._model_timeout_s + self._db.settings.command_timeout_s)
    def run_script(self, name: str, fn_name: str, inputs: str | list[str], outputs: str | list[str]) -> None:
        """Execute a function of a stored script

        :param name: name the script is stored under
        :type name: str
        :param fn_name: name of the function in the script
        :type fn_name: str
        :param inputs: names of the input tensors
        :type inputs: str | list[str]
        :param outputs: names to store the output tensors at
        :type outputs: str | list[str]
        :raises TypeError: if an argument has the wrong type
        :raises RedisReplyError: if the worker reports an error (unknown script, function or
            tensor, a failure of the function)
        :raises RedisTimeoutError: if no worker finished it within ``SR_MODEL_TIMEOUT`` ms
        """
        typecheck(name, "name", str)
        typecheck(fn_name, "fn_name", str)
        self._run("script", name, fn_name, names(inputs, "inputs"), names(outputs, "outputs"), "run_script")

    def _run(self, kind: str, name: str, fn_name: str, inputs: list[str], outputs: list[str], method: str) -> None:
        """One round trip: the module checks the request against this user's ACL, queues it, and
        answers once a worker has stored the outputs (or at the deadline)."""
        timeout_ms = max(round(self._model_timeout_s * 1000), 1)
        key = self._get_key("model", name)
        input_keys = [self._get_key("tensor", t) for t in inputs]
        output_keys = [self._put_key("tensor", t) for t in outputs]
        for attempt in range(2):
            target = self._copy_near(key, input_keys[0] if input_keys else None, refresh=attempt > 0)
            command = protocol.execute_command(kind, target, fn_name, input_keys, output_keys, timeout_ms)
            reply = self._db.exchange([command], raise_on_error=False, block_s=timeout_ms / 1000)[0]
            if not (self._sharded() and isinstance(reply, redis.exceptions.ResponseError) and "is empty" in str(reply)):
                break  # a cluster's copy not found: the shards may have changed; look them up once more
        if not isinstance(reply, redis.exceptions.ResponseError):
            return
        text = str(reply)
        if text.startswith("TIMEDOUT"):
            raise RedisTimeoutError(f"{text} (SR_MODEL_TIMEOUT)", method)
        if "unknown command" in text.lower():
            raise RedisReplyError(f"{kind} {key!r} cannot run: the database does not serve AI.MODELEXECUTE; "
                                  f"{protocol.MODULE_HINT}", method)
        if isinstance(reply, redis.exceptions.NoPermissionError) or text.startswith("NOPERM"):
            raise RedisReplyError(f"NOPERM {text.removeprefix('NOPERM ')}", method)
        raise RedisReplyError(text, method)
