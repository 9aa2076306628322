"""The one place that knows how ``smartredis_io`` starts a database and its execution workers.

The standard deployment is ``smartredis_io.Orchestrator`` (standalone or an N-shard cluster
on loopback, plus workers). Two cases it does not cover are assembled from its parts: a colocated
deployment (a standalone server on a Unix-domain socket) and workers for a database given by
``--address``, both through ``python -m smartredis_io.worker``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from smartredis_io import Orchestrator, RedisServer
from smartredis_io.worker.worker_protocol import SECRET_ENV

log = logging.getLogger(__name__)

WORKER_STOP_TIMEOUT_S = 10.0


def worker_device(device: str) -> str:
    """``cpu``/``cuda`` (the CLI's words) as the worker's ``--device``."""
    return "cuda:0" if device == "cuda" else device


@contextlib.contextmanager
def deployment(db_nodes: int, workers: int, device: str = "cpu", colocated: bool = False) -> Iterator[str]:
    """Start the database (and ``workers`` execution workers); yield its address; stop everything."""
    if not colocated:
        with Orchestrator(shards=db_nodes, workers=workers, device=worker_device(device)) as orc:
            yield orc.address
        return
    with tempfile.TemporaryDirectory(prefix="redis-uds-") as tmp:
        address = f"unix://{Path(tmp) / 'redis.sock'}"
        with RedisServer(extra_args=("--unixsocket", address[len("unix://"):], "--unixsocketperm", "700")) as server:
            with workers_for(address, workers, device, secret=server.worker_secret):
                yield address


@contextlib.contextmanager
def workers_for(address: str, count: int, device: str = "cpu", secret: str | None = None) -> Iterator[None]:
    """``count`` worker processes (``python -m smartredis_io.worker``) for the database at ``address``,
    showing its module ``secret`` (default: ``$SRIO_WORKER_SECRET``)."""
    if count <= 0:
        yield
        return
    argv = [sys.executable, "-m", "smartredis_io.worker", "--address", address, "--workers", str(count),
            "--device", worker_device(device), *(["--user", "nobody"] if os.geteuid() == 0 else [])]
    log.info("starting execution workers: %s", " ".join(argv))
    env = {**os.environ, SECRET_ENV: secret} if secret else None  # in the environment, not on argv
    proc = subprocess.Popen(argv, start_new_session=True, env=env)
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
