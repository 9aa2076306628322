"""What the smartredis_io module knows of its execution workers, as a test sees it (``SRIO.WORKERS``),
through a connection that speaks the worker protocol (it said ``SRIO.HELLO`` with the module's secret);
and, for a test session run as root, a redis-server whose workers' user can run this environment's
Python (:func:`redis_server_reaching_python`)."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from smartredis_io import Client, ConfigOptions
from tests.support import ROOT

#: who the module's workers run as when the tests run as root (the module refuses root)
WORKER_USER = "nobody"
REACHING_SCRIPT = ROOT / ".tools" / "srio" / "redis-server-reaching-python"


@dataclass(frozen=True)
class WorkerEntry:
    """One registered worker: its process id and the requests it is running."""

    pid: int
    running: int


def protocol_client(server: Any, port: int | None = None) -> redis.Redis:
    """A plain client of ``server`` (a ``RedisServer`` or ``RedisCluster``; ``port``: which node) whose
    every connection first says ``SRIO.HELLO`` with the module's worker secret, as a worker's does."""
    secret = server.worker_secret

    def hello(conn: Any) -> None:
        conn.on_connect()
        conn.send_command("SRIO.HELLO", secret)
        conn.read_response()

    return redis.Redis(host="127.0.0.1", port=port or server.port, password=server.settings().password,
                       redis_connect_func=hello)


def run_client(address: str, model_timeout_ms: int = 60_000) -> Client:
    """A client of ``address`` whose runs wait up to ``model_timeout_ms`` (``SR_MODEL_TIMEOUT``)."""
    options = ConfigOptions.create_from_environment("")
    options.override_string_option("SSDB", address)
    options.override_integer_option("SR_MODEL_TIMEOUT", model_timeout_ms)
    return Client(options)


def worker_env(server: Any) -> dict[str, str]:
    """The environment of a ``python -m smartredis_io.worker`` for ``server``: ours, plus the module's secret."""
    return {**os.environ, "SRIO_WORKER_SECRET": server.worker_secret}


def registry(client: redis.Redis | list[redis.Redis]) -> dict[str, WorkerEntry]:
    """Every worker registered on the server(s) ``client`` talks to, by name (every worker registers
    on every server; ``running`` counts the requests of all of them)."""
    entries: dict[str, WorkerEntry] = {}
    for node in client if isinstance(client, list) else [client]:
        for name, pid, running, *_ in node.execute_command("SRIO.WORKERS"):
            known = entries.get(name.decode())
            entries[name.decode()] = WorkerEntry(int(pid), int(running) + (known.running if known else 0))
    return entries


def wait_until(condition: Callable[[], object], seconds: float, what: str) -> object:
    """Poll ``condition`` until it returns something true (that value), or fail naming ``what``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {seconds} s: {what}")


def busy_worker(client: redis.Redis | list[redis.Redis], seconds: float = 10, exclude: frozenset[str] = frozenset()) -> str:
    """The name of a worker running a request (waiting until one does)."""
    return wait_until(lambda: next((name for name, entry in registry(client).items()
                                    if entry.running and name not in exclude), None),
                      seconds, "a worker takes the request")


def _hidden_by(path: str) -> tuple[Path, str] | None:
    """The first directory on ``path`` (links resolved) that other users may not search, and the entry
    of it the path goes through; None when others may search every directory on it."""
    parts = Path(os.path.realpath(path)).parts
    for depth in range(1, len(parts) - 1):
        directory = Path(*parts[:depth])
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return directory, parts[depth]
    return None


def redis_server_reaching_python() -> str | None:
    """A redis-server command in which the Redis module's workers, run as ``WORKER_USER``, can run this
    test environment's Python; None when they can anyway (tests not run as root, or a Python every
    user may run).

    The module drops to its ``WORKER_USER`` before the interpreter starts, so that user must be able
    to run it. Where this environment's Python lives under a directory only root may search (pyenv
    under ``/root``), the command is a script that starts redis-server in a mount namespace of its
    own, where that directory is an empty one everyone may search, holding only the entries on the
    way to the Python installation (and to the checkout). It replaces ``$REDIS_SERVER_BIN`` for the
    session: the launchers and SmartSim's layout start redis-server through it.
    """
    if os.geteuid() != 0:
        return None
    hidden: dict[Path, set[str]] = {}
    for path in {sys.base_prefix, sys.prefix, str(ROOT)}:
        found = _hidden_by(path)
        if found:
            hidden.setdefault(found[0], set()).add(found[1])
    if not hidden:
        return None
    server = os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
    if server is None or shutil.which("unshare") is None or str(REACHING_SCRIPT) == server:
        return None
    steps = ['stage=$(mktemp -d)']
    for directory, entries in sorted(hidden.items()):
        steps += [f"mount --bind {shlex.quote(str(directory))} \"$stage\"",
                  f"mount -t tmpfs -o mode=0755,size=1m srio-tests {shlex.quote(str(directory))}"]
        for entry in sorted(entries):
            inside = shlex.quote(str(directory / entry))
            steps += [f"mkdir {inside}", f"mount --bind \"$stage\"/{shlex.quote(entry)} {inside}"]
        steps.append('umount "$stage"')
    steps += ['rmdir "$stage"', 'exec "$0" "$@"']
    script = "\n".join([
        "#!/bin/sh",
        "# Written by tests/support/srio_workers.py for a test session run as root: redis-server in a mount",
        f"# namespace of its own, where {WORKER_USER} (the module's workers) can reach this test environment's Python.",
        f"exec unshare --mount --propagation private /bin/sh -ec {shlex.quote(chr(10).join(steps))} "
        f'{shlex.quote(server)} "$@"',
        "",
    ])
    REACHING_SCRIPT.parent.mkdir(parents=True, exist_ok=True)
    temporary = REACHING_SCRIPT.with_name(f".{REACHING_SCRIPT.name}.{os.getpid()}")
    temporary.write_text(script)
    temporary.chmod(0o755)
    os.replace(temporary, REACHING_SCRIPT)
    return str(REACHING_SCRIPT)
