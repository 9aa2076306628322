"""Which ``torch.export`` programs a worker loads: the TorchScript policy's ops, and nothing that runs code.

``torch.export.load`` trusts its input: it unpickles weights, constants and custom objects with
``weights_only=False``, loads AOTInductor shared libraries, parses the program's symbolic shapes with
``sympy.sympify`` (an ``eval``), resolves node targets by name anywhere under ``torch`` (``torch.load``
would do), and turns the program's guards into Python source it ``exec``s. A stored ``.pt2`` is
therefore checked here, statically, before any of it is loaded:

* the archive is a torch.export archive of one program (``archive/models/model.json`` or the older
  ``serialized_exported_program.json`` layout), with no AOTInductor code and no weights, constants or
  custom objects that would be unpickled (only raw tensor bytes; the older layout's tensor pickles
  are loaded by the worker with ``weights_only=True``);
* every node target is an op of the namespaces ``torchscript_policy`` allows (and none of its denied
  ops) or one of a few arithmetic builtins of symbolic shapes;
* every symbolic expression is arithmetic on symbols and numbers (parsed with :mod:`ast`, never
  evaluated); the program has no guards code, no subgraphs and no custom objects.

The worker checks the loaded graph again (:mod:`smartredis_io.worker._torch_export`). This module needs no
torch: the client checks a program at ``set_model`` without importing it.
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from collections.abc import Iterator
from typing import Any

from smartredis_io._client import torchscript_policy
from smartredis_io._client.torchscript_policy import RefusedGraph, check_ops
from smartredis_io.error import RedisReplyError

__all__ = [
    "ALLOWED_BUILTINS",
    "ExportArchive",
    "check_archive",
    "check_expression",
    "check_model",
    "is_export_archive",
]

#: Targets outside ``torch.ops`` that exported graphs use for symbolic shape arithmetic.
ALLOWED_BUILTINS = frozenset({
    *(f"_operator.{name}" for name in (
        "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pos", "pow", "abs", "eq", "ne", "lt",
        "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert",
    )),
    *(f"math.{name}" for name in ("ceil", "floor", "sqrt", "trunc")),
    *(f"torch.{name}" for name in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite")),
})
#: Argument kinds that would load subgraphs, custom objects or arbitrary operators.
REFUSED_ARGUMENTS = frozenset({"as_graph", "as_custom_obj", "as_operator"})
#: Names a symbolic expression may call or name: sympy's and torch's shape functions, and keyword names.
EXPRESSION_NAMES = frozenset({
    "Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Mod", "Abs", "Eq", "Ne", "Lt",
    "Le", "Gt", "Ge", "And", "Or", "Not", "floor", "ceiling", "sqrt", "oo", "zoo", "nan", "true", "false",
    "S", "Half", "One", "Zero", "NegativeOne", "Infinity", "NegativeInfinity", "BooleanTrue", "BooleanFalse",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "OpaqueUnaryFn_sqrt",
    "Identity", "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor",
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "infinite", "zero",
    "even", "odd", "True", "False", "None",
})
_SYMBOL = re.compile(r"[a-z]+[0-9]+\Z")  # s0, s77, u3, ...: the symbols torch names sizes with
_SAFE_STRING = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SAFE_NODES = (
    ast.Expression, ast.Call, ast.Name, ast.Load, ast.Constant, ast.keyword, ast.BinOp, ast.UnaryOp, ast.Compare,
    ast.BoolOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
    ast.Not, ast.Invert, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.And, ast.Or, ast.BitAnd,
    ast.BitOr, ast.BitXor, ast.LShift, ast.RShift, ast.Tuple,
)
MAX_EXPRESSION_CHARS = 10_000

PT2_MODEL = "models/model.json"
PT2_WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
PT2_CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
PT2_SAMPLE_INPUTS = "data/sample_inputs/model.pt"
LEGACY_PROGRAM = "serialized_exported_program.json"
LEGACY_TENSORS = ("serialized_state_dict.pt", "serialized_constants.pt", "serialized_example_inputs.pt")


class ExportArchive:
    """A torch.export archive as a zip: which layout it has and where its members are."""

    def __init__(self, blob: bytes, what: str, method: str = "") -> None:
        try:
            self.zip = zipfile.ZipFile(io.BytesIO(blob))
            names = self.zip.namelist()
        except (zipfile.BadZipFile, ValueError):
            raise RedisReplyError(f"ERR {what} is not a torch.export archive (torch.export.save output)",
                                  method) from None
        self.what, self.method = what, method
        self.names = names
        pt2 = [n for n in names if n.endswith("/" + PT2_MODEL) or n == PT2_MODEL]
        #: "pt2" (torch 2.7 and newer) or "legacy" (serialized_exported_program.json, torch 2.6)
        self.layout = "pt2" if pt2 else "legacy" if LEGACY_PROGRAM in names else ""
        self.root = pt2[0][:-len(PT2_MODEL)] if pt2 else ""

    def member(self, name: str) -> str:
        """The archive's name of ``name`` (under the pt2 archive's root folder)."""
        return self.root + name

    def read(self, name: str) -> bytes:
        return self.zip.read(self.member(name))

    def refuse(self, why: str) -> RedisReplyError:
        return _refused(self.what, why, self.method)


def is_export_archive(blob: bytes) -> bool:
    """Whether ``blob`` looks like a torch.export archive (and not a TorchScript one)."""
    if blob[:4] != b"PK\x03\x04":
        return False
    try:
        names = zipfile.ZipFile(io.BytesIO(blob)).namelist()
    except (zipfile.BadZipFile, ValueError):
        return False
    return LEGACY_PROGRAM in names or any(n == PT2_MODEL or n.endswith("/" + PT2_MODEL) for n in names)


def _refused(what: str, why: str, method: str = "") -> RedisReplyError:
    return RedisReplyError(f"ERR {what} was refused: {why}", method)


def check_expression(text: str, what: str, method: str = "") -> None:
    """Refuse a symbolic-shape expression that is not arithmetic on symbols and numbers

    :param text: the expression (``expr_str`` of the program)
    :param what: names the model in errors
    :param method: the client method errors are raised from
    :raises RedisReplyError: if the expression does anything else (the loader would ``eval`` it)
    """
    shown = repr(text[:80])
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _refused(what, "a symbolic shape expression is too long to check", method)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _refused(what, f"the symbolic shape expression {shown} does not parse", method) from None
    for node in ast.walk(tree):
        if not isinstance(node, _SAFE_NODES):
            raise _refused(what, f"the symbolic shape expression {shown} is not plain arithmetic", method)
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            raise _refused(what, f"the symbolic shape expression {shown} calls something that is not a name",
                           method)
        if isinstance(node, ast.Name) and node.id not in EXPRESSION_NAMES and not _SYMBOL.match(node.id):
            raise _refused(what, f"the symbolic shape expression {shown} names {node.id!r}", method)
        if isinstance(node, ast.keyword) and node.arg not in EXPRESSION_NAMES:
            raise _refused(what, f"the symbolic shape expression {shown} has the keyword {node.arg!r}", method)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not _SAFE_STRING.match(node.value):
            raise _refused(what, f"the symbolic shape expression {shown} has the string {node.value!r}", method)


def _walk(value: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair of every object in a JSON document."""
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            for key, item in current.items():
                yield key, item
                stack.append(item)
        elif isinstance(current, list):
            stack.extend(current)


