"""The redis-py internals that ``smartredis_io._client._redispy`` relies on are still there and behave as assumed.

A redis-py release that renames or changes one of them fails here, naming it, rather than somewhere
deep in a tensor round trip.
"""

from __future__ import annotations

import inspect
import socket

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster

from smartredis_io._client import _redispy

CHANGED = "redis-py changed under smartredis_io._client._redispy: "


@pytest.fixture
def plain(redis_server) -> redis.Redis:
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    yield client
    client.close()


def test_pooled_connections_expose_what_the_adapter_uses(plain: redis.Redis) -> None:
    with _redispy.pooled_connection(plain.connection_pool) as conn:  # get_connection() takes no arguments
        for name in ("send_packed_command", "pack_commands", "read_response", "send_command", "disconnect"):
            assert callable(getattr(conn, name, None)), CHANGED + f"Connection.{name} is gone"
        assert "timeout" in inspect.signature(conn.read_response).parameters, \
            CHANGED + "Connection.read_response() no longer takes timeout="
        conn.send_command("PING")
        assert conn.read_response() in (b"PONG", "PONG", True)
        assert isinstance(getattr(conn, "_sock", None), socket.socket), CHANGED + "Connection._sock is not the socket"


def test_round_trips_through_the_adapter(plain: redis.Redis, uid: str) -> None:
    pool = plain.connection_pool
    value = np.arange(1000, dtype=np.float64)
    with _redispy.pooled_connection(pool) as conn:
        head, tail = _redispy.pack_getrange_and_set(uid, value.nbytes, 8, px_ms=60_000)
        _redispy.send_parts(conn, [head, memoryview(value).cast("B"), tail])
        assert _redispy.read_reply(conn) == b""  # GETRANGE of a missing key
        assert _redispy.read_reply(conn) in (b"OK", "OK", True)
        _redispy.send_commands(conn, [("PTTL", uid)])
        assert 0 < _redispy.read_reply(conn) <= 60_000
        _redispy.send_commands(conn, [("LLEN", uid)])
        assert isinstance(_redispy.read_reply(conn), redis.exceptions.ResponseError)  # WRONGTYPE comes back
        out = np.empty_like(value)
        conn.send_command("GET", uid)
        assert _redispy.read_bulk_into(conn, lambda first, length: (0, memoryview(out).cast("B")), 16)
        conn.send_command("GET", uid + "missing")
        assert not _redispy.read_bulk_into(conn, lambda first, length: (0, memoryview(out).cast("B")), 16)
        _redispy.send_commands(conn, [("BLPOP", uid + "list", 0.05)])
        assert _redispy.read_reply(conn, timeout=2.0) is None
    np.testing.assert_array_equal(out, value)


def test_a_blocking_reply_wait_is_bounded_by_its_timeout(plain: redis.Redis, uid: str) -> None:
    with pytest.raises(redis.exceptions.TimeoutError):
        with _redispy.pooled_connection(plain.connection_pool) as conn:
            _redispy.send_commands(conn, [("BLPOP", uid, 5)])
            _redispy.read_reply(conn, timeout=0.2)


def test_cluster_node_pools(redis_cluster, uid: str) -> None:
    client = RedisCluster(host=redis_cluster.host, port=redis_cluster.ports[0])
    try:
        keys = [f"{uid}.{i}" for i in range(12)]
        pools = {id(_redispy.node_pool(client, k)) for k in keys}
        assert len(pools) > 1, CHANGED + "cluster nodes no longer have their own redis_connection pool"
        assert _redispy.shared_pool(client, keys) is None
        tagged = [f"{{{uid}}}.{i}" for i in range(5)]
        assert _redispy.shared_pool(client, tagged) is _redispy.node_pool(client, tagged[0])
    finally:
        client.close()
