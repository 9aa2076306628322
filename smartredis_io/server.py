"""Embedded redis-server launchers: standalone and a real N-shard Redis Cluster on loopback."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from localservices import ManagedProcess, ServiceStartError, find_binary, free_port

log = logging.getLogger(__name__)

BINARY_ENV_VAR = "REDIS_SERVER_BIN"
CLUSTER_READY_TIMEOUT_S = 30.0


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


def _pings(host: str, port: int) -> bool:
    client = redis.Redis(host=host, port=port, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        return bool(client.ping())
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
        binary = find_binary("redis-server", BINARY_ENV_VAR)
        self._process = ManagedProcess(
            f"redis-server:{self.port}",
            _redis_argv(binary, host, self.port, self._workdir, persistence) + list(extra_args),
            ready=lambda: _pings(self.host, self.port),
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
        cli = find_binary("redis-cli", "REDIS_CLI_BIN")
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