def target_kind(target: str) -> str | None:
    """``ns::op`` of a ``torch.ops.ns.op[.overload]`` target; None for anything else."""
    parts = target.split(".")
    if len(parts) in (4, 5) and parts[:2] == ["torch", "ops"] and all(_SAFE_STRING.match(p) for p in parts[2:]):
        return f"{parts[2]}::{parts[3]}"
    return None


def _check_program(program: Any, archive: ExportArchive) -> None:
    if not isinstance(program, dict) or "graph_module" not in program:
        raise archive.refuse("its program is not an exported program")
    if program.get("guards_code"):
        raise archive.refuse("its guards are Python code, which loading would run (export without derived "
                             "dimension relations, or with torch 2.6's torch.export)")
    kinds: set[str] = set()
    for key, value in _walk(program):
        if key == "target" and isinstance(value, str):
            kind = target_kind(value)
            if kind is None and value not in ALLOWED_BUILTINS:
                raise RefusedGraph(archive.what, value, archive.method)
            if kind is not None:
                kinds.add(kind)
        elif key == "expr_str" and isinstance(value, str):
            check_expression(value, archive.what, archive.method)
        elif key in REFUSED_ARGUMENTS:
            raise archive.refuse(f"it has an argument of kind {key} (subgraphs, custom objects and operator "
                                 "values are not loaded)")
        elif key == "custom_obj_values" and value:
            raise archive.refuse("it has custom objects, which loading would unpickle")
    check_ops(kinds, archive.what, archive.method)


