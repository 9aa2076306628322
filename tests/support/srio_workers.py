"""What the smartredis_io module knows of its execution workers, as a test sees it (``SRIO.WORKERS``),
through a connection that speaks the worker protocol (it said ``SRIO.HELLO`` with the module's secret).

A test session run as root starts its redis-servers through
:func:`benchmarks.worker_python.redis_server_reaching_python`, so that the workers' user can run this
environment's Python."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from smartredis_io import Client, ConfigOptions

#: How long a test waits for a worker to register: each one is a new interpreter that imports torch,
#: which can take minutes on a 2-core machine running the suite's streams side by side. A bound for
#: a failure only: the waits end when the worker registers.
WORKER_START_S = 300


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



def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def running_its_request(pid: int, seconds: float = 60) -> None:
    """Wait until worker ``pid``, which the module lists as running a request, has spent CPU time on it.

    The module lists a worker as running once it hands the request over, while the worker may still
    be waiting in ``SRIO.POP``'s read (and, signalled then, hand it back as an idle worker does);
    a worker waiting there uses no CPU time.
    """
    start = cpu_seconds(pid)
    wait_until(lambda: cpu_seconds(pid) - start >= 0.2, seconds, f"worker {pid} to run its request")
