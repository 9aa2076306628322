"""One connection layer over a standalone Redis or a Redis Cluster, with the zero-copy tensor paths.

Everything goes through redis-py except the hot paths (see :mod:`smartredis_io._redispy`): a tensor
put is sent as the header followed by a memoryview of the caller's array, a tensor get reads the
reply body straight into the caller's array, and the run_model request/reply exchanges are sent and
read on a pooled connection without redis-py's pipeline machinery (``Database.exchange``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from smartredis_io import _redispy
from smartredis_io._redispy import Command, ReadPlan
from smartredis_io.error import RedisConnectionError

__all__ = ["Command", "Database", "ReadPlan", "detect_cluster", "parse_address"]

log = logging.getLogger(__name__)

CONNECT_RETRY_INTERVAL_S = 0.1


def parse_address(address: str) -> list[tuple[str, int] | str]:
    """``host:port``, a comma (or semicolon) list of them, or ``unix:///path`` -> endpoints."""
    endpoints: list[tuple[str, int] | str] = []
    for part in address.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("unix://"):
            endpoints.append(part[len("unix://"):])
            continue
        part = part.removeprefix("tcp://")
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise RedisConnectionError(f"Invalid address {part!r}: expected host:port or unix:///path")
        endpoints.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not endpoints:
        raise RedisConnectionError(f"No address in {address!r}")
    return endpoints


class Database:
    """redis-py client (standalone or cluster) plus the raw tensor paths on its connections."""

    def __init__(self, address: str, cluster: bool, connect_timeout_s: float) -> None:
        self.address = address
        self.cluster = cluster
        endpoints = parse_address(address)
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self.redis = self._connect(endpoints, cluster, connect_timeout_s)
                break
            except (redis.exceptions.RedisError, OSError) as exc:
                if time.monotonic() + CONNECT_RETRY_INTERVAL_S > deadline:
                    raise RedisConnectionError(
                        f"Could not connect to the database at {address} within {connect_timeout_s:.1f} s: {exc}"
                    ) from None
                time.sleep(CONNECT_RETRY_INTERVAL_S)

    @staticmethod
    def _connect(endpoints: list, cluster: bool, timeout_s: float) -> redis.Redis | RedisCluster:
        # No read timeout: blocking pops (run_model replies, worker queues) wait up to their own deadline.
        # No redis-py retries either: the connection deadline is ours (SR_CONN_TIMEOUT).
        opts = {"socket_connect_timeout": max(timeout_s, 0.05), "socket_timeout": None, "socket_keepalive": True,
                "retry": Retry(NoBackoff(), 0)}
        if cluster:
            nodes = [ClusterNode(*e) for e in endpoints if isinstance(e, tuple)]
            client = RedisCluster(startup_nodes=nodes, **opts)
        else:
            first = endpoints[0]
            if isinstance(first, str):
                client = redis.Redis(unix_socket_path=first, **opts)
            else:
                client = redis.Redis(host=first[0], port=first[1], **opts)
            client.ping()
        return client

    def close(self) -> None:
        self.redis.close()

    def exchange(self, commands: Sequence[Command], raise_on_error: bool = True) -> list[Any]:
        """Run ``commands`` in one round trip, as ``pipeline(transaction=False).execute(raise_on_error)``.

        The replies are the server's, without redis-py's response callbacks (``SET`` gives b"OK",
        ``BLPOP`` a list). On one node the commands are packed and read on a pooled connection; a
        command redirected by the cluster (MOVED / ASK) is run again through redis-py, alone (the
        others have run), and commands spanning cluster nodes go through redis-py's pipeline: those
        replies are redis-py's (``SET`` gives True).
        """
        pool = _redispy.shared_pool(self.redis, [command[1] for command in commands])
        if pool is None:
            return self._pipeline(commands, raise_on_error)
        with _redispy.pooled_connection(pool) as conn:
            _redispy.send_commands(conn, commands)
            replies = [_redispy.read_reply(conn) for _ in commands]
        redirected = [i for i, reply in enumerate(replies) if _redispy.is_redirect(reply)]
        if redirected:
            for i, reply in zip(redirected, self._pipeline([commands[i] for i in redirected], False), strict=True):
                replies[i] = reply
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, redis.exceptions.ResponseError):
                    raise reply
        return replies

    def _pipeline(self, commands: Sequence[Command], raise_on_error: bool) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=raise_on_error)

    def set_parts(self, key: str, parts: Sequence[bytes | memoryview], peek: int) -> bytes:
        """``SET key <parts joined>`` without joining them; returns the first ``peek`` bytes it replaced."""
        total = sum(memoryview(p).nbytes for p in parts)
        head = _redispy.pack_getrange_and_set(key, total, peek)
        with _redispy.pooled_connection(_redispy.node_pool(self.redis, key)) as conn:
            _redispy.send_parts(conn, [head, *parts, _redispy.CRLF])
            old = _redispy.read_reply(conn)
            status = _redispy.read_reply(conn)
        if _redispy.is_redirect(old) or _redispy.is_redirect(status):
            data = b"".join(bytes(p) for p in parts)  # rare path (cluster redirection): one join copy
            old, status = self._pipeline([("GETRANGE", key, 0, peek - 1), ("SET", key, data)], False)
        if isinstance(status, Exception):
            raise status
        return old if isinstance(old, bytes) else b""

    def get_into(self, key: str, plan: ReadPlan, peek: int) -> bool:
        """``GET key`` read straight into the buffer ``plan`` picks; False when the key does not exist."""
        try:
            with _redispy.pooled_connection(_redispy.node_pool(self.redis, key)) as conn:
                conn.send_command("GET", key)
                return _redispy.read_bulk_into(conn, plan, peek)
        except _redispy.Redirected:
            value = self.redis.get(key)
            if value is None:
                return False
            view = memoryview(value)
            skip, dest = plan(view[:peek], len(value))
            dest[:] = view[skip:]  # rare path (cluster redirection): redis-py's copy plus this one
            return True


def detect_cluster(address: str, timeout_s: float = 10.0) -> bool:
    """Whether the first node of ``address`` runs in cluster mode."""
    endpoint = parse_address(address)[0]
    kwargs = {"unix_socket_path": endpoint} if isinstance(endpoint, str) else {"host": endpoint[0], "port": endpoint[1]}
    client = redis.Redis(socket_connect_timeout=timeout_s, **kwargs)
    try:
        return client.info("cluster").get("cluster_enabled") == 1
    finally:
        client.close()
