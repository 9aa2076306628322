"""Which TorchScript a worker runs: ops that compute, never ops that touch files, processes or the network.

Anyone who can store a model or script makes the workers run it. TorchScript has ops that read and
write files (``aten::from_file``, ``aten::save``), talk to other processes (``c10d``, RPC) or load
data from disk (``debugprims``), so a stored graph could otherwise read or overwrite any file the
worker's user can. The policy is an allow-list of op namespaces (``ALLOWED_NAMESPACES``) with the
few file-touching ops inside them denied (``DENIED_OPS``).

It is applied three times:

* by the client at ``set_model`` / ``set_script`` (so a mistake is reported at once, naming the op);
* by the worker before loading a model: a TorchScript archive runs its ``__setstate__`` methods while
  it loads, so the archive's code and pickles are checked statically, without loading them;
* by the worker on the compiled graphs of every method and function, before anything runs.

Only the last two are a defence: a client is not trusted to check its own models. This module needs
no torch (the client checks without importing it); the graph walk lives in
:mod:`smartredis_io.worker._torchscript`.
"""

from __future__ import annotations

import ast
import io
import pickletools
import zipfile
from collections.abc import Iterable

from smartredis_io.error import RedisReplyError

__all__ = ["ALLOWED_NAMESPACES", "DENIED_OPS", "RefusedGraph", "check_archive", "check_ops", "check_source"]

#: Op namespaces whose ops only compute on tensors (plus ``prim``: control flow, attributes, lists).
ALLOWED_NAMESPACES = frozenset({
    "aten", "prim", "prims", "quantized", "_quantized", "quantized_decomposed", "profiler", "cuda",
    "mkldnn", "mkl", "onednn", "sparse",
})
#: Ops of allowed namespaces that reach outside the process' memory.
DENIED_OPS = frozenset({
    "aten::from_file",  # maps any file into a tensor (read, and write with shared=True)
    "aten::save",  # pickles a value to a file
    "prim::rpc_async", "prim::rpc_sync", "prim::rpc_remote",  # remote procedure calls
    "prim::PythonOp",  # calls back into Python
})
_DENIED_NAMES = frozenset(op.split("::")[1] for op in DENIED_OPS)
_BUILTIN_ROOTS = ("torch", "math")  # names TorchScript's code importer binds to the aten namespace
_WHY = "workers run only ops that compute (namespaces {}); none that touch files, processes or the network"


class RefusedGraph(RedisReplyError):
    """A model or script uses an op the workers do not run."""

    def __init__(self, what: str, op: str, method: str = "") -> None:
        super().__init__(
            f"ERR {what} was refused: it uses {op}; " + _WHY.format(", ".join(sorted(ALLOWED_NAMESPACES))), method
        )
        self.op = op


def check_ops(kinds: Iterable[str], what: str, method: str = "") -> None:
    """Refuse a graph whose node kinds (``ns::name``) include a denied op or namespace.

    :param kinds: the kinds of every node of every graph of the model or script
    :param what: names the model or script in the error
    :param method: the client method the error is raised from
    :raises RefusedGraph: naming the first offending op
    """
    for kind in sorted(kinds):
        namespace, _, _ = kind.partition("::")
        if kind in DENIED_OPS or namespace not in ALLOWED_NAMESPACES:
            raise RefusedGraph(what, kind, method)


def check_source(source: str, what: str, method: str = "") -> None:
    """Refuse TorchScript source (a script, or the code of a model archive) that names a denied op.

    The check is on the syntax tree, before anything is compiled: every attribute and name is
    compared with the denied ops' names (``torch.from_file``, ``x.save``...), and every use of an
    op namespace (``torch.ops.NS``, ``ops.NS``) or a custom class namespace
    (``torch.classes.NS``) with the allowed namespaces.

    :raises RefusedGraph: naming the offending op or namespace
    :raises RedisReplyError: if the source cannot be parsed (and so cannot be checked)
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise RedisReplyError(f"ERR {what} could not be checked: its TorchScript does not parse ({exc})",
                              method) from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _check_chain(_chain(node), what, method)
        elif isinstance(node, ast.Name) and node.id in _DENIED_NAMES:
            raise RefusedGraph(what, _denied(node.id), method)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in _DENIED_NAMES:
            raise RefusedGraph(what, _denied(node.value), method)  # getattr(torch, "from_file")


def _chain(node: ast.Attribute) -> list[str]:
    parts: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name):
        parts.append(current.id)
    return parts[::-1]


def _check_chain(chain: list[str], what: str, method: str) -> None:
    if chain[-1] in _DENIED_NAMES:
        raise RefusedGraph(what, _denied(chain[-1]), method)
    for i, part in enumerate(chain[:-1]):
        if part in ("ops", "classes") and (i == 0 or chain[i - 1] == "torch"):
            namespace = chain[i + 1]
            if namespace not in ALLOWED_NAMESPACES:
                if part == "classes":
                    kind = f"the custom class namespace {namespace}"
                else:
                    kind = f"{namespace}::{chain[i + 2]}" if i + 2 < len(chain) else f"the op namespace {namespace}"
                raise RefusedGraph(what, kind, method)


def _denied(name: str) -> str:
    return next(op for op in sorted(DENIED_OPS) if op.endswith(f"::{name}"))


def check_archive(blob: bytes, what: str, method: str = "") -> None:
    """Refuse a TorchScript archive whose code or pickles use a denied op or class namespace.

    Nothing in the archive is loaded or unpickled: the code files are parsed (``check_source``)
    and the pickles are read opcode by opcode for references to custom classes.

    :raises RefusedGraph: naming the offending op or namespace
    :raises RedisReplyError: if ``blob`` is not a TorchScript archive
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError):
        raise RedisReplyError(f"ERR {what} is not a TorchScript archive (torch.jit.save output)", method) from None
    code = [n for n in names if "/code/" in n and n.endswith(".py")]
    if not code:
        raise RedisReplyError(f"ERR {what} is not a TorchScript archive: it has no code/ files", method)
    for name in code:
        check_source(archive.read(name).decode(errors="replace"), what, method)
    for name in names:
        if name.endswith(".pkl") and not name.endswith(".debug_pkl"):
            _check_pickle(archive.read(name), what, method)


def _check_pickle(data: bytes, what: str, method: str) -> None:
    prefix = "__torch__.torch.classes."
    try:
        for _, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and arg.startswith(prefix):
                namespace = arg[len(prefix):].split(".")[0].split(" ")[0]
                if namespace not in ALLOWED_NAMESPACES:
                    raise RefusedGraph(what, f"the custom class namespace {namespace}", method)
    except ValueError as exc:
        raise RedisReplyError(f"ERR {what} could not be checked: a pickle in it is malformed ({exc})",
                              method) from None
