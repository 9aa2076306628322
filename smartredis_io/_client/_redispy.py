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
import ssl
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis._parsers.base import BaseParser
from redis.cluster import RedisCluster

RECV_SCRATCH_BYTES = 1024
TLS_JOIN_BYTES = 64 * 1024  # over TLS, values up to this size are sent as one joined buffer
SCRATCH_BYTES = 64 * 1024  # a connection's receive buffer: values up to this size arrive in one system call
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


def pool_at(client: redis.Redis | RedisCluster, endpoint: tuple[str, int] | str) -> redis.ConnectionPool | None:
    """The pool of the database node at ``endpoint`` (``(host, port)`` or a socket path); None if none is there.

    A standalone client has one node: its own address, compared as given (no name resolution,
    as SmartRedis compares). A cluster client knows every node from the cluster's slot map.
    """
    if isinstance(client, RedisCluster):
        if not isinstance(endpoint, tuple):
            return None
        node = client.get_node(host=endpoint[0], port=endpoint[1])
        return None if node is None else node.redis_connection.connection_pool
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if isinstance(endpoint, tuple):
        return pool if (kwargs.get("host"), kwargs.get("port")) == endpoint else None
    return pool if kwargs.get("path") == endpoint else None


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


class ConnectionCache:
    """Connections of redis-py pools kept out of their pools for the hot paths, one free list per pool.

    Taking a connection from a redis-py pool and releasing it costs about as much client time as a
    small command's round trip; a kept connection costs a list pop and append (atomic, so threads
    can share the cache: each takes a connection of its own). A connection whose exchange did not
    finish is disconnected and given back to its pool, never kept.
    """

    def __init__(self) -> None:
        self._free: dict[int, tuple[redis.ConnectionPool, list[Any]]] = {}

    def take(self, pool: redis.ConnectionPool) -> Any:
        entry = self._free.get(id(pool))
        if entry is not None:
            try:
                return entry[1].pop()
            except IndexError:
                pass
        return pool.get_connection()

    def give(self, pool: redis.ConnectionPool, conn: Any) -> None:
        entry = self._free.get(id(pool))
        if entry is None:
            entry = self._free.setdefault(id(pool), (pool, []))
        entry[1].append(conn)

    @staticmethod
    def discard(pool: redis.ConnectionPool, conn: Any) -> None:
        conn.disconnect()
        pool.release(conn)

    def close(self) -> None:
        """Give every kept connection back to its pool."""
        entries, self._free = list(self._free.values()), {}
        for pool, conns in entries:
            for conn in conns:
                pool.release(conn)


def _socket(conn: Any) -> socket.socket:
    if conn._sock is None:
        conn.connect()
    return conn._sock


def socket_of(conn: Any) -> socket.socket:
    """The socket of a redis-py connection (connected now if it is not), to wait on several with ``select``."""
    return _socket(conn)


def endpoint_of(client: redis.Redis | RedisCluster, key: str) -> tuple[str, int] | None:
    """``(host, port)`` of the cluster node that serves ``key``; None for a standalone client."""
    if not isinstance(client, RedisCluster):
        return None
    node = client.get_node_from_key(key)
    return node.host, node.port


def send_buffers(conn: Any, buffers: Sequence[bytes | memoryview]) -> None:
    """Send already packed RESP ``buffers`` in one system call (``sendmsg``), without joining them.

    A TLS socket has no ``sendmsg``: its buffers are sent one after the other (joined when small).
    """
    sock = _socket(conn)
    try:
        if isinstance(sock, ssl.SSLSocket):
            if sum(memoryview(b).nbytes for b in buffers) <= TLS_JOIN_BYTES:
                buffers = [b"".join(buffers)]  # one TLS record rather than several
            for buffer in buffers:
                sock.sendall(buffer)
            return
        views = [memoryview(b).cast("B") for b in buffers]
        remaining = sum(v.nbytes for v in views)
        while True:
            sent = sock.sendmsg(views)
            remaining -= sent
            if remaining <= 0:
                return
            while sent >= views[0].nbytes:  # drop what went out, keep the rest
                sent -= views.pop(0).nbytes
            views[0] = views[0][sent:]
    except TimeoutError:
        raise redis.exceptions.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"Error while writing to socket: {exc}") from None


