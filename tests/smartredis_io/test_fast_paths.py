"""The tensor hot paths: kept connections, one system call each way, values around the buffer sizes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smartredis_io import Client
from smartredis_io._client import _redispy, wire

SCRATCH = _redispy.SCRATCH_BYTES
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def plain(redis_server) -> redis.Redis:
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    yield client
    client.close()


def test_values_around_the_receive_buffer_and_header_sizes(any_client: Client, uid: str) -> None:
    """Byte counts where a reply ends just inside, at, or past the first read, with either end of CRLF."""
    header = len(wire.encode_header(7, (0,)))
    sizes = {0, 1, wire.HEADER_MAX_BYTES, SCRATCH - header - 16, SCRATCH, SCRATCH + 1, 3 * SCRATCH + 7}
    sizes |= {SCRATCH - header - 8 - len(str(SCRATCH)) + d for d in range(-3, 4)}  # "$N\r\n" + value + "\r\n"
    for size in sorted(sizes):
        array = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
        any_client.put_tensor(uid, array)
        out = np.empty_like(array)
        any_client.unpack_tensor(uid, out)
        assert out.tobytes() == array.tobytes(), size


def test_round_trips_of_any_size(standalone: Client, uid: str) -> None:
    @HYPOTHESIS
    @given(size=st.integers(0, 4 * SCRATCH), dims=st.integers(1, 3))
    def check(size: int, dims: int) -> None:
        array = np.arange(size, dtype=np.float32).reshape((size,) + (1,) * (dims - 1))
        standalone.put_tensor(uid, array)
        np.testing.assert_array_equal(standalone.get_tensor(uid), array)

    check()


def test_send_buffers_finishes_partial_sends(plain: redis.Redis, uid: str) -> None:
    """A value larger than the socket's send buffer goes out in several sendmsg calls, in order."""
    value = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(uid), uid.encode(), value.nbytes)
    cache = _redispy.ConnectionCache()
    pool = plain.connection_pool
    conn = cache.take(pool)
    _redispy.send_buffers(conn, [head, memoryview(value)[: value.nbytes // 3], memoryview(value)[value.nbytes // 3:],
                                 _redispy.CRLF])
    assert _redispy.read_replies(conn, 1) == [b"OK"]
    cache.give(pool, conn)
    cache.close()
    assert plain.get(uid) == value.tobytes()


def test_read_replies_of_every_kind(plain: redis.Redis, uid: str) -> None:
    plain.set(uid, b"abc")
    cache = _redispy.ConnectionCache()
    pool = plain.connection_pool
    conn = cache.take(pool)
    _redispy.send_commands(conn, [("GET", uid), ("GET", uid + "missing"), ("STRLEN", uid), ("SET", uid, "x"),
                                  ("LPUSH", uid, "x"), ("GETRANGE", uid, 0, 0)])
    ok, missing, length, status, error, first = _redispy.read_replies(conn, 6, scratch_bytes=8)
    assert (ok, missing, length, status, first) == (b"abc", None, 3, b"OK", b"x")
    assert isinstance(error, redis.exceptions.ResponseError) and "WRONGTYPE" in str(error)
    cache.give(pool, conn)
    assert plain.ping()  # the kept connection is still in step with the server
    cache.close()


def test_a_failed_read_drops_the_connection_and_the_next_call_reconnects(standalone: Client, uid: str) -> None:
    standalone.put_tensor(uid, np.ones(10, np.float32))
    with pytest.raises(Exception, match="shape"):
        standalone.unpack_tensor(uid, np.empty(11, np.float32))  # refused after the header: body unread
    out = np.empty(10, np.float32)
    standalone.unpack_tensor(uid, out)  # a fresh connection, not one with the last body still unread
    assert out.tolist() == [1.0] * 10


def test_threads_share_a_client(any_client: Client, uid: str) -> None:
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            array = np.full(1000 + i, i, dtype=np.int32)
            out = np.empty_like(array)
            for _ in range(50):
                any_client.put_tensor(f"{uid}.{i}", array)
                any_client.unpack_tensor(f"{uid}.{i}", out)
                assert (out == i).all()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors


def test_closing_gives_the_kept_connections_back(plain: redis.Redis) -> None:
    pool = plain.connection_pool
    cache = _redispy.ConnectionCache()
    conns = [cache.take(pool) for _ in range(3)]
    for conn in conns:
        cache.give(pool, conn)
    assert cache.take(pool) is conns[-1]
    cache.give(pool, conns[-1])
    assert pool.get_connection() not in conns, "kept connections are not handed out by their pool"
    cache.close()
    assert pool.get_connection() in conns, "closing gave them back"
