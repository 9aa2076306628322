"""Multi-GPU model and script commands of the SmartRedis client.

As in SmartRedis, ``set_model_multigpu(name, ..., first_gpu, num_gpus)`` stores one copy of the model
per GPU, at ``<name>.GPU:<i>`` with device ``GPU:<i>`` for ``i`` in ``first_gpu .. first_gpu +
num_gpus - 1``, plus one at ``<name>`` with device ``GPU`` for ``get_model`` to find;
``run_model_multigpu(name, offset, first_gpu, num_gpus)`` runs the copy of GPU ``first_gpu + offset
% num_gpus`` (``offset`` is typically an MPI rank, so that ranks spread over the GPUs). The execution
workers run a copy set for ``GPU:<i>`` on CUDA device ``i``; a worker without that GPU runs it on its
own device (the CPU on a machine without GPUs) and logs a warning, so code written for a GPU cluster
runs unchanged on a laptop.
"""

from __future__ import annotations

from collections.abc import Callable

from smartredis_io._client.client_base import command
from smartredis_io._client.helpers import check_file, function_source, names, typecheck
from smartredis_io._client.model_commands import ModelCommands, checked_model
from smartredis_io.error import (
    MissingKeyRuntimeError,
    RedisKeyError,
    RedisReplyError,
    RedisRuntimeError,
    RedisTimeoutError,
)

__all__ = ["MultiGPUCommands"]


def _gpu_key(name: str, gpu: int) -> str:
    """The name of the copy of model or script ``name`` for GPU ``gpu``."""
    return f"{name}.GPU:{gpu}"


def _check_gpus(first_gpu: int, num_gpus: int) -> range:
    """The GPUs ``first_gpu .. first_gpu + num_gpus - 1``; ``ValueError`` (as SmartRedis) when empty."""
    typecheck(first_gpu, "first_gpu", int)
    typecheck(num_gpus, "num_gpus", int)
    if first_gpu < 0:
        raise ValueError("first_gpu must be a non-negative integer")
    if num_gpus < 1:
        raise ValueError("num_gpus must be a positive integer.")
    return range(first_gpu, first_gpu + num_gpus)


