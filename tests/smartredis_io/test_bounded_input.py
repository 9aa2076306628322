"""Stored values that lie about their size, names the protocol has to carry, and hostile commands.

A value's header is data like any other: anyone who can write the key can forge it. Reading one
must cost what is stored, not what the header claims. A command's sizes are checked before anything
is allocated for them: the Redis module answers each hostile command with an error and stays up, on
its release build and on its sanitizer build.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_storage_plugins.services import ServiceStartError
from smartredis_io import Client, RedisServer, SmartRedisCheckpointIO
from smartredis_io._client import protocol, wire
from smartredis_io.error import RedisInternalError, RedisRuntimeError
from tests.support.srio_models import SCRIPT
from tests.support.srio_sanitizers import sanitized
from tests.support.srio_workers import protocol_client, registry, wait_until

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


# ---- hostile commands to the Redis module, each on a fresh server ---------------------------------

SMALL_PEAK_BYTES = 64 << 20  # a fresh redis-server's footprint is a few MB
MODEL = b"PK\x03\x04 not a real archive: only its magic is checked when stored"


@pytest.fixture(params=["release", "sanitized"])
def fresh(request: pytest.FixtureRequest):
    """A fresh redis-server loading the module's release build, then its sanitizer build."""
    if request.param == "release":
        with RedisServer() as server:
            yield server
    else:
        with sanitized() as module, RedisServer(**module) as server:
            yield server


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)


def _deep_manifest(depth: int) -> bytes:
    return b'{"kind": "model", "version": "v", "x": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("command, error", [
    (("AI.TENSORSET", "t", "FLOAT", 100000, 100000, 100000), "holds 4000000000000000 bytes, more than this server"),
    (("AI.TENSORSET", "t", "UINT8", 1 << 30), "more than this server stores"),  # zeros beyond proto-max-bulk-len
    (("AI.TENSORSET", "t", "DOUBLE", 2305843009213693953, "BLOB", b"\0" * 8), "no array of DOUBLE"),  # wraps to 8
    (("AI.TENSORSET", "t", "FLOAT", 0, 1 << 62, 1 << 62), "no array of FLOAT"),  # empty, yet no array has it
    (("AI.TENSORSET", "t", "INT8", 1 << 40, "VALUES", 1), "more than this server stores"),
    (("AI.MODELEXECUTE", "m", "INPUTS", 1 << 62, "x", "OUTPUTS", 1, "y"), "number of input keys"),
    (("AI.MODELEXECUTE", "m", "INPUTS", 1, "x", "OUTPUTS", 1, "y", "TIMEOUT", 1 << 62), "Invalid value for TIMEOUT"),
])
def test_a_hostile_command_gets_an_error_and_allocates_nothing(fresh: RedisServer, command, error: str) -> None:
    with _client(fresh) as client:
        client.execute_command("AI.MODELSTORE", "m", "TORCH", "CPU", "BLOB", MODEL)
        with pytest.raises(redis.ResponseError, match=error):
            client.execute_command(*command)
        assert client.ping() and not client.exists("t")
        assert client.info("memory")["used_memory_peak"] < SMALL_PEAK_BYTES


def test_manifests_nested_past_the_parsers_limits_are_refused(fresh: RedisServer) -> None:
    """Any writer of a key can plant a manifest; the parser's depth and length are bounded (a 500,000
    levels deep one ended the server)."""
    with _client(fresh) as client:
        for depth in (500_000, 1_000_000):  # within, then past the 1 MiB a manifest may take
            client.set("k", _deep_manifest(depth))
            with pytest.raises(redis.ResponseError, match="cannot find run info"):
                client.execute_command("AI.INFO", "k")
            for command in (("AI.MODELGET", "k", "META"), ("AI.MODELEXECUTE", "k", "INPUTS", 1, "x", "OUTPUTS", 1, "y"),
                            ("AI.MODELSTORE", "k", "TORCH", "CPU", "BLOB", MODEL), ("AI.MODELDEL", "k")):
                with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                    client.execute_command(*command)
        client.set("k", _deep_manifest(30))  # fields a newer writer nests are skipped within the limit
        assert client.execute_command("AI.INFO", "k")[:4] == [b"key", b"k", b"type", b"MODEL"]
        assert client.ping()


def test_values_replies_are_bounded_like_tensors(fresh: RedisServer) -> None:
    """AI.TENSORGET VALUES answers one reply element per element: at most what the largest tensor
    would take, so a few bytes of command cannot grow a reply of gigabytes."""
    with _client(fresh) as client:
        client.config_set("proto-max-bulk-len", 1 << 20)  # the largest tensor follows it
        try:
            with pytest.raises(redis.ResponseError, match="more than this server stores"):
                client.execute_command("AI.TENSORSET", "t", "UINT8", 2 << 20)
            client.execute_command("AI.TENSORSET", "t", "UINT8", 1 << 20)
            with pytest.raises(redis.ResponseError, match="too many for a VALUES reply"):
                client.execute_command("AI.TENSORGET", "t", "VALUES")
            assert len(client.execute_command("AI.TENSORGET", "t", "BLOB")) == 1 << 20
        finally:
            client.config_set("proto-max-bulk-len", 512 << 20)


