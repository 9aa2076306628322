"""One connection layer over a standalone Redis or a Redis Cluster, with the zero-copy tensor paths.

Everything goes through redis-py except the hot paths: a tensor put is sent as the header
followed by a memoryview of the caller's array (no concatenation copy), a tensor get reads the
reply body with ``recv_into`` straight into the caller's array (the only copy after the socket read
is the kernel's into that array; a few hundred bytes of the first read pass through a scratch buffer),
and the run_model request/reply exchanges are sent and read on a pooled connection without
redis-py's pipeline machinery (``Database.exchange``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from smartredis_io.error import RedisConnectionError

log = logging.getLogger(__name__)

RECV_SCRATCH_BYTES = 1024
CONNECT_RETRY_INTERVAL_S = 0.1
CRLF = b"\r\n"

# plan(first bytes of the value, total value length) -> (bytes to skip, destination of the rest)
ReadPlan = Callable[[memoryview, int], tuple[int, memoryview]]
# (NAME, key, *arguments): a command whose first argument is the only key it touches
Command = tuple[Any, ...]


class _Fallback(Exception):
    """The fast path met a reply it does not handle (e.g. a cluster redirection); use redis-py."""


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


def _recv_into(sock: Any, view: memoryview) -> int:
    n = sock.recv_into(view)
    if n == 0:
        raise redis.exceptions.ConnectionError("Connection closed by server")
    return n


def _recv_exact_into(sock: Any, view: memoryview) -> None:
    while view.nbytes:
        view = view[_recv_into(sock, view):]


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

    def _pool(self, key: str) -> redis.ConnectionPool:
        if self.cluster:
            return self.redis.get_node_from_key(key).redis_connection.connection_pool
        return self.redis.connection_pool

    def _shared_pool(self, commands: Sequence[Command]) -> redis.ConnectionPool | None:
        """The pool of the one node every command's key lives on; None when they span nodes."""
        if not self.cluster:
            return self.redis.connection_pool
        first, *rest = (self.redis.get_node_from_key(command[1]) for command in commands)
        if any(node.name != first.name for node in rest):
            return None
        return first.redis_connection.connection_pool

    @contextmanager
    def _connection(self, pool: redis.ConnectionPool):
        conn = pool.get_connection()
        try:
            yield conn
        except BaseException:
            # The reply may be half read: the connection cannot be reused.
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def exchange(self, commands: Sequence[Command], raise_on_error: bool = True) -> list[Any]:
        """Run ``commands`` in one round trip, as ``pipeline(transaction=False).execute(raise_on_error)``.

        The replies are the server's, without redis-py's response callbacks (``SET`` gives b"OK",
        ``BLPOP`` a list). On one node the commands are packed and read on a pooled connection; a
        command redirected by the cluster (MOVED / ASK) is run again through redis-py, alone (the
        others have run), and commands spanning cluster nodes go through redis-py's pipeline: those
        replies are redis-py's (``SET`` gives True).
        """
        pool = self._shared_pool(commands)
        if pool is None:
            return self._pipeline(commands, raise_on_error)
        with self._connection(pool) as conn:
            conn.send_packed_command(conn.pack_commands(commands))
            replies = [self._read_reply(conn) for _ in commands]
        redirected = [i for i, reply in enumerate(replies) if _redirected(reply)]
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
        bkey = key.encode()
        head = (
            b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$1\r\n0\r\n$%d\r\n%d\r\n" % (len(bkey), bkey, len(str(peek - 1)), peek - 1)
            + b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(bkey), bkey, total)
        )
        with self._connection(self._pool(key)) as conn:
            conn.send_packed_command([head, *parts, CRLF])
            old = self._read_reply(conn)
            status = self._read_reply(conn)
        if _redirected(old) or _redirected(status):
            data = b"".join(bytes(p) for p in parts)  # rare path (cluster redirection): one join copy
            old, status = self._pipeline([("GETRANGE", key, 0, peek - 1), ("SET", key, data)], False)
        if isinstance(status, Exception):
            raise status
        return old if isinstance(old, bytes) else b""

    @staticmethod
    def _read_reply(conn: Any) -> Any:
        """The next reply on ``conn``; an error reply as its exception (all replies are read)."""
        try:
            return conn.read_response()
        except redis.exceptions.ResponseError as exc:
            return exc

    def get_into(self, key: str, plan: ReadPlan, peek: int) -> bool:
        """``GET key`` read straight into the buffer ``plan`` picks; False when the key does not exist."""
        try:
            with self._connection(self._pool(key)) as conn:
                conn.send_command("GET", key)
                return self._read_bulk_into(conn._sock, plan, peek)
        except _Fallback:
            value = self.redis.get(key)
            if value is None:
                return False
            view = memoryview(value)
            skip, dest = plan(view[:peek], len(value))
            dest[:] = view[skip:]  # rare path (cluster redirection): redis-py's copy plus this one
            return True

    @staticmethod
    def _read_bulk_into(sock: Any, plan: ReadPlan, peek: int) -> bool:
        scratch = bytearray(max(RECV_SCRATCH_BYTES, peek + 64))
        buf = memoryview(scratch)
        have = _recv_into(sock, buf)
        while (eol := scratch.find(CRLF, 0, have)) < 0:
            have += _recv_into(sock, buf[have:])
        line = bytes(scratch[:eol])
        if line[:1] == b"-":
            message = line[1:].decode(errors="replace")
            if message.startswith(("MOVED", "ASK")):
                raise _Fallback()
            raise redis.exceptions.ResponseError(message)
        if line[:1] == b"_":  # RESP3 null: no such key
            return False
        if line[:1] != b"$":
            raise redis.exceptions.InvalidResponse(f"Unexpected reply to GET: {line[:64]!r}")
        length = int(line[1:])
        if length < 0:
            return False
        start = eol + 2
        end_needed = start + min(length, peek)
        while have < end_needed:
            have += _recv_into(sock, buf[have:])
        skip, dest = plan(buf[start:end_needed], length)
        if skip + dest.nbytes != length:
            raise redis.exceptions.InvalidResponse(f"value of {length} bytes does not fill {skip}+{dest.nbytes}")
        body_start = start + skip
        got = max(0, min(have - body_start, dest.nbytes))
        dest[:got] = buf[body_start:body_start + got]  # at most RECV_SCRATCH_BYTES from the first read
        tail = have - (body_start + got)
        if got < dest.nbytes:
            _recv_exact_into(sock, dest[got:])
            tail = 0
        if tail < 2:
            _recv_exact_into(sock, memoryview(bytearray(2 - tail)))
        return True


def _redirected(reply: Any) -> bool:
    """Whether a reply is a cluster redirection (the command did not run on that node)."""
    return isinstance(reply, (redis.exceptions.MovedError, redis.exceptions.AskError))


def detect_cluster(address: str, timeout_s: float = 10.0) -> bool:
    """Whether the first node of ``address`` runs in cluster mode."""
    endpoint = parse_address(address)[0]
    kwargs = {"unix_socket_path": endpoint} if isinstance(endpoint, str) else {"host": endpoint[0], "port": endpoint[1]}
    client = redis.Redis(socket_connect_timeout=timeout_s, **kwargs)
    try:
        return client.info("cluster").get("cluster_enabled") == 1
    finally:
        client.close()