def pack_get(key: str, errors: str = "strict") -> bytes:
    """RESP of ``GET key`` (``errors``: how the key is encoded to UTF-8, as redis-py's ``encoding_errors``)."""
    bkey = key.encode("utf-8", errors)
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(bkey), bkey)


def read_replies(conn: Any, count: int, scratch_bytes: int = RECV_SCRATCH_BYTES) -> list[Any]:
    """Read ``count`` replies that are not arrays (status, error, integer, bulk, null) on ``conn``.

    Errors are returned as redis-py's exception objects (``MovedError`` for a redirection), not
    raised, so that every reply is consumed and the connection stays usable. Bulk replies are
    expected small (they are copied); large values are read with :func:`read_bulk_into`.
    """
    sock = conn._sock
    buf = bytearray(scratch_bytes)
    have = pos = 0
    replies: list[Any] = []
    while len(replies) < count:
        eol = buf.find(CRLF, pos, have)
        if eol >= 0:
            start, kind, line = pos, buf[pos], bytes(buf[pos + 1:eol])
            if kind == 0x24:  # $ bulk
                length = int(line)
                if length < 0:
                    replies.append(None)
                    pos = eol + 2
                    continue
                end = eol + 2 + length
                if end + 2 <= have:
                    replies.append(bytes(buf[eol + 2:end]))
                    pos = end + 2
                    continue
                if end + 2 > len(buf):
                    buf.extend(bytes(end + 2 - len(buf)))
            else:
                pos = eol + 2
                if kind == 0x2B:  # + status
                    replies.append(line)
                elif kind == 0x2D:  # - error
                    replies.append(BaseParser.parse_error(line.decode(errors="replace")))
                elif kind == 0x3A:  # : integer
                    replies.append(int(line))
                elif kind == 0x5F:  # _ RESP3 null
                    replies.append(None)
                else:
                    raise redis.exceptions.InvalidResponse(f"Unexpected reply: {bytes(buf[start:eol])[:64]!r}")
                continue
        if have == len(buf):
            buf.extend(bytes(len(buf)))
        have += _recv_into(sock, memoryview(buf)[have:])
    if pos != have:
        raise redis.exceptions.InvalidResponse(f"{have - pos} unexpected bytes after {count} replies")
    return replies


def encode_commands(commands: Sequence[Command], errors: str) -> Sequence[Command]:
    """``commands`` with their str arguments as UTF-8 bytes, encoded with ``errors``.

    redis-py's hiredis packer encodes str arguments as strict UTF-8 whatever the client's
    ``encoding_errors``; a key decoded with ``"surrogateescape"`` (a cluster's binary hash-tag
    prefixes) must reach it as the bytes it was received as.
    """
    if errors == "strict":
        return commands  # what every packer does already
    return [tuple(a.encode("utf-8", errors) if isinstance(a, str) else a for a in command) for command in commands]


def send_commands(conn: Any, commands: Sequence[Command]) -> None:
    """Pack ``commands`` and send them in one write (str arguments encoded as ``conn``'s client says)."""
    commands = encode_commands(commands, conn.encoder.encoding_errors)
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
    return isinstance(reply, (redis.exceptions.MovedError, redis.exceptions.AskError, Redirected))


def pack_getrange_and_set(key: str, total: int, peek: int, px_ms: int | None = None,
                          errors: str = "strict") -> tuple[bytes, bytes]:
    """RESP of ``GETRANGE key 0 peek-1`` then ``SET key <total bytes> [PX px_ms]``, around the value.

    Returns (head, tail): the caller sends head, the value's ``total`` bytes, then tail.
    """
    bkey = key.encode("utf-8", errors)
    last = str(peek - 1).encode()
    head = (
        b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s\r\n$1\r\n0\r\n$%d\r\n%s\r\n" % (len(bkey), bkey, len(last), last)
        + b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 if px_ms is None else 5, len(bkey), bkey, total)
    )
    if px_ms is None:
        return head, CRLF
    ms = str(int(px_ms)).encode()
    return head, CRLF + b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)