def test_the_worker_commands_bound_their_counts_and_waits(fresh: RedisServer) -> None:
    """A batch size or batch timeout stored with a model reaches SRIO.TAKE: absurd ones are bounded
    (nothing is allocated for them, no deadline overflows), malformed ones refused."""
    with protocol_client(fresh) as worker:
        for command, error in [(("SRIO.TAKE", "w", "m", 0, 0, 0), "max must be an integer of at least 1"),
                               (("SRIO.TAKE", "w", "m", 1, -1, 0), "min must be"),
                               (("SRIO.TAKE", "w", "m", 1, 0, "soon"), "wait-ms must be"),
                               (("SRIO.POP", "w", -1), "block-ms must be"),
                               (("SRIO.REPLY", "w", 1, -1, 0, 0, "OK"), "duration-us must be")]:
            with pytest.raises(redis.ResponseError, match=error):
                worker.execute_command(*command)
        assert worker.execute_command("SRIO.TAKE", "w", "m", (1 << 63) - 1, 0, (1 << 63) - 1) == []
        assert worker.execute_command("SRIO.TAKE", "w", "m", 1 << 62, 1 << 62, 0) == []
        assert worker.execute_command("SRIO.POP", "w", 0) is None
        assert worker.ping()


def test_a_gathering_take_whose_worker_disconnects_is_unblocked_once(fresh: RedisServer) -> None:
    """Its own timer used to unblock it a second time and cut the list of waiting workers: a pop
    waiting behind it never got a request again."""
    wait_s = 1.5  # the gathering's timer: long enough for its worker to disconnect before it fires
    gatherer, popper = protocol_client(fresh), protocol_client(fresh)
    with protocol_client(fresh) as observer, _client(fresh) as client:
        client.execute_command("AI.MODELSTORE", "m", "TORCH", "CPU", "BLOB", MODEL)
        gathering = gatherer.connection_pool.get_connection()
        gathering.send_command("SRIO.TAKE", "a", "m", 4, 2, round(wait_s * 1000))
        fires_at = time.monotonic() + wait_s
        wait_until(lambda: "a" in registry(observer), 10, "the gatherer waits")
        waiting = popper.connection_pool.get_connection()
        waiting.send_command("SRIO.POP", "b", 60_000)
        wait_until(lambda: "b" in registry(observer), 10, "the pop waits behind it")
        gathering.disconnect()
        wait_until(lambda: "a" not in registry(observer), 10, "the gatherer is gone")
        assert time.monotonic() < fires_at, "the machine is too slow for this test's timing"
        time.sleep(fires_at + 0.25 - time.monotonic())  # the gathering's timer is due by then
        run = threading.Thread(target=_call, args=(client, "AI.MODELEXECUTE", "m", "INPUTS", 1, "x", "OUTPUTS", 1,
                                                   "y", "TIMEOUT", 30_000))
        run.start()
        request = waiting.read_response(timeout=20)
        assert request is not None and request[2] == b"m", request
        waiting.send_command("SRIO.REPLY", "b", request[0], 0, 0, 0, "ERROR", "ERR answered by the test")
        assert waiting.read_response(timeout=20) == b"OK"
        run.join()
        assert client.ping()
    popper.close()
    gatherer.close()


def _call(client: redis.Redis, *command) -> object:
    try:
        return client.execute_command(*command)
    except redis.ResponseError as exc:
        return exc


def test_a_bulk_limit_above_what_one_write_takes_is_refused_at_load() -> None:
    """Values are written in one piece of at most 512 MiB (RedisModule_StringTruncate's limit), so no
    client input makes a write fail; a larger BULK_LIMIT_BYTES is refused when the module loads."""
    with pytest.raises(ServiceStartError, match="invalid value for smartredis_io module argument BULK_LIMIT_BYTES"):
        RedisServer(module_args=("BULK_LIMIT_BYTES", str(600 << 20))).start()


# ---- hash tags: the keys derived from a key live on its slot, in the module and in Python --------

TAGGED_KEYS = ["a}b", "a{}b}", "{}", "{a}{b}", "", "a{b", "{x}y", "plain", "é}", "}{", "{{a}}", "{}}", "{}{a}"]


@pytest.fixture(scope="module")
def chunking_node():
    """A cluster-enabled redis-server (for CLUSTER KEYSLOT) whose module chunks values above 4 KiB."""
    with sanitized() as module, RedisServer(module_args=("BULK_LIMIT_BYTES", "4096"),
                                            extra_args=("--cluster-enabled", "yes"), **module) as server:
        with _client(server) as node:  # a cluster of one node, serving every slot
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            wait_until(lambda: node.cluster("info")["cluster_state"] == "ok", 10, "the node serves every slot")
        yield server


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.one_of(st.sampled_from(TAGGED_KEYS), st.text(alphabet="ab{}", max_size=8)))
def test_chunks_and_blobs_live_on_their_keys_slot_as_both_sides_name_them(chunking_node: RedisServer, key: str) -> None:
    with _client(chunking_node) as node:
        slot = node.execute_command("CLUSTER KEYSLOT", key)
        for suffix in (".chunk.00.0", ".blob.00"):
            assert node.execute_command("CLUSTER KEYSLOT", wire.tagged_key(key, suffix)) == slot, (key, suffix)
        node.flushall()
        node.execute_command("AI.TENSORSET", key, "UINT8", 10_000)  # 3 chunks, named by the module
        header = wire.decode_header(node.getrange(key, 0, wire.HEADER_MAX_BYTES - 1), key)
        expected = {k.encode() for k in header.chunk_keys(key)}
        assert set(node.keys()) == {key.encode(), *expected}, "the module's chunk keys are Python's"
        node.execute_command("AI.SCRIPTSET", key + "s", "CPU", "SOURCE", "def f(x):\n    return x\n")
        manifest = protocol.parse(node.get(key + "s"))
        assert node.exists(protocol.blob_key(key + "s", manifest.version)), "the module's blob key is Python's"
