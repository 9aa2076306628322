"""The one place that reaches below redis-py's public API.

The tensor hot paths send and read RESP themselves on redis-py's pooled connections: a put sends the
header followed by a memoryview of the caller's array (no concatenation copy), a get reads the bulk
reply with ``recv_into`` straight into the caller's array, and the run_model request/reply exchange
skips redis-py's pipeline machinery. That needs a connection's socket (``Connection._sock``), its
packers and reader, and the pool of a cluster node; all of it is here, so that a redis-py release
that moves these things breaks one module and its test (``tests/smartredis_io/test_redispy_adapter.py``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.cluster import RedisCluster

RECV_SCRATCH_BYTES = 1024
CRLF = b"\r\n"

# plan(first bytes of the value, total value length) -> (bytes to skip, destination of the rest)
ReadPlan = Callable[[memoryview, int], "tuple[int, memoryview]"]
# (NAME, key, *arguments): a command whose first argument is the only key it touches
Command = tuple[Any, ...]


class Redirected(Exception):
    """The server answered a cluster redirection (MOVED / ASK): the command did not run there."""


def node_pool(client: redis.Redis | RedisCluster, key: str) -> redis.ConnectionPool:
    """The connection pool of the node that serves ``key`` (the only pool of a standalone client)."""
    if isinstance(client, RedisCluster):
        return client.get_node_from_key(key).redis_connection.connection_pool
    return client.connection_pool


def shared_pool(client: redis.Redis | RedisCluster, keys: Sequence[str]) -> redis.ConnectionPool | None:
    """The pool of the one node every key lives on; None when they span cluster nodes."""
    if not isinstance(client, RedisCluster):
        return client.connection_pool
    first, *rest = (client.get_node_from_key(key) for key in keys)
    if any(node.name != first.name for node in rest):
        return None
    return first.redis_connection.connection_pool


@contextmanager
def pooled_connection(pool: redis.ConnectionPool) -> Iterator[Any]:
    """A connection from ``pool``, released after use; dropped if the exchange did not finish."""
    conn = pool.get_connection()
    try:
        yield conn
    except BaseException:
        # The reply may be half read: the connection cannot be reused.
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def send_commands(conn: Any, commands: Sequence[Command]) -> None:
    """Pack ``commands`` and send them in one write."""
    conn.send_packed_command(conn.pack_commands(commands))


def send_parts(conn: Any, parts: Sequence[bytes | memoryview]) -> None:
    """Send already packed RESP ``parts`` (memoryviews are sent without a copy)."""
    conn.send_packed_command(list(parts))


def read_reply(conn: Any, timeout: float | None = None) -> Any:
    """The next reply on ``conn``; an error reply is returned as its exception, not raised.

    ``timeout`` replaces the connection's socket timeout for this reply only (blocking commands).
    """
    try:
        if timeout is None:
            return conn.read_response()
        return conn.read_response(timeout=timeout)
    except redis.exceptions.ResponseError as exc:
        return exc


def is_redirect(reply: Any) -> bool:
    """Whether a reply is a cluster redirection (the command did not run on that node)."""
    return isinstance(reply, (redis.exceptions.MovedError, redis.exceptions.AskError))


def pack_getrange_and_set(key: str, total: int, peek: int, px_ms: int | None = None) -> tuple[bytes, bytes]:
    """RESP of ``GETRANGE key 0 peek-1`` then ``SET key <total bytes> [PX px_ms]``, around the value.

    Returns (head, tail): the caller sends head, the value's ``total`` bytes, then tail.
    """
    bkey = key.encode()
    last = str(peek - 1).encode()
    head = (
        b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$1\r\n0\r\n$%d\r\n%s\r\n" % (len(bkey), bkey, len(last), last)
        + b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 if px_ms is None else 5, len(bkey), bkey, total)
    )
    if px_ms is None:
        return head, CRLF
    ms = str(int(px_ms)).encode()
    return head, CRLF + b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)


def _recv_into(sock: socket.socket, view: memoryview) -> int:
    try:
        n = sock.recv_into(view)
    except TimeoutError:
        raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"Error while reading from socket: {exc}") from None
    if n == 0:
        raise redis.exceptions.ConnectionError("Connection closed by server")
    return n


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        view = view[_recv_into(sock, view):]


def read_bulk_into(conn: Any, plan: ReadPlan, peek: int) -> bool:
    """Read a bulk-string reply on ``conn`` into the buffer that ``plan`` picks.

    ``plan`` sees the value's first ``peek`` bytes and its length before any destination exists, so
    it can check a header and refuse a value before allocating for it. False for a null reply.

    Raises:
        Redirected: a cluster redirection (nothing was read into a destination).
        redis.exceptions.ResponseError: the server answered an error.
    """
    sock = conn._sock
    scratch = bytearray(max(RECV_SCRATCH_BYTES, peek + 64))
    buf = memoryview(scratch)
    have = _recv_into(sock, buf)
    while (eol := scratch.find(CRLF, 0, have)) < 0:
        if have == len(scratch):
            raise redis.exceptions.InvalidResponse(f"Unexpected reply: {bytes(scratch[:64])!r}")
        have += _recv_into(sock, buf[have:])
    line = bytes(scratch[:eol])
    if line[:1] == b"-":
        message = line[1:].decode(errors="replace")
        if message.startswith(("MOVED", "ASK")):
            raise Redirected(message)
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