class MultiGPUCommands(ModelCommands):
    """Models and scripts stored once per GPU and run on the GPU an offset (a rank) picks."""

    @command
    def set_model_multigpu(
        self,
        name: str,
        model: bytes,
        backend: str,
        first_gpu: int,
        num_gpus: int,
        batch_size: int = 0,
        min_batch_size: int = 0,
        min_batch_timeout: int = 0,
        tag: str = "",
        inputs: str | list[str] | None = None,
        outputs: str | list[str] | None = None,
    ) -> None:
        """Put a model in the database for use in a multi-GPU system

        One copy is stored per GPU (``<name>.GPU:<i>``, device ``GPU:<i>``) and one at ``name``
        (device ``GPU``) for ``get_model()``. The model key may be formed by applying a prefix to
        the name; see ``use_model_ensemble_prefix()``.

        :param name: name to store model under
        :type name: str
        :param model: serialized model (TorchScript or torch.export for backend TORCH)
        :type model: bytes
        :param backend: name of the backend (TORCH, TF, TFLITE, ONNX); workers run TORCH
        :type backend: str
        :param first_gpu: the first GPU (zero-based) to use in processing this model
        :type first_gpu: int
        :param num_gpus: the number of GPUs to use in processing this model
        :type num_gpus: int
        :param batch_size: batch size for execution, defaults to 0
        :type batch_size: int, optional
        :param min_batch_size: minimum batch size for model execution, defaults to 0
        :type min_batch_size: int, optional
        :param min_batch_timeout: Max time (ms) to wait for min batch size
        :type min_batch_timeout: int, optional
        :param tag: additional tag for model information, defaults to ""
        :type tag: str, optional
        :param inputs: model inputs (TF only), defaults to None
        :type inputs: str | list[str] | None
        :param outputs: model outputs (TF only), defaults to None
        :type outputs: str | list[str] | None
        :raises TypeError: if an argument has the wrong type, or the backend is unknown
        :raises ValueError: if ``first_gpu`` is negative, ``num_gpus`` is not positive, or inputs
            or outputs are given for another backend than TF
        :raises RedisRuntimeError: if the batching arguments are inconsistent
        :raises RedisReplyError: if the model fails to set
        """
        typecheck(name, "name", str)
        typecheck(backend, "backend", str)
        typecheck(model, "model", (bytes, bytearray, memoryview))
        gpus = _check_gpus(first_gpu, num_gpus)
        arguments = (batch_size, min_batch_size, min_batch_timeout, tag, inputs, outputs, "set_model_multigpu")
        general = self._model_manifest(backend, "GPU", *arguments)
        blob = checked_model(name, model, "set_model_multigpu")
        for gpu in gpus:
            self._store(_gpu_key(name, gpu), blob, self._model_manifest(backend, f"GPU:{gpu}", *arguments))
        self._store(name, blob, general)

    def set_model_from_file_multigpu(
        self,
        name: str,
        model_file: str,
        backend: str,
        first_gpu: int,
        num_gpus: int,
        batch_size: int = 0,
        min_batch_size: int = 0,
        min_batch_timeout: int = 0,
        tag: str = "",
        inputs: str | list[str] | None = None,
        outputs: str | list[str] | None = None,
    ) -> None:
        """Put a model from a file in the database for use in a multi-GPU system

        As ``set_model_multigpu()``, with the model read from ``model_file``.

        :param name: name to store model under
        :type name: str
        :param model_file: path to the serialized model
        :type model_file: str
        :param backend: name of the backend (TORCH, TF, TFLITE, ONNX); workers run TORCH
        :type backend: str
        :param first_gpu: the first GPU (zero-based) to use in processing this model
        :type first_gpu: int
        :param num_gpus: the number of GPUs to use in processing this model
        :type num_gpus: int
        :param batch_size: batch size for execution, defaults to 0
        :type batch_size: int, optional
        :param min_batch_size: minimum batch size for model execution, defaults to 0
        :type min_batch_size: int, optional
        :param min_batch_timeout: Max time (ms) to wait for min batch size
        :type min_batch_timeout: int, optional
        :param tag: additional tag for model information, defaults to ""
        :type tag: str, optional
        :param inputs: model inputs (TF only), defaults to None
        :type inputs: str | list[str] | None
        :param outputs: model outputs (TF only), defaults to None
        :type outputs: str | list[str] | None
        :raises TypeError: if an argument has the wrong type, or the backend is unknown
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises FileNotFoundError: if ``model_file`` does not exist
        :raises RedisRuntimeError: if the batching arguments are inconsistent
        :raises RedisReplyError: if the model fails to set
        """
        typecheck(name, "name", str)
        typecheck(model_file, "model_file", str)
        typecheck(backend, "backend", str)
        _check_gpus(first_gpu, num_gpus)
        self._model_manifest(backend, "GPU", batch_size, min_batch_size, min_batch_timeout, tag, inputs, outputs,
                             "set_model_from_file_multigpu")
        with open(check_file(model_file), "rb") as f:
            blob = f.read()
        self.set_model_multigpu(name, blob, backend, first_gpu, num_gpus, batch_size, min_batch_size,
                                min_batch_timeout, tag, inputs, outputs)

    @command
    def run_model_multigpu(
        self,
        name: str,
        offset: int,
        first_gpu: int,
        num_gpus: int,
        inputs: str | list[str] | None = None,
        outputs: str | list[str] | None = None,
    ) -> None:
        """Execute a model stored for a multi-GPU system, on GPU ``first_gpu + offset % num_gpus``

        :param name: name for stored model
        :type name: str
        :param offset: index of the current image, such as a processor ID or MPI rank
        :type offset: int
        :param first_gpu: the first GPU (zero-based) to use in processing this model
        :type first_gpu: int
        :param num_gpus: the number of gpus for which the model was stored
        :type num_gpus: int
        :param inputs: names of stored inputs to provide model, defaults to None
        :type inputs: str | list[str] | None
        :param outputs: names to store outputs under, defaults to None
        :type outputs: str | list[str] | None
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises RedisReplyError: if the model execution fails
        :raises RedisTimeoutError: if no worker finished it within ``SR_MODEL_TIMEOUT`` ms
        """
        typecheck(name, "name", str)
        typecheck(offset, "offset", int)
        gpu = self._pick_gpu(offset, first_gpu, num_gpus)
        in_names, out_names = names(inputs, "inputs"), names(outputs, "outputs")
        self._run_on(gpu, "model", name, "", in_names, out_names, "run_model_multigpu")

    @command
    def delete_model_multigpu(self, name: str, first_gpu: int, num_gpus: int) -> None:
        """Remove a model that was stored for use with multiple GPUs (every copy, and the general one)

        :param name: the name the model is stored under
        :type name: str
        :param first_gpu: the first GPU (zero-based) the model was stored for
        :type first_gpu: int
        :param num_gpus: the number of gpus for which the model was stored
        :type num_gpus: int
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises RedisRuntimeError: if a copy is missing (the others are still removed)
        """
        self._delete_copies(name, first_gpu, num_gpus, "model")

    @command
    def set_script_multigpu(self, name: str, script: str, first_gpu: int, num_gpus: int) -> None:
        """Store a TorchScript script for use in a multi-GPU system (one copy per GPU)

        :param name: name to store the script under
        :type name: str
        :param script: TorchScript code
        :type script: str
        :param first_gpu: the first GPU (zero-based) to use in processing this script
        :type first_gpu: int
        :param num_gpus: the number of GPUs to use in processing this script
        :type num_gpus: int
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises RedisReplyError: if the script fails to set
        """
        typecheck(name, "name", str)
        typecheck(script, "script", str)
        for gpu in _check_gpus(first_gpu, num_gpus):
            self.set_script(_gpu_key(name, gpu), script, f"GPU:{gpu}")
        self.set_script(name, script, "GPU")

    def set_script_from_file_multigpu(self, name: str, file: str, first_gpu: int, num_gpus: int) -> None:
        """Same as ``set_script_multigpu()``, with the script read from a file

        :param name: key to store script under
        :type name: str
        :param file: path to text file containing TorchScript code
        :type file: str
        :param first_gpu: the first GPU (zero-based) to use in processing this script
        :type first_gpu: int
        :param num_gpus: the number of GPUs to use in processing this script
        :type num_gpus: int
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises FileNotFoundError: if ``file`` does not exist
        :raises RedisReplyError: if the script fails to set
        """
        typecheck(name, "name", str)
        typecheck(file, "file", str)
        _check_gpus(first_gpu, num_gpus)
        with open(check_file(file)) as f:
            self.set_script_multigpu(name, f.read(), first_gpu, num_gpus)

    def set_function_multigpu(self, name: str, function: Callable, first_gpu: int, num_gpus: int) -> None:
        """Set a callable TorchScript function into the database for use in a multi-GPU system

        Run it with ``run_script_multigpu(name, function.__name__, ...)``.

        :param name: name to store function at
        :type name: str
        :param function: callable function
        :type function: callable
        :param first_gpu: the first GPU (zero-based) to use in processing this function
        :type first_gpu: int
        :param num_gpus: the number of GPUs to use for this function
        :type num_gpus: int
        :raises TypeError: if an argument was not a callable function or has the wrong type
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises RedisReplyError: if function failed to set
        """
        typecheck(name, "name", str)
        typecheck(first_gpu, "first_gpu", int)
        typecheck(num_gpus, "num_gpus", int)
        self.set_script_multigpu(name, function_source(function), first_gpu, num_gpus)

    @command
    def run_script_multigpu(
        self,
        name: str,
        fn_name: str,
        inputs: str | list[str],
        outputs: str | list[str],
        offset: int,
        first_gpu: int,
        num_gpus: int,
    ) -> None:
        """Execute a function of a script stored for a multi-GPU system, on GPU ``first_gpu + offset % num_gpus``

        :param name: the name the script is stored under
        :type name: str
        :param fn_name: name of a function within the script to execute
        :type fn_name: str
        :param inputs: database tensor names to use as script inputs
        :type inputs: str | list[str]
        :param outputs: database tensor names to receive script outputs
        :type outputs: str | list[str]
        :param offset: index of the current image, such as a processor ID or MPI rank
        :type offset: int
        :param first_gpu: the first GPU (zero-based) to use in processing this script
        :type first_gpu: int
        :param num_gpus: the number of gpus for which the script was stored
        :type num_gpus: int
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises RedisReplyError: if script execution fails
        :raises RedisTimeoutError: if no worker finished it within ``SR_MODEL_TIMEOUT`` ms
        """
        typecheck(name, "name", str)
        typecheck(fn_name, "fn_name", str)
        in_names, out_names = names(inputs, "inputs"), names(outputs, "outputs")
        typecheck(offset, "offset", int)
        gpu = self._pick_gpu(offset, first_gpu, num_gpus)
        self._run_on(gpu, "script", name, fn_name, in_names, out_names, "run_script_multigpu")

    @command
    def delete_script_multigpu(self, name: str, first_gpu: int, num_gpus: int) -> None:
        """Remove a script that was stored for use with multiple GPUs (every copy, and the general one)

        :param name: the name the script is stored under
        :type name: str
        :param first_gpu: the first GPU (zero-based) the script was stored for
        :type first_gpu: int
        :param num_gpus: the number of gpus for which the script was stored
        :type num_gpus: int
        :raises TypeError: if an argument has the wrong type
        :raises ValueError: if ``first_gpu`` is negative or ``num_gpus`` is not positive
        :raises RedisRuntimeError: if a copy is missing (the others are still removed)
        """
        self._delete_copies(name, first_gpu, num_gpus, "script")

    # ---- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _pick_gpu(offset: int, first_gpu: int, num_gpus: int) -> int:
        _check_gpus(first_gpu, num_gpus)
        return first_gpu + offset % num_gpus

    def _run_on(self, gpu: int, kind: str, name: str, fn_name: str, inputs: list[str], outputs: list[str],
                method: str) -> None:
        try:
            self._run(kind, _gpu_key(name, gpu), fn_name, inputs, outputs, method)
        except RedisTimeoutError:
            raise
        except RedisReplyError as exc:
            raise RedisRuntimeError(f"An error occurred while executing the {kind} on GPU:{gpu}: {exc}",
                                    method) from exc

    def _delete_copies(self, name: str, first_gpu: int, num_gpus: int, kind: str) -> None:
        typecheck(name, "name", str)
        missing = []
        for key in [*(_gpu_key(name, gpu) for gpu in _check_gpus(first_gpu, num_gpus)), name]:
            try:
                self._delete(key, kind)
            except RedisKeyError:
                missing.append(key)
        if missing:
            raise MissingKeyRuntimeError(f"Failed to remove {kind} copies {missing}: they do not exist",
                                    f"delete_{kind}_multigpu")
