"""Embedded redis-server launchers: standalone and a real N-shard Redis Cluster on loopback."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from lightning_storage_plugins.services import ManagedProcess, ServiceStartError, find_binary, free_port
from smartredis_io.connection import Database

log = logging.getLogger(__name__)

BINARY_ENV_VAR = "REDIS_SERVER_BIN"
CLUSTER_READY_TIMEOUT_S = 30.0
INSTALL_HINT = (
    "Install Redis 7 or newer (Debian/Ubuntu: `apt-get install redis-server`; macOS: `brew install redis`), "
    f"or set ${BINARY_ENV_VAR} to the redis-server binary."
)


def _redis_argv(binary: str, host: str, port: int, workdir: Path, persistence: bool) -> list[str]:
    argv = [
        binary,
        "--bind", host,
        "--port", str(port),
        "--dir", str(workdir),
        "--protected-mode", "no",
        "--daemonize", "no",
        "--loglevel", "warning",
    ]
    if not persistence:
        argv += ["--save", "", "--appendonly", "no"]
    return argv


def _answers_as(host: str, port: int, pid: int | None) -> bool:
    """True when the redis-server answering at ``host:port`` is process ``pid`` (not a squatter)."""
    client = redis.Redis(host=host, port=port, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        return client.info("server").get("process_id") == pid
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


class RedisServer:
    """One redis-server on loopback at a free port, without persistence unless asked."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        persistence: bool = False,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 15.0,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._workdir = Path(tempfile.mkdtemp(prefix="redis-"))
        binary = find_binary("redis-server", BINARY_ENV_VAR, install_hint=INSTALL_HINT)
        self._process = ManagedProcess(
            f"redis-server:{self.port}",
            _redis_argv(binary, host, self.port, self._workdir, persistence) + list(extra_args),
            ready=lambda: _answers_as(self.host, self.port, self._process.pid),
            startup_timeout_s=startup_timeout_s,
        )

    @property
    def address(self) -> str:
        """``host:port``, the form SmartRedis' ``SSDB`` takes."""
        return f"{self.host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        return [self._process.pid] if self._process.pid else []

    def start(self) -> RedisServer:
        self._process.start()
        return self

    def stop(self) -> None:
        self._process.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster:
    """A Redis Cluster of ``shards`` primaries (no replicas) on loopback, slots spread evenly."""

    def __init__(self, shards: int = 3, host: str = "127.0.0.1", *, startup_timeout_s: float = 15.0) -> None:
        if shards < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 primaries, got shards={shards}")
        self.host = host
        self._nodes = [
            RedisServer(
                host,
                extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(free_port(host)),
                    "--cluster-node-timeout", "5000",
                ),
                startup_timeout_s=startup_timeout_s,
            )
            for _ in range(shards)
        ]

    @property
    def address(self) -> str:
        """Comma-separated ``host:port`` list of every primary, as ``SSDB`` takes it."""
        return ",".join(node.address for node in self._nodes)

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self._nodes]

    @property
    def pids(self) -> list[int]:
        return [pid for node in self._nodes for pid in node.pids]

    def start(self) -> RedisCluster:
        try:
            for node in self._nodes:
                node.start()
            self._create()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        cli = find_binary("redis-cli", "REDIS_CLI_BIN", install_hint=INSTALL_HINT)
        result = subprocess.run(
            [cli, "--cluster", "create", *(n.address for n in self._nodes), "--cluster-replicas", "0",
             "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=CLUSTER_READY_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise ServiceStartError(f"redis-cli --cluster create failed:\n{result.stdout}{result.stderr}")
        deadline = time.monotonic() + CLUSTER_READY_TIMEOUT_S
        while not all(self._node_ok(node) for node in self._nodes):
            if time.monotonic() > deadline:
                raise ServiceStartError(f"Redis Cluster {self.address} did not reach cluster_state:ok")
            time.sleep(0.1)
        log.info("Redis Cluster up: %s", self.address)

    def _node_ok(self, node: RedisServer) -> bool:
        client = redis.Redis(host=node.host, port=node.port, socket_timeout=1.0)
        try:
            return client.cluster("info").get("cluster_state") == "ok"
        finally:
            client.close()

    def stop(self) -> None:
        for node in self._nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


WORKER_READY_TIMEOUT_S = 60.0  # a worker imports torch before it registers


DEFAULT_WORKER_USER = "nobody"


def _worker_privileges(user: str | None, allow_root: bool) -> list[str]:
    """The worker's command-line flags that say which user runs the models."""
    if user:
        return ["--user", user]
    if allow_root:
        return ["--allow-root"]
    return ["--user", DEFAULT_WORKER_USER] if os.geteuid() == 0 else []


def _workers_registered(address: str, cluster: bool, names: list[str]) -> bool:
    db = Database(address, cluster, connect_timeout_s=1.0)
    try:
        return all(db.redis.hexists("{srio}.workers", name) for name in names)
    finally:
        db.close()


class Orchestrator:
    """An embedded database plus execution workers on this machine, like SmartSim's Orchestrator.

    ``shards=1`` starts a standalone redis-server, ``shards>=3`` a real Redis Cluster; ``workers``
    worker processes (``python -m smartredis_io.worker``) serve run_model / run_script. Everything
    stops on exit. ``env`` holds the variables a SmartRedis client reads (``SSDB``, ``SR_DB_TYPE``).

    Workers run whatever models the database's writers store. Started by root, they drop to
    ``worker_user`` (default ``nobody``) once connected, unless ``allow_root_workers`` is set.
    """

    def __init__(self, shards: int = 1, workers: int = 1, *, device: str = "cpu", threads: int = 1,
                 host: str = "127.0.0.1", worker_env: dict[str, str] | None = None,
                 worker_user: str | None = None, allow_root_workers: bool = False) -> None:
        if shards not in (1,) and shards < 3:
            raise ValueError(f"shards must be 1 (standalone) or >= 3 (cluster), got {shards}")
        self.cluster = shards > 1
        self.database: RedisServer | RedisCluster = RedisCluster(shards, host) if self.cluster else RedisServer(host)
        self._device = device
        self._threads = threads
        self._worker_env = worker_env
        self._worker_privileges = _worker_privileges(worker_user, allow_root_workers)
        self._n_workers = workers
        self.workers: list[ManagedProcess] = []
        self._started = 0

    @property
    def address(self) -> str:
        return self.database.address

    @property
    def env(self) -> dict[str, str]:
        return {"SSDB": self.address, "SR_DB_TYPE": "Clustered" if self.cluster else "Standalone"}

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid]

    def add_worker(self) -> ManagedProcess:
        """Start one more worker process and wait until it takes requests."""
        worker, name = self._spawn_worker()
        self._wait_registered([(worker, name)])
        return worker

    def _spawn_worker(self) -> tuple[ManagedProcess, str]:
        # Started from the calling thread, never a helper thread: the kernel's parent-death signal
        # (see lightning_storage_plugins.services) fires when the *thread* that forked the child exits.
        name = f"orchestrator-{id(self):x}-{self._started}"
        self._started += 1
        worker = ManagedProcess(
            f"smartredis-worker:{name}",
            [sys.executable, "-m", "smartredis_io.worker", "--address", self.address, "--device", self._device,
             "--threads", str(self._threads), "--name", name, *self._worker_privileges],
            ready=lambda: True,  # registration is awaited below, for all workers at once
            env={**os.environ, **(self._worker_env or {})},
        )
        worker.start()
        self.workers.append(worker)
        return worker, f"{name}.0"

    def _wait_registered(self, started: list[tuple[ManagedProcess, str]]) -> None:
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        names = [name for _, name in started]
        while not _workers_registered(self.address, self.cluster, names):
            for worker, _ in started:
                if not worker.is_running():
                    raise ServiceStartError(f"{worker.name} exited during start-up; log tail:\n{worker.log_tail()}")
            if time.monotonic() > deadline:
                raise ServiceStartError(f"workers {names} did not register within {WORKER_READY_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        log.info("%d execution worker(s) up on %s", len(started), self.address)

    def start(self) -> Orchestrator:
        try:
            self.database.start()
            self._wait_registered([self._spawn_worker() for _ in range(self._n_workers)])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers.clear()
        self.database.stop()

    def __enter__(self) -> Orchestrator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
