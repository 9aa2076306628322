"""The torch internals the workers use to compile scripts and to list the ops of a loaded graph.

``torch.jit`` has no public way to enumerate every method of a loaded module or to walk a graph's
nested blocks; the calls that do are here, so that a torch release that changes them breaks one
module and its test (``tests/smartredis_io/test_torchscript_policy.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["all_schemas", "compile_script", "op_kinds", "takes_lists"]

# Names a stored script may refer to: TorchScript's builtins and nothing from the worker's own
# module (a script compiled with the caller's frame could otherwise reach its globals).
_SCRIPT_SCOPE = {"torch": torch, "math": math}


def compile_script(source: str) -> torch.jit.CompilationUnit:
    """Compile TorchScript source; names resolve to ``torch`` and ``math`` only. Nothing runs."""
    unit = torch.jit.CompilationUnit()
    unit.define(source, _SCRIPT_SCOPE.get)
    return unit


def _graphs(runnable: Any) -> Iterator[Any]:
    if isinstance(runnable, torch.jit.CompilationUnit):
        for function in runnable.get_functions():
            yield function.inlined_graph
        return
    for module in runnable.modules():
        for name in module._c._method_names():
            yield module._c._get_method(name).inlined_graph


def _kinds(block: Any) -> Iterator[str]:
    for node in block.nodes():
        yield node.kind()
        for inner in node.blocks():
            yield from _kinds(inner)


def op_kinds(runnable: torch.jit.ScriptModule | torch.jit.CompilationUnit) -> set[str]:
    """The kind (``ns::name``) of every node of every method and function, calls inlined."""
    return {kind for graph in _graphs(runnable) for kind in _kinds(graph)}


def all_schemas() -> list[Any]:
    """Every operator schema registered in this process."""
    return list(torch._C._jit_get_all_schemas())


_LIST_SIGNATURE = ("List[Tensor]", "List[str]", "List[str]")


def takes_lists(function: Any) -> bool:
    """Whether a script function is declared ``(tensors: List[Tensor], keys: List[str], args: List[str])``,
    the signature RedisAI's AI.SCRIPTEXECUTE calls with its INPUTS, KEYS and ARGS."""
    arguments = function.schema.arguments
    return tuple(str(argument.type) for argument in arguments) == _LIST_SIGNATURE
