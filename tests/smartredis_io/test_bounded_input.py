"""Stored values that lie about their size, and names the protocol has to carry.

A value's header is data like any other: anyone who can write the key can forge it. Reading one
must cost what is stored, not what the header claims.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smartredis_io import Client, SmartRedisCheckpointIO, wire
from smartredis_io.error import RedisInternalError, RedisRuntimeError
from tests.support.srio_models import SCRIPT

F8 = 1  # the wire code of float64
U1 = 7  # the wire code of uint8


@pytest.fixture
def plain(redis_server) -> redis.Redis:
    """A raw connection, writing as any client of the database could."""
    with redis.Redis(host=redis_server.host, port=redis_server.port) as client:
        yield client


def test_a_header_claiming_2_to_the_40_elements_is_refused_before_allocating(standalone: Client, plain, uid: str):
    plain.set(uid, wire.encode_header(F8, (1 << 40,)) + b"\0" * 64)
    with pytest.raises(RedisInternalError, match=rf"{uid}.*claims {8 << 40} bytes.*but 64 are stored"):
        standalone.get_tensor(uid)


def test_a_chunked_header_claiming_more_than_its_chunks_hold_is_refused(standalone: Client, plain, uid: str,
                                                                       monkeypatch) -> None:
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, "1024")
    standalone.put_tensor(uid, np.zeros(300))  # 2400 bytes in 3 chunks
    header = wire.decode_header(plain.getrange(uid, 0, wire.HEADER_MAX_BYTES - 1), uid)
    forged = wire.encode_header(F8, (1 << 40,), header.chunks, header.crc, 8 << 40, header.version)
    plain.set(uid, forged)
    with pytest.raises(RedisInternalError, match=rf"{uid}.*claims {8 << 40} bytes.*but 2400 are stored"):
        standalone.get_tensor(uid)
    plain.set(uid, wire.encode_header(F8, (1 << 37,), 2048, 0, 1 << 40, "ab" * 16))  # chunks that do not exist
    with pytest.raises(RedisInternalError, match="chunks and some of them do not exist"):
        standalone.get_tensor(uid)


def test_a_forged_checkpoint_header_is_refused(redis_server, plain, uid: str) -> None:
    io = SmartRedisCheckpointIO(redis_server.address, cluster=False)
    plain.set(f"{uid}.ckpt", wire.encode_header(U1, (1 << 40,), 1 << 12, 0, 1 << 40, "cd" * 16))
    with pytest.raises(RedisInternalError, match="do not exist"):
        io.load_checkpoint(f"{uid}.ckpt")
    io.teardown()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.one_of(st.integers(0, 4), st.integers(0, 1 << 40)), min_size=0, max_size=4),
       stored=st.integers(0, 256))
def test_any_forged_inline_header_reads_exactly_or_is_refused(standalone: Client, plain, uid: str,
                                                             shape: list[int], stored: int) -> None:
    plain.set(uid, wire.encode_header(F8, tuple(shape)) + b"\x01" * stored)
    claimed = int(np.prod(shape, dtype=object)) * 8 if shape else 8
    extent = int(np.prod([d for d in shape if d], dtype=object)) * 8 if shape else 8
    if extent >= 1 << 63:  # e.g. (0, 2**20, 2**20, 2**20): empty, yet no array can have that shape
        with pytest.raises(RedisInternalError, match="no array has the shape"):
            standalone.get_tensor(uid)
    elif claimed == stored:
        assert standalone.get_tensor(uid).shape == tuple(shape)
    else:
        with pytest.raises(RedisInternalError, match=f"claims {claimed} bytes"):
            standalone.get_tensor(uid)


def test_model_names_with_newlines_run(orch_client: Client, uid: str) -> None:
    """The request protocol carries any key (a newline in a name used to make run_model time out)."""
    name = f"{uid}\nline two"
    orch_client.set_script(name, SCRIPT)
    orch_client.put_tensor(uid + "x", np.ones(3))
    orch_client.run_script(name, "double", uid + "x", uid + "\ny")
    np.testing.assert_array_equal(orch_client.get_tensor(uid + "\ny"), 2 * np.ones(3))


def test_names_that_are_not_text_are_refused_naming_them(standalone: Client) -> None:
    with pytest.raises(RedisRuntimeError, match=r"(?s)put_tensor.*'bad\\udc80'.*valid Unicode"):
        standalone.put_tensor("bad\udc80", np.ones(1))


def test_torch_checkpoints_keep_round_tripping(redis_server, uid: str) -> None:
    io = SmartRedisCheckpointIO(redis_server.address, cluster=False, chunk_bytes=4096)
    io.save_checkpoint({"w": torch.arange(5000)}, f"{uid}.ckpt")
    torch.testing.assert_close(io.load_checkpoint(f"{uid}.ckpt")["w"], torch.arange(5000))
    io.teardown()
