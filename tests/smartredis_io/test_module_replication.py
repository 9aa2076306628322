"""What the Redis module writes reaches replicas and the AOF as the plain commands that reproduce it:
a replica, and a server replaying the AOF, hold the very keys and values of the primary after a
session of AI.TENSORSET / AI.MODELSTORE / AI.SCRIPTSTORE (chunked values included, whose names carry
versions the primary picked at random), and the published SmartRedis client reads them there."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from smartredis_io import RedisServer
from tests.support.srio_models import PUBLISHED_SKIP, SCRIPT, linear, torchscript_bytes
from tests.support.srio_sanitizers import sanitized
from tests.support.srio_workers import wait_until

smartredis = pytest.importorskip("smartredis", reason=PUBLISHED_SKIP, exc_type=ImportError)

BULK_LIMIT = 1024  # values above it are chunked
MODULE_ARGS = ("BULK_LIMIT_BYTES", str(BULK_LIMIT))


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


def _contents(client: redis.Redis) -> dict[bytes, tuple[bytes, int]]:
    """Every key's value and TTL."""
    return {key: (client.get(key), client.pttl(key)) for key in client.keys("*")}


def _session(client: redis.Redis, model: bytes) -> None:
    rng = np.random.default_rng(0)
    big = rng.standard_normal(3000)  # 24 KB: chunked
    client.execute_command("AI.TENSORSET", "blob", "DOUBLE", 3000, "BLOB", big.tobytes())
    client.execute_command("AI.TENSORSET", "values", "INT16", 2, 2, "VALUES", 1, -2, 3, -4)
    client.execute_command("AI.TENSORSET", "zeros", "FLOAT", 5000)  # zeros, chunked
    client.execute_command("AI.TENSORSET", "small", "UINT8", 3, "BLOB", b"\1\2\3")
    client.execute_command("AI.TENSORSET", "{tag}x", "DOUBLE", 3000, "BLOB", big[::-1].tobytes())
    client.execute_command("AI.TENSORSET", "zeros", "FLOAT", 2, "VALUES", 1.5, 2.5)  # its chunks go
    client.execute_command("AI.MODELSTORE", "model", "TORCH", "CPU", "TAG", "v1", "BLOB", model[:100], model[100:])
    client.execute_command("AI.MODELSTORE", "model", "TORCH", "CPU", "TAG", "v2", "BLOB", model)  # replaced
    client.execute_command("AI.MODELSTORE", "gone", "TORCH", "CPU", "BLOB", model)
    client.execute_command("AI.MODELDEL", "gone")
    client.execute_command("AI.SCRIPTSTORE", "script", "CPU", "ENTRY_POINTS", 1, "double", "SOURCE", SCRIPT)
    client.execute_command("AI.SCRIPTSET", "old", "CPU", "SOURCE", SCRIPT)
    client.execute_command("AI.SCRIPTDEL", "old")


def _published_reads(address: str, model: bytes) -> None:
    client = smartredis.Client(address=address, cluster=False)
    rng = np.random.default_rng(0)
    big = rng.standard_normal(3000)
    np.testing.assert_array_equal(client.get_tensor("blob"), big)
    np.testing.assert_array_equal(client.get_tensor("{tag}x"), big[::-1])
    np.testing.assert_array_equal(client.get_tensor("values"), [[1, -2], [3, -4]])
    np.testing.assert_array_equal(client.get_tensor("zeros"), np.array([1.5, 2.5], np.float32))
    assert client.get_model("model") == model
    assert client.get_script("script") == SCRIPT
    assert not client.model_exists("gone")


@pytest.mark.slow
def test_a_replica_and_an_aof_replay_hold_the_primarys_keys(tmp_path: Path) -> None:
    model = torchscript_bytes(linear(1), torch.ones(2, 4))
    assert len(model) > 2 * BULK_LIMIT, "the model's blob is chunked"
    with sanitized() as module:
        primary = RedisServer(persistence=True, module_args=MODULE_ARGS,
                              extra_args=("--appendonly", "yes", "--appendfsync", "always", "--save", ""), **module)
        with primary, _client(primary) as source:
            replica_args = ("--replicaof", "127.0.0.1", str(primary.port))
            with RedisServer(module_args=MODULE_ARGS, extra_args=replica_args, **module) as replica, \
                    _client(replica) as copy:
                wait_until(lambda: copy.info("replication")["master_link_status"] == "up", 30, "the replica syncs")
                _session(source, model)
                assert source.execute_command("WAIT", 1, 10_000) == 1
                expected = _contents(source)
                assert len([k for k in expected if b".chunk." in k]) >= 10, sorted(expected)
                assert _contents(copy) == expected, "the replica holds other keys or values"
                _published_reads(replica.address, model)
            aof = tmp_path / "aof"
            shutil.copytree(Path(source.config_get("dir")["dir"]) / "appendonlydir", aof / "appendonlydir")
        with RedisServer(persistence=True, module_args=MODULE_ARGS,
                         extra_args=("--appendonly", "yes", "--dir", str(aof)), **module) as replay, \
                _client(replay) as replayed:
            assert _contents(replayed) == expected, "the AOF replay holds other keys or values"
            _published_reads(replay.address, model)
