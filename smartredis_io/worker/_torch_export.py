"""The torch internals the workers use to load and run a ``torch.export`` program safely and quickly.

Loading: after :mod:`smartredis_io._client.export_policy` has checked the archive, a pt2 archive (torch 2.7
and newer) is loaded with ``torch.export.load`` once its sample inputs are known to load with
``weights_only=True`` (so the loader's fallback to a full unpickler never runs); an archive of the
older layout (torch 2.6) has its tensor pickles loaded here with ``weights_only=True`` and handed to
torch's deserializer as objects, never as bytes it would unpickle itself.

Running: ``ExportedProgram.module()`` costs about 0.3 ms per call in input checks and pytree
handling, more than the rest of a ``run_model``; :class:`ExportedModel` calls the program's graph
directly, with its parameters and constants bound once, after checking each input's dtype and its
dimensions against the program's static sizes and the ranges of its dynamic ones.

What the graph calls is checked again on the loaded graph (node kinds, op namespaces). ``torch``
changes here break this module and its test (``tests/smartredis_io/test_torch_export.py``).
"""

from __future__ import annotations

import importlib.util
import io
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from smartredis_io._client import export_policy
from smartredis_io._client.torchscript_policy import RefusedGraph, check_ops
from smartredis_io.error import RedisReplyError

__all__ = ["ExportedModel", "load", "op_kinds", "warm_up"]

_BUILTINS = {
    *(getattr(operator, name.split(".")[1]) for name in export_policy.ALLOWED_BUILTINS if name.startswith("_operator.")),
    *(getattr(math, name.split(".")[1]) for name in export_policy.ALLOWED_BUILTINS if name.startswith("math.")),
    *(getattr(torch, name.split(".")[1]) for name in export_policy.ALLOWED_BUILTINS
      if name.startswith("torch.") and hasattr(torch, name.split(".")[1])),
}
_BOUND_INPUTS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")


