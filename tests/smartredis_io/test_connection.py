"""The raw exchange and tensor paths of ``Database``: error replies, and cluster redirections handed to redis-py."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster as PyCluster
from redis.cluster import key_slot

from smartredis_io import Client
from smartredis_io._client.connection import Database


@pytest.fixture(params=["standalone", "cluster"])
def db(request: pytest.FixtureRequest) -> Database:
    server = request.getfixturevalue("redis_server" if request.param == "standalone" else "redis_cluster")
    database = Database(server.settings())
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


def test_exchange_across_cluster_nodes(redis_cluster, uid: str) -> None:
    keys = [f"{uid}.{i}" for i in range(12)]  # no shared hash tag: spread over the 3 shards
    with PyCluster.from_url(f"redis://{redis_cluster.address.split(',')[0]}") as plain:
        assert len({plain.get_node_from_key(k).name for k in keys}) > 1
    db = Database(redis_cluster.settings())
    assert db.exchange([("SET", k, k) for k in keys]) == [True] * len(keys)  # redis-py's pipeline
    assert db.exchange([("GET", k) for k in keys]) == [k.encode() for k in keys]
    db.close()


def test_a_transaction_starts_again_when_a_watched_key_changes_before_exec(db: Database, uid: str) -> None:
    key, other = f"{{{uid}}}.count", f"{{{uid}}}.seen"
    db.exchange([("SET", key, b"1")])
    seen = []

    def increment(read):
        (value,) = read([("GET", key)])
        seen.append(value)
        if len(seen) == 1:
            db.exchange([("SET", key, b"5")])  # another client's write, between WATCH and EXEC
        return [("SET", key, b"%d" % (int(value) + 1)), ("RPUSH", other, value)]

    assert db.transaction(key, [key], increment) == [b"OK", 1]
    assert seen == [b"1", b"5"]
    assert db.exchange([("GET", key), ("LRANGE", other, 0, -1)]) == [b"6", [b"5"]]


def test_a_transaction_whose_preparation_fails_runs_nothing(db: Database, uid: str) -> None:
    key = f"{{{uid}}}.kept"
    db.exchange([("SET", key, b"before")])

    def refuse(read):
        read([("GET", key)])
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        db.transaction(key, [key], refuse)
    assert db.exchange([("GET", key)]) == [b"before"]
    assert db.transaction(key, [key], lambda read: [("SET", key, b"after")]) == [b"OK"]  # no WATCH left over
    assert db.exchange([("GET", key)]) == [b"after"]


class _Shards:
    """Plain connections to each primary of the test cluster, to move slots as a resharding does."""

    def __init__(self, cluster) -> None:
        self.host = cluster.host
        self.nodes = [redis.Redis(host=cluster.host, port=port) for port in cluster.ports]
        self.ports = list(cluster.ports)
        self.ids = [node.execute_command("CLUSTER", "MYID").decode() for node in self.nodes]

    def owner(self, key: str) -> int:
        slot = key_slot(key.encode())
        for start, end, *holders in self.nodes[0].execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return self.ports.index(holders[0][1])
        raise AssertionError(f"slot {slot} has no owner")

    def migrate(self, key: str, dst: int) -> None:
        """Move the slot of ``key``, with its keys, to primary ``dst``."""
        slot, src = key_slot(key.encode()), self.owner(key)
        self.nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[src])
        self.nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[dst])
        for name in self.nodes[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
            self.nodes[src].migrate(self.host, self.ports[dst], name, 0, 5000)
        for node in self.nodes:
            node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[dst])

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def test_cluster_redirections_are_run_again_through_redis_py(redis_cluster, uid: str) -> None:
    """Commands sent to a shard that no longer owns the slot are answered MOVED and run again where it lives.

    A client learns the slot map, then slots move to another shard behind its back (as a resharding
    does): the exchange, the zero-copy put and the zero-copy get each meet a real MOVED.
    """
    shards = _Shards(redis_cluster)
    exchanged, put, got = f"{{{uid}x}}", f"{{{uid}p}}", f"{{{uid}g}}"
    watched = got + ".watched"  # in got's slot, which this client has not used since it moved
    home = {key: shards.owner(key) for key in (exchanged, put, got)}
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    db = Database(redis_cluster.settings())
    client = Client(True, redis_cluster.address)
    try:
        client.put_tensor(got, array)  # stored before its slot moves
        db.exchange([("GET", exchanged)])
        for key in (exchanged, put, got):
            shards.migrate(key, (home[key] + 1) % len(shards.nodes))
        assert db.exchange([("RPUSH", exchanged, "a"), ("RPUSH", exchanged, "b"), ("LRANGE", exchanged, 0, -1)]) == [
            1, 2, [b"a", b"b"]]
        client.put_tensor(put, array * 2)
        out = np.empty_like(array)
        client.unpack_tensor(got, out)
        np.testing.assert_array_equal(out, array)
        np.testing.assert_array_equal(client.get_tensor(put), array * 2)
        assert shards.nodes[shards.owner(put)].exists(put) and shards.owner(put) != home[put]
        assert db.transaction(watched, [watched], lambda read: [("SET", watched, b"t")]) == [b"OK"]
        assert shards.nodes[shards.owner(got)].get(watched) == b"t" and shards.owner(got) != home[got]
    finally:
        client.close()
        db.close()
        for key, owner in home.items():
            shards.migrate(key, owner)
            shards.nodes[owner].delete(key)
        shards.nodes[home[got]].delete(watched)
        shards.close()
