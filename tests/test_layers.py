"""The packages' import graphs, read from their sources: every import counts, at module level or
inside a function, since an import deferred into a function still closes a circle when it runs.

No two modules of a package import each other in a loop, and smartredis_io's roles import each other
in one direction only: the client (SmartRedis' public modules and ``_client``) imports none of the
others; the execution workers and the Lightning integration build on the client; the launchers on
the client and on the workers' exit codes and secret variable.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dataflux_ckpt", "fastpersist", "lightning_storage_plugins", "smartredis_io")

# SmartRedis 0.6.1's module names: the client's public face.
SMARTREDIS_MODULES = {"client", "configoptions", "dataset", "dataset_utils", "error", "logcontext", "logger",
                      "srobject", "util"}
# The documented commands python -m smartredis_io.redis_module / .smartsim_setup enter the launchers.
LAUNCHER_COMMANDS = {"redis_module", "smartsim_setup"}
# The roles each role may import (besides itself).
ALLOWED = {
    "client": set(),
    "worker": {"client"},
    "lightning": {"client"},
    "launchers": {"client", "worker"},
}


def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by its dotted name (a subpackage by its ``__init__``)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that ``import name`` loads last: ``name``, or the package it is in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(package: str) -> dict[str, set[str]]:
    """For each module of ``package``, the modules of the same package it imports."""
    known = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_resolve(alias.name, known) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                origin = base
                for _ in range(node.level - 1):
                    origin = origin.rpartition(".")[0]
                module = (f"{origin}.{node.module}" if node.module else origin) if node.level else node.module
                # a name is a submodule, or an attribute of the module (one that does not exist is no edge)
                targets.update(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known
                               else module if module in known else None for alias in node.names)
        graph[name] = targets - {None, name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def role(module: str) -> str:
    """The smartredis_io role a module belongs to: its subpackage, or the client for the public modules."""
    leaf = module.split(".")[1]
    if leaf in SMARTREDIS_MODULES or leaf == "_client":
        return "client"
    if leaf in LAUNCHER_COMMANDS:
        return "launchers"
    return leaf


def test_circles_finds_a_loop_and_only_the_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_two_modules_of_a_package_import_each_other_in_a_loop(package: str) -> None:
    assert circles(imports(package)) == []


def test_smartredis_io_roles_import_downwards_only() -> None:
    graph = imports("smartredis_io")
    upward = sorted(
        f"{module} ({role(module)}) imports {target} ({role(target)})"
        for module, targets in graph.items() if module != "smartredis_io" and not module.startswith("smartredis_io.redisai")
        for target in targets if target != "smartredis_io" and role(target) != role(module)
        and role(target) not in ALLOWED[role(module)]
    )
    assert upward == []
    assert {role(module) for module in graph if module.count(".") == 1} - {"redisai"} <= set(ALLOWED)


def test_the_role_packages_import_neither_torch_nor_lightning() -> None:
    # The launchers read the workers' exit codes and the fsspec entry point loads the file system:
    # neither may cost a torch or Lightning import.
    script = textwrap.dedent(
        """
        import sys
        import smartredis_io.launchers.server, smartredis_io.worker.worker_protocol
        import smartredis_io.lightning.filesystem, smartredis_io.redis_module, smartredis_io.smartsim_setup
        print(sorted({"torch", "lightning"} & set(sys.modules)))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]