def _received(receive: Callable[..., int], *args: Any) -> int:
    """The byte count of ``receive(*args)``; its failures and the server's close as redis-py's errors."""
    try:
        n = receive(*args)
    except TimeoutError:
        raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"Error while reading from socket: {exc}") from None
    if n == 0:
        raise redis.exceptions.ConnectionError("Connection closed by server")
    return n


def _recv_into(sock: socket.socket, view: memoryview) -> int:
    return _received(sock.recv_into, view)


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        view = view[_recv_into(sock, view):]


def _recvmsg_into(sock: socket.socket, buffers: list[memoryview]) -> int:
    return sock.recvmsg_into(buffers)[0]


def _recv_exact_into_both(sock: socket.socket, first: memoryview, second: memoryview) -> None:
    """Fill ``first`` then ``second``, with one system call per arrival (``recvmsg_into``) where it can."""
    if isinstance(sock, ssl.SSLSocket):
        _recv_exact_into(sock, first)
        _recv_exact_into(sock, second)
        return
    while first.nbytes or second.nbytes:
        n = _received(_recvmsg_into, sock, [first, second] if first.nbytes else [second])
        taken = min(n, first.nbytes)
        first, second = first[taken:], second[n - taken:]


def _scratch(conn: Any) -> bytearray:
    """The connection's own receive buffer (one per connection: a connection serves one thread at a time)."""
    scratch = conn.__dict__.get("_srio_scratch")
    if scratch is None:
        scratch = conn.__dict__["_srio_scratch"] = bytearray(SCRATCH_BYTES)
    return scratch


def read_bulk_into(conn: Any, plan: ReadPlan, peek: int) -> bool:
    """Read a bulk-string reply on ``conn`` into the buffer that ``plan`` picks.

    ``plan`` sees the value's first ``peek`` bytes and its length before any destination exists, so
    it can check a header and refuse a value before allocating for it. False for a null reply.

    The first read goes to the connection's scratch buffer (a small value arrives whole in one
    system call and is copied from there); the rest of a larger value is received straight into the
    destination, together with the reply's final CRLF.

    Raises:
        Redirected: a cluster redirection (nothing was read into a destination).
        redis.exceptions.ResponseError: the server answered an error.
    """
    sock = conn._sock
    scratch = _scratch(conn)
    buf = memoryview(scratch)
    have = _recv_into(sock, buf)
    while (eol := scratch.find(CRLF, 0, have)) < 0:
        if have == len(scratch):
            raise redis.exceptions.InvalidResponse(f"Unexpected reply: {bytes(scratch[:64])!r}")
        have += _recv_into(sock, buf[have:])
    kind = scratch[0]
    if kind == 0x2D:  # - error
        error = BaseParser.parse_error(bytes(scratch[1:eol]).decode(errors="replace"))
        if isinstance(error, (redis.exceptions.MovedError, redis.exceptions.AskError)):
            raise Redirected(str(error))
        raise error
    if kind == 0x5F:  # _ RESP3 null: no such key
        return False
    if kind != 0x24:
        raise redis.exceptions.InvalidResponse(f"Unexpected reply to GET: {bytes(scratch[:min(eol, 64)])!r}")
    length = int(scratch[1:eol])
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
    dest[:got] = buf[body_start:body_start + got]  # at most SCRATCH_BYTES, from the first read
    tail = have - (body_start + got)
    if got < dest.nbytes:
        _recv_exact_into_both(sock, dest[got:], memoryview(bytearray(2)))
    elif tail < 2:
        _recv_exact_into(sock, memoryview(bytearray(2 - tail)))
    return True
