"""A process's death at a precise command to the database, and what it may leave there."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from smartredis_io._client import _redispy, wire
from smartredis_io.error import RedisReplyError


class Killed(BaseException):
    """Stands for SIGKILL at a precise command: nothing the process would send after it reaches the server."""


def sends_fail_from(monkeypatch, first: int) -> list[int]:
    """Every send to the database from the ``first``-th on (counting from 0) raises :class:`Killed`
    before its bytes go out; returns the counter of sends tried (redis-py's and the zero-copy ones)."""
    tried = [0]

    def guarded(send: Callable) -> Callable:
        def send_or_die(*args, **kwargs):
            tried[0] += 1
            if tried[0] > first:
                raise Killed
            return send(*args, **kwargs)
        return send_or_die

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        guarded(redis.connection.AbstractConnection.send_packed_command))
    monkeypatch.setattr(_redispy, "send_buffers", guarded(_redispy.send_buffers))
    return tried


def lasting_orphans(plain: redis.Redis | RedisCluster, match: str) -> list[bytes]:
    """The chunk keys matching ``match`` that no stored header names and that never expire."""
    scan = (plain.scan_iter(match=match, target_nodes=RedisCluster.ALL_NODES) if isinstance(plain, RedisCluster)
            else plain.scan_iter(match=match))
    keys = set(scan)
    named: set[bytes] = set()
    for key in keys:
        if b".chunk." in key or plain.type(key) != b"string":
            continue
        try:
            header = wire.decode_header(plain.getrange(key, 0, wire.HEADER_MAX_BYTES - 1), key.decode())
        except RedisReplyError:
            continue
        named |= {name.encode() for name in header.chunk_keys(key.decode())}
    return sorted(key for key in keys if b".chunk." in key and key not in named and plain.pttl(key) < 0)


def deaths(monkeypatch, run: Callable[[], None], before: Callable[[], None]) -> Iterator[str]:
    """Kill ``run`` before each of its commands in turn: ``run`` goes once whole to count its sends;
    then for every n, ``before()`` sets the stage and ``run`` dies before its n-th send. Yields, after
    each death, where it fell (for the caller's checks of what was left)."""
    before()
    with monkeypatch.context() as counting:
        tried = sends_fail_from(counting, 1 << 30)
        run()
    for first in range(tried[0]):
        before()
        with monkeypatch.context() as dying, pytest.raises(Killed):
            sends_fail_from(dying, first)
            run()
        yield f"killed before command {first} of {tried[0]}"