def _weights_only(data: bytes, what: str, name: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: not plain tensors
        raise RedisReplyError(f"ERR {what} was refused: its {name} are not plain tensors ({exc})") from None


def _deserialize(archive: export_policy.ExportArchive, blob: bytes) -> torch.export.ExportedProgram:
    what = archive.what
    if archive.layout == "pt2":
        if importlib.util.find_spec("torch.export.pt2_archive") is None:
            raise RedisReplyError(f"ERR {what} was saved by a newer torch than this worker's {torch.__version__}")
        _weights_only(archive.read(export_policy.PT2_SAMPLE_INPUTS), what, "sample inputs")
        return torch.export.load(io.BytesIO(blob))
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    version = archive.zip.read("version").decode(errors="replace").split(".")
    if version[0] != str(SCHEMA_VERSION[0]):
        raise RedisReplyError(f"ERR {what} has export schema {'.'.join(version)}; this worker's torch "
                              f"{torch.__version__} reads schema {SCHEMA_VERSION[0]}")
    state_dict, constants, example_inputs = (
        _weights_only(archive.zip.read(name), what, name.removeprefix("serialized_").removesuffix(".pt"))
        for name in export_policy.LEGACY_TENSORS
    )
    artifact = SerializedArtifact(archive.zip.read(export_policy.LEGACY_PROGRAM), state_dict, constants,
                                  example_inputs)
    return deserialize(artifact)


def op_kinds(program: torch.export.ExportedProgram, what: str) -> set[str]:
    """``ns::op`` of every op the program's graph calls; ``RefusedGraph`` for any other node."""
    kinds = set()
    for node in program.graph_module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            raise RefusedGraph(what, f"a graph node of kind {node.op}")
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            kinds.add(target.name().split(".")[0])
        elif target not in _BUILTINS:
            raise RefusedGraph(what, getattr(target, "__qualname__", repr(target)))
    return kinds


def _dimension_checks(program: torch.export.ExportedProgram, node: torch.fx.Node) -> tuple[torch.dtype, list]:
    """The dtype of a user input, and per dimension its size or (symbol, min, max)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise RedisReplyError(f"ERR input {node.name!r} of the exported program is not a tensor")
    dims: list[Any] = []
    for size in value.shape:
        if isinstance(size, int):
            dims.append(size)
            continue
        expr = size.node.expr
        ranges = program.range_constraints.get(expr)
        low = high = None
        if ranges is not None:
            low = int(ranges.lower) if ranges.lower.is_finite else None
            high = int(ranges.upper) if ranges.upper.is_finite else None
        dims.append((str(expr), low, high))
    return value.dtype, dims


class ExportedModel:
    """An exported program's graph with its weights bound, on one device, called with its user inputs."""

    def __init__(self, program: torch.export.ExportedProgram, device: torch.device, what: str) -> None:
        signature = program.graph_signature
        for spec in signature.output_specs:
            if spec.kind.name != "USER_OUTPUT":
                raise RedisReplyError(f"ERR {what} was refused: it updates {spec.target!r} while running "
                                      f"({spec.kind.name}); export the model in eval mode")
        placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
        self.device = device
        self._graph = program.graph_module
        self._args: list[torch.Tensor | None] = []
        self._inputs: list[tuple[str, torch.dtype, list]] = []
        for spec, node in zip(signature.input_specs, placeholders, strict=True):
            kind = spec.kind.name
            if kind == "USER_INPUT":
                self._args.append(None)
                self._inputs.append((node.name, *_dimension_checks(program, node)))
            elif kind in _BOUND_INPUTS:
                tensor = program.state_dict.get(spec.target)
                if tensor is None:
                    tensor = program.constants[spec.target]
                self._args.append(tensor.detach().to(device))
            else:
                raise RedisReplyError(f"ERR {what} was refused: it takes an input of kind {kind}")
        self._user_slots = [i for i, arg in enumerate(self._args) if arg is None]

    def _check(self, inputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) != len(self._inputs):
            raise ValueError(f"the exported program takes {len(self._inputs)} inputs, got {len(inputs)}")
        symbols: dict[str, int] = {}
        for tensor, (name, dtype, dims) in zip(inputs, self._inputs, strict=True):
            if tensor.dtype != dtype:
                raise TypeError(f"input {name!r} of the exported program is {dtype}, got {tensor.dtype}")
            if tensor.dim() != len(dims):
                raise ValueError(f"input {name!r} of the exported program has {len(dims)} dimensions, "
                                 f"got shape {tuple(tensor.shape)}")
            for axis, (size, want) in enumerate(zip(tensor.shape, dims, strict=True)):
                if isinstance(want, int):
                    if size != want:
                        raise ValueError(f"input {name!r} of the exported program has size {want} in dimension "
                                         f"{axis} (export it with a dynamic dimension to vary it), got {size}")
                    continue
                symbol, low, high = want
                if (low is not None and size < low) or (high is not None and size > high):
                    raise ValueError(f"input {name!r} dimension {axis} must be in [{low}, {high}], got {size}")
                if symbols.setdefault(symbol, size) != size:
                    raise ValueError(f"inputs of the exported program must agree on dimension {symbol}: "
                                     f"{symbols[symbol]} and {size}")

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._check(inputs)
        args = list(self._args)
        for slot, tensor in zip(self._user_slots, inputs, strict=True):
            args[slot] = tensor
        result = self._graph(*args)
        return tuple(result) if isinstance(result, (list, tuple)) else (result,)


def load(blob: bytes, device: torch.device, what: str) -> ExportedModel:
    """A stored torch.export program, checked, loaded without running code from it, ready to run

    :raises RefusedGraph: if the program calls an op outside the policy's allow-list
    :raises RedisReplyError: if it is not an exported program, or holds something loading would run
    """
    archive = export_policy.check_archive(blob, what)
    program = _deserialize(archive, blob)
    check_ops(op_kinds(program, what), what)
    return ExportedModel(program, device, what)


def warm_up() -> None:
    """Export, save, load and run a tiny program in both layouts, so that every module loading one needs
    is imported (a worker that drops its privileges may no longer read Python's own files)."""
    import zipfile

    from torch._export.serde.schema import SCHEMA_VERSION
    from torch._export.serde.serialize import serialize

    example = torch.zeros(2, 1)
    program = torch.export.export(torch.nn.Identity(), (example,),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    artifact = serialize(program)
    legacy = io.BytesIO()
    with zipfile.ZipFile(legacy, "w") as archive:
        for name, data in zip(export_policy.LEGACY_TENSORS,
                              (artifact.state_dict, artifact.constants, artifact.example_inputs), strict=True):
            archive.writestr(name, data)
        archive.writestr(export_policy.LEGACY_PROGRAM, artifact.exported_program)
        archive.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
    with torch.inference_mode():
        for blob in (buffer.getvalue(), legacy.getvalue()):
            load(blob, torch.device("cpu"), "warm-up program")(example)