def _check_payloads(archive: ExportArchive, config_name: str, prefix: str) -> None:
    if archive.member(config_name) not in archive.names:
        raise archive.refuse(f"it has no {config_name}")
    try:
        config = json.loads(archive.read(config_name)).get("config", {})
    except (ValueError, AttributeError):
        raise archive.refuse(f"its {config_name} is not JSON") from None
    for fqn, meta in config.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise archive.refuse(f"{fqn!r} is stored as a pickle, which loading would run (only raw tensors "
                                 "are loaded)")
        if not str(meta.get("path_name", "")).startswith(prefix):
            raise archive.refuse(f"{fqn!r} is a custom object, which loading would unpickle")


def check_archive(blob: bytes, what: str, method: str = "") -> ExportArchive:
    """Refuse a torch.export archive that loading could make run code, or whose ops are not allowed

    :param blob: the archive (``torch.export.save`` output)
    :param what: names the model in errors
    :param method: the client method errors are raised from
    :return: the archive, checked
    :raises RefusedGraph: naming an op (or target) outside the allow-list
    :raises RedisReplyError: if ``blob`` is not a torch.export archive, or holds something that
        loading would execute
    """
    archive = ExportArchive(blob, what, method)
    if archive.layout == "pt2":
        for name in archive.names:
            relative = name[len(archive.root):]
            if relative.startswith("data/aotinductor/"):
                raise archive.refuse("it holds AOTInductor code, which loading would run")
            if relative.startswith(("data/weights/", "data/constants/")) and relative.endswith(".pt"):
                raise archive.refuse("its weights are pickled (an older archive layout), which loading would run")
            if relative.startswith(("models/", "data/sample_inputs/")) and relative not in (PT2_MODEL,
                                                                                           PT2_SAMPLE_INPUTS):
                raise archive.refuse(f"it holds more than one program ({relative})")
        _check_payloads(archive, PT2_WEIGHTS_CONFIG, "weight_")
        _check_payloads(archive, PT2_CONSTANTS_CONFIG, "tensor_")
        program_name = PT2_MODEL
    elif archive.layout == "legacy":
        missing = [n for n in LEGACY_TENSORS if n not in archive.names]
        if missing:
            raise archive.refuse(f"it lacks {missing}")
        program_name = LEGACY_PROGRAM
    else:
        raise RedisReplyError(f"ERR {what} is not a torch.export archive (torch.export.save output)", method)
    try:
        program = json.loads(archive.read(program_name))
    except ValueError:
        raise archive.refuse("its program is not JSON") from None
    _check_program(program, archive)
    return archive


def check_model(blob: bytes, what: str, method: str = "") -> None:
    """Refuse a model (TorchScript or torch.export archive) that the workers would not run

    :param blob: ``torch.jit.save`` or ``torch.export.save`` output
    :param what: names the model in errors
    :param method: the client method errors are raised from
    :raises RefusedGraph: naming an op outside the allow-list
    :raises RedisReplyError: if ``blob`` is neither kind of archive, or holds something that
        loading would execute
    """
    if is_export_archive(blob):
        check_archive(blob, what, method)
    else:
        torchscript_policy.check_archive(blob, what, method)
