"""Tensors: round trips of every dtype and shape, chunked values, key operations and bad input."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis.extra import numpy as hnp
from redis.cluster import key_slot

from smartredis_io import Client, ConfigOptions, bfloat16, error
from smartredis_io._client import wire
from smartredis_io.error import (
    RedisConnectionError,
    RedisInternalError,
    RedisKeyError,
    RedisReplyError,
    RedisRuntimeError,
)
from tests.support.redis_faults import deaths, lasting_orphans

DTYPES = ["f8", "f4", "f2", "i1", "i2", "i4", "i8", "u1", "u2", "?"]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _arrays(dtype: str):
    return hnp.arrays(np.dtype(dtype), SHAPES)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_every_dtype_and_shape(any_client: Client, uid: str, dtype: str) -> None:
    @HYPOTHESIS
    @given(array=_arrays(dtype))
    def check(array: np.ndarray) -> None:
        any_client.put_tensor(uid, array)
        assert _same(any_client.get_tensor(uid), array)
        out = np.empty_like(array)
        any_client.unpack_tensor(uid, out)
        assert _same(out, array)

    check()


def test_bfloat16_keeps_its_dtype(standalone: Client, uid: str) -> None:
    bits = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16).view(bfloat16)  # 1.0, 2.0, -3.0
    standalone.put_tensor(uid, bits)
    back = standalone.get_tensor(uid)
    assert wire.is_bfloat16(back.dtype) and back.tobytes() == bits.tobytes()
    with pytest.raises(RedisRuntimeError, match="bfloat16"):
        standalone.unpack_tensor(uid, np.empty(3, np.uint16))


def test_non_contiguous_and_big_endian_inputs_are_stored_in_c_order(standalone: Client, uid: str) -> None:
    base = np.arange(24, dtype=">i4").reshape(4, 6)
    standalone.put_tensor(uid, base[:, ::2])
    np.testing.assert_array_equal(standalone.get_tensor(uid), base[:, ::2])


def test_unsupported_dtype_is_a_type_error(standalone: Client, uid: str) -> None:
    with pytest.raises(TypeError, match="Unsupported"):
        standalone.put_tensor(uid, np.zeros(3, np.complex64))
    with pytest.raises(TypeError):
        standalone.put_tensor(uid, [1, 2, 3])


@pytest.mark.parametrize("bulk_limit", [4096, 1000])
def test_values_above_the_bulk_limit_are_chunked(any_client: Client, raw, uid: str, monkeypatch, bulk_limit) -> None:
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, str(bulk_limit))
    big = np.random.default_rng(0).random((40, 50))  # 16 000 bytes
    any_client.put_tensor(uid, big)
    header = wire.decode_header(raw.getrange(uid, 0, wire.HEADER_MAX_BYTES - 1), uid)
    assert header.chunks == -(-big.nbytes // bulk_limit)
    assert len({key_slot(k.encode()) for k in [uid, *header.chunk_keys(uid)]}) == 1, "a tensor's chunks share its slot"
    out = np.empty_like(big)
    any_client.unpack_tensor(uid, out)
    np.testing.assert_array_equal(out, big)
    any_client.put_tensor(uid, big[:2])  # overwrite with an inline value: old chunks go away
    assert not any(raw.exists(k) for k in header.chunk_keys(uid))
    np.testing.assert_array_equal(any_client.get_tensor(uid), big[:2])


@pytest.mark.parametrize("operation", ["overwrite", "delete"])
def test_a_chunked_tensor_writer_killed_before_any_of_its_commands_leaves_a_whole_value_and_only_chunks_that_expire(
        redis_server, uid: str, monkeypatch, operation: str) -> None:
    """put_tensor over a chunked tensor, or delete_tensor, dies before its n-th command, for every n:
    the key holds the old value or the new one (or none, deleted), whole, and no chunk outlives it."""
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, "4096")
    old, new = np.full(3000, 1.0), np.full(3000, 2.0)
    plain = redis.Redis(host=redis_server.host, port=redis_server.port)

    def run() -> None:
        with Client(False, redis_server.address) as client:
            client.put_tensor(uid, new) if operation == "overwrite" else client.delete_tensor(uid)

    def put_old() -> None:
        with Client(False, redis_server.address) as client:
            client.put_tensor(uid, old)

    for where in deaths(monkeypatch, run, put_old):
        assert not lasting_orphans(plain, f"*{uid}*"), where
        with Client(False, redis_server.address) as client:
            if client.tensor_exists(uid):
                assert np.unique(client.get_tensor(uid)).tolist() in ([1.0], [2.0]), where
            else:
                assert operation == "delete", where
    plain.close()


def test_corrupted_chunk_fails_its_checksum(standalone: Client, raw, uid: str, monkeypatch) -> None:
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, "1024")
    standalone.put_tensor(uid, np.ones(1000))
    header = wire.decode_header(raw.getrange(uid, 0, wire.HEADER_MAX_BYTES - 1), uid)
    raw.setrange(header.chunk_keys(uid)[1], 10, b"\x07")
    with pytest.raises(RedisInternalError, match="kept changing"):
        standalone.get_tensor(uid)


def test_key_operations(any_client: Client, uid: str) -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    any_client.put_tensor(uid, a)
    assert any_client.tensor_exists(uid) and any_client.key_exists(uid)
    any_client.copy_tensor(uid, uid + "copy")
    any_client.rename_tensor(uid + "copy", uid + "moved")
    assert not any_client.tensor_exists(uid + "copy")
    np.testing.assert_array_equal(any_client.get_tensor(uid + "moved"), a)
    any_client.delete_tensor(uid)
    assert not any_client.tensor_exists(uid)
    assert any_client.poll_tensor(uid + "moved", 10, 2)
    assert not any_client.poll_key(uid, 10, 3)


def test_poll_sees_a_tensor_put_later(standalone: Client, redis_server, uid: str) -> None:
    import threading

    def later() -> None:
        time.sleep(0.2)
        with Client(False, redis_server.address) as other:
            other.put_tensor(uid, np.zeros(1))

    thread = threading.Thread(target=later)
    thread.start()
    assert standalone.poll_tensor(uid, 50, 100)
    thread.join()


def test_unknown_key(any_client: Client, uid: str) -> None:
    with pytest.raises(RedisKeyError):
        any_client.get_tensor(uid)
    with pytest.raises(RedisReplyError):  # the base class catches every reply error
        any_client.unpack_tensor(uid, np.empty(3))
    any_client.delete_tensor(uid)  # nothing there: nothing happens, as SmartRedis' UNLINK
    assert not any_client.key_exists(uid)


def test_unpack_tensor_rejects_wrong_buffers(any_client: Client, uid: str) -> None:
    any_client.put_tensor(uid, np.ones((4, 6), np.float32))
    with pytest.raises(RedisRuntimeError, match="float32"):
        any_client.unpack_tensor(uid, np.empty((4, 6), np.float64))
    with pytest.raises(RedisRuntimeError, match="shape"):
        any_client.unpack_tensor(uid, np.empty((6, 4), np.float32))
    with pytest.raises(RedisRuntimeError, match="contiguous"):
        any_client.unpack_tensor(uid, np.empty((4, 12), np.float32)[:, ::2])
    with pytest.raises(TypeError):
        any_client.unpack_tensor(uid, [0.0] * 24)
    out = np.zeros((4, 6), np.float32)
    any_client.unpack_tensor(uid, out)  # the connection is still usable after the rejections
    assert out.sum() == 24


def test_a_key_that_is_not_a_tensor(standalone: Client, raw, uid: str) -> None:
    raw.set(uid, b"plain string")
    with pytest.raises(RedisRuntimeError, match="not a tensor"):
        standalone.get_tensor(uid)


def test_unreachable_address_fails_within_the_connection_timeout(monkeypatch) -> None:
    from lightning_storage_plugins.services import free_port

    monkeypatch.setenv("SR_CONN_TIMEOUT", "1")  # seconds, as SmartRedis
    monkeypatch.setenv("SR_CONN_INTERVAL", "100")  # milliseconds
    start = time.monotonic()
    with pytest.raises(RedisConnectionError, match=r"127\.0\.0\.1"):
        Client(False, f"127.0.0.1:{free_port()}")
    assert time.monotonic() - start < 3.0


def test_missing_ssdb_and_bad_arguments() -> None:
    with pytest.raises(RedisConnectionError, match="SSDB"):
        Client(None)
    with pytest.raises(TypeError):
        Client("127.0.0.1:6379")
    with pytest.raises(TypeError):
        Client(False, address="127.0.0.1:1", bogus=1)


def test_constructors(redis_server, redis_cluster, monkeypatch, uid: str) -> None:
    monkeypatch.setenv("SSDB_ALT", redis_cluster.address)
    monkeypatch.setenv("SR_DB_TYPE_ALT", "Clustered")
    options = ConfigOptions.create_from_environment("ALT")
    with Client(options, logger_name="alt") as client:
        assert "Clustered" in str(client) and client.key_exists("never-set") is False
    monkeypatch.setenv("SSDB", redis_server.address)
    with Client(logger_name="env") as client:
        assert "Standalone" in str(client)
        client.put_tensor(uid, np.zeros(2))
    with Client(cluster=False) as client:
        assert client.tensor_exists(uid)


def test_the_address_given_is_not_written_to_the_environment(redis_server, uid: str) -> None:
    with Client(False, redis_server.address) as client:
        client.put_tensor(uid, np.zeros(1))
    assert "SSDB" not in os.environ
    with pytest.raises(RedisConnectionError, match="SSDB"):
        Client(False)  # so a later client without an address does not silently reuse it


def test_config_options() -> None:
    options = ConfigOptions.create_from_environment("")
    with pytest.raises(RedisKeyError):
        options.get_integer_option("SR_NOT_SET_ANYWHERE")
    options.override_integer_option("SR_MODEL_TIMEOUT", 10)
    assert options.get_integer_option("SR_MODEL_TIMEOUT") == 10 and options.is_configured("SR_MODEL_TIMEOUT")
    with pytest.raises(RedisRuntimeError):
        ConfigOptions().get_string_option("SSDB")


def test_error_hierarchy() -> None:
    for name in ("RedisRuntimeError", "RedisKeyError", "RedisTimeoutError", "RedisBadAllocError",
                 "RedisDatabaseError", "RedisInternalError"):
        assert issubclass(getattr(error, name), RedisReplyError)
    assert not issubclass(RedisConnectionError, RedisReplyError)
    assert "put_tensor execution failed" in str(RedisReplyError("boom", "put_tensor"))


def test_server_errors_are_reply_errors(standalone: Client, raw, uid: str) -> None:
    raw.hset(uid, "f", "v")
    with pytest.raises(RedisReplyError, match=f"(?s)get_list_length.*{uid}.*WRONGTYPE"):
        standalone.get_list_length(uid)


def test_unix_socket_address(tmp_path, uid: str) -> None:
    from smartredis_io import RedisServer

    socket_path = tmp_path / "redis.sock"
    with RedisServer(extra_args=("--unixsocket", str(socket_path), "--unixsocketperm", "700")):
        with Client(False, f"unix://{socket_path}") as client:
            array = np.arange(1000, dtype=np.float32)
            client.put_tensor(uid, array)
            out = np.empty_like(array)
            client.unpack_tensor(uid, out)
            np.testing.assert_array_equal(out, array)
