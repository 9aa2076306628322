"""The raw exchange and tensor paths of ``Database``: error replies, and cluster redirections handed to redis-py."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from smartredis_io.connection import Database


@pytest.fixture(params=["standalone", "cluster"])
def db(request: pytest.FixtureRequest) -> Database:
    server = request.getfixturevalue("redis_server" if request.param == "standalone" else "redis_cluster")
    database = Database(server.address, request.param == "cluster", 5.0)
    yield database
    database.close()


def test_exchange_replies_in_order_and_errors_as_pipelines_do(db: Database, uid: str) -> None:
    key, other = f"{{{uid}}}.a", f"{{{uid}}}.b"
    assert db.exchange([("RPUSH", key, "x"), ("GET", other), ("SET", other, b"v"), ("GET", other)]) == [
        1, None, b"OK", b"v"]
    wrong_type = [("GET", key), ("LLEN", key)]
    error, length = db.exchange(wrong_type, raise_on_error=False)
    assert isinstance(error, redis.exceptions.ResponseError) and length == 1
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        db.exchange(wrong_type)
    assert db.exchange([("BLPOP", key, 0.01)]) == [[key.encode(), b"x"]]
    assert db.exchange([("BLPOP", key, 0.01)]) == [None]


def test_exchange_across_cluster_nodes(clustered, uid: str) -> None:
    db: Database = clustered._db
    keys = [f"{uid}.{i}" for i in range(12)]  # no shared hash tag: spread over the 3 shards
    assert len({db.redis.get_node_from_key(k).name for k in keys}) > 1
    assert db.exchange([("SET", k, k) for k in keys]) == [True] * len(keys)  # redis-py's pipeline
    assert db.exchange([("GET", k) for k in keys]) == [k.encode() for k in keys]


def test_cluster_redirections_are_run_again_through_redis_py(clustered, uid: str, monkeypatch) -> None:
    """Every command sent to the wrong shard is answered MOVED and run again, once, where it belongs."""
    db: Database = clustered._db
    key = f"{{{uid}}}.k"
    right = db.redis.get_node_from_key(key)
    wrong = next(n for n in db.redis.get_primaries() if n.name != right.name).redis_connection.connection_pool
    monkeypatch.setattr(db, "_pool", lambda _key: wrong)
    monkeypatch.setattr(db, "_shared_pool", lambda _commands: wrong)
    assert db.exchange([("RPUSH", key, "a"), ("RPUSH", key, "b"), ("LRANGE", key, 0, -1)]) == [
        1, 2, [b"a", b"b"]]
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    clustered.put_tensor(key + ".t", array)  # set_parts
    out = np.empty_like(array)
    clustered.unpack_tensor(key + ".t", out)  # get_into
    np.testing.assert_array_equal(out, array)
    monkeypatch.undo()
    assert db.redis.lrange(key, 0, -1) == [b"a", b"b"]
