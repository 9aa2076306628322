"""Hostile clients against the Redis module's sanitizer build, on a real redis-server and a real 3-shard
Redis Cluster: thousands of generated ``AI.*`` commands (argument counts, sizes, types, nested and
forged values, binary keys), values planted where the module reads, and the worker commands with and
without the worker secret. Every command gets a reply, the server stays up and allocates nothing
large, and AddressSanitizer and UndefinedBehaviorSanitizer report nothing."""

from __future__ import annotations

import json

import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from redis.cluster import RedisCluster as PlainCluster

from smartredis_io import RedisCluster, RedisServer
from smartredis_io._client import wire
from tests.support.srio_sanitizers import sanitized
from tests.support.srio_workers import protocol_client

AI_COMMANDS_PER_RUN = 2000
EXAMPLES = 160  # client sessions of COMMANDS_PER_EXAMPLE commands (and a quarter as many worker sessions)
COMMANDS_PER_EXAMPLE = (12, 30)
MAX_TENSOR_BYTES = 1 << 20
PEAK_MEMORY_BYTES = 96 << 20  # redis-server's own footprint plus a few tensors of MAX_TENSOR_BYTES
MODULE_ARGS = ("MAX_TENSOR_BYTES", str(MAX_TENSOR_BYTES), "BULK_LIMIT_BYTES", "4096")

HUGE = [-1, 0, 1, 2, 3, 7, 32, 33, 255, 256, 65536, 2**31 - 1, 2**31, 2**32, 2**61 + 1, 2**62, 2**63 - 1, -(2**63),
        10**20, 100000]
KEYWORDS = ["BLOB", "VALUES", "META", "TAG", "BATCHSIZE", "MINBATCHSIZE", "MINBATCHTIMEOUT", "INPUTS", "OUTPUTS",
            "KEYS", "ARGS", "TIMEOUT", "$", "SOURCE", "ENTRY_POINTS", "RESETSTAT", "LOADBACKEND", "GET",
            "BACKENDSPATH", "MODEL_CHUNK_SIZE", "TORCH", "TF", "ONNX", "CPU", "GPU", "GPU:1", "cpu:999999999999",
            "FLOAT", "DOUBLE", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "BOOL", "FLOAT16",
            "BFLOAT16", "STRING"]
DTYPES = ["FLOAT", "DOUBLE", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "BOOL", "FLOAT16", "BFLOAT16",
          "STRING", "float", "x"]


def _deep_manifest(depth: int) -> bytes:
    return b'{"kind": "model", "version": "v", "x": ' + b"[" * depth + b"]" * depth + b"}"


# Values a writer of any key can plant where the module reads: forged tensor headers, manifests
# that nest, lie or name other keys, and model archives' magic.
PLANTED = [
    wire.encode_header(1, (1 << 40,)) + b"\0" * 8,
    wire.encode_header(2, (1 << 20,), chunks=1 << 20, crc=0, payload=4 << 20, version="0" * 32),
    wire.encode_header(7, (3,), chunks=2, crc=0, payload=3, version="ab" * 16),
    wire.encode_header(1, (0, 1 << 62, 1 << 62)),
    b"SRT1" + bytes([0, 11, 33, 0]),
    b"SRT1\x01\x01\x01\x00" + b"\xff" * 8,
    _deep_manifest(500_000),  # 1 MB: as deep as a value the parser reads can be
    _deep_manifest(40),
    b'{"kind": "model", "version": "v", "batch_size": 99999999999999999999999999, "inputs": ["a", 1]}',
    b'{"kind": "script", "version": "v", "blob": "{t}x", "tag": "\\ud800\\u0000"}',
    json.dumps({"kind": "model", "version": "v" * 1000, "batch_size": 2, "blob": "t"}).encode(),
    b'{"kind": "model", "version": "v", "x": "' + b"\\" * 99 + b'"}',
    b"PK\x03\x04" + b"\0" * 40,
]

# A few names most of the time, so that commands meet the values others planted
keys = st.one_of(*[st.sampled_from([b"t", b"m", b"s", b"a}b"])] * 6,
                 st.sampled_from([b"a{}b}", b"{}", b"{a}{b}", b"", b"\x00\xff", b"{t}x", b"k\r\nv", b"%s%n", b"{" * 40]),
                 st.binary(max_size=12))
integers = st.one_of(st.sampled_from(HUGE), st.integers(-3, 40))
numbers = st.one_of(integers.map(lambda i: str(i).encode()),
                    st.sampled_from([b"1.5", b"-0", b"1e308", b"inf", b"nan", b"0x10", b" 1", b"", b"9" * 40]))
blobs = st.one_of(st.binary(max_size=48), st.sampled_from(PLANTED[:6] + [PLANTED[-1]]))
sources = st.one_of(st.sampled_from([b"def f(x):\n    return x\n", b"def \xff(x):", b"def", b"\ndef  g ( a ):"]),
                    st.binary(max_size=32))
words = st.one_of(st.sampled_from(KEYWORDS).map(str.encode), numbers, keys, blobs)


def _counted(word: bytes, names: st.SearchStrategy) -> st.SearchStrategy:
    """``WORD n name...`` with n right, off by one, or absurd."""
    return st.tuples(st.lists(names, max_size=4), integers).map(
        lambda t: [word, str(len(t[0]) if t[1] == 0 else t[1]).encode(), *t[0]])


def _tensorset() -> st.SearchStrategy:
    tail = st.one_of(st.just([]), blobs.map(lambda b: [b"BLOB", b]), st.lists(numbers, max_size=6).map(
        lambda v: [b"VALUES", *v]), st.lists(words, max_size=3))
    return st.tuples(keys, st.sampled_from(DTYPES).map(str.encode), st.lists(numbers, max_size=6), tail).map(
        lambda t: [b"AI.TENSORSET", t[0], t[1], *t[2], *t[3]])


def _modelstore() -> st.SearchStrategy:
    options = st.lists(st.one_of(st.tuples(st.sampled_from([b"TAG", b"BATCHSIZE", b"MINBATCHSIZE",
                                                             b"MINBATCHTIMEOUT"]), numbers).map(list),
                                 _counted(b"INPUTS", keys), _counted(b"OUTPUTS", keys)), max_size=3)
    model = st.lists(st.one_of(blobs, st.just(b"PK\x03\x04")), max_size=3)
    return st.tuples(st.sampled_from([b"AI.MODELSTORE", b"AI.MODELSET"]), keys,
                     st.sampled_from([b"TORCH", b"TF", b"torch", b"X"]), st.sampled_from([b"CPU", b"GPU:0", b"tpu"]),
                     options, st.booleans(), model).map(
        lambda t: [t[0], t[1], t[2], t[3], *(w for o in t[4] for w in o), *([b"BLOB"] if t[5] else []), *t[6]])


def _scriptstore() -> st.SearchStrategy:
    return st.tuples(st.sampled_from([b"AI.SCRIPTSTORE", b"AI.SCRIPTSET"]), keys, st.sampled_from([b"CPU", b"x"]),
                     st.lists(st.one_of(_counted(b"ENTRY_POINTS", keys), st.just([b"TAG", b"t"])), max_size=2),
                     st.one_of(sources.map(lambda s: [b"SOURCE", s]), st.lists(words, max_size=2))).map(
        lambda t: [t[0], t[1], t[2], *(w for o in t[3] for w in o), *t[4]])


def _execute() -> st.SearchStrategy:
    sections = st.lists(st.one_of(_counted(b"INPUTS", keys), _counted(b"OUTPUTS", keys), _counted(b"KEYS", keys),
                                  _counted(b"ARGS", words), numbers.map(lambda n: [b"TIMEOUT", n]),
                                  st.lists(st.one_of(keys, st.just(b"$")), max_size=4)), max_size=4)
    return st.tuples(st.sampled_from([b"AI.MODELEXECUTE", b"AI.SCRIPTEXECUTE", b"AI.SCRIPTRUN"]), keys,
                     st.one_of(keys, st.just(b"f")), sections).map(
        lambda t: [t[0], t[1], *([] if t[0] == b"AI.MODELEXECUTE" else [t[2]]), *(w for s in t[3] for w in s)])


def _reads() -> st.SearchStrategy:
    return st.tuples(st.sampled_from([b"AI.TENSORGET", b"AI.MODELGET", b"AI.SCRIPTGET", b"AI.MODELDEL",
                                      b"AI.SCRIPTDEL", b"AI.INFO"]), keys,
                     st.lists(st.one_of(st.sampled_from([b"META", b"BLOB", b"VALUES", b"SOURCE", b"RESETSTAT"]),
                                        words), max_size=3)).map(lambda t: [t[0], t[1], *t[2]])


def _config() -> st.SearchStrategy:
    return st.lists(st.one_of(st.sampled_from([b"LOADBACKEND", b"BACKENDSPATH", b"MODEL_CHUNK_SIZE", b"GET", b"TORCH",
                                               b"ONNX"]), numbers, blobs), max_size=4).map(
        lambda args: [b"AI.CONFIG", *args])


ai_commands = st.one_of(_tensorset(), _modelstore(), _scriptstore(), _execute(), _reads(), _config(),
                        st.tuples(st.sampled_from([b"AI.TENSORSET", b"AI.TENSORGET", b"AI.MODELSTORE",
                                                   b"AI.SCRIPTSTORE", b"AI.MODELEXECUTE", b"AI.SCRIPTRUN",
                                                   b"AI.SCRIPTEXECUTE", b"AI.INFO", b"AI.CONFIG", b"AI.MODELGET"]),
                                  st.lists(words, max_size=10)).map(lambda t: [t[0], *t[1]]))
# Every command that reads a key's value, each with a well-formed rest
READERS = [[b"AI.INFO"], [b"AI.INFO", b"RESETSTAT"], [b"AI.MODELGET", b"META"], [b"AI.MODELGET", b"BLOB"],
           [b"AI.SCRIPTGET"], [b"AI.SCRIPTGET", b"SOURCE"], [b"AI.TENSORGET", b"BLOB"], [b"AI.TENSORGET", b"VALUES"],
           [b"AI.TENSORGET", b"META"], [b"AI.MODELDEL"], [b"AI.SCRIPTDEL"],
           [b"AI.MODELEXECUTE", b"INPUTS", b"1", b"t", b"OUTPUTS", b"1", b"o"],
           [b"AI.SCRIPTEXECUTE", b"f", b"INPUTS", b"1", b"t", b"OUTPUTS", b"1", b"o"],
           [b"AI.MODELSTORE", b"TORCH", b"CPU", b"BLOB", b"PK\x03\x04"], [b"AI.SCRIPTSET", b"CPU", b"SOURCE", b"def f(x):\n"],
           [b"AI.TENSORSET", b"FLOAT", b"1"]]
# A value planted at a key, then read by one of the commands that read it
planted = st.tuples(keys, st.sampled_from(PLANTED), st.sampled_from(READERS)).map(
    lambda t: [[b"SET", t[0], t[1]], [t[2][0], t[0], *t[2][1:]]])
guarded = st.tuples(st.sampled_from([b"SRIO.HELLO", b"SRIO.POP", b"SRIO.TAKE", b"SRIO.REPLY", b"SRIO.RETURN",
                                     b"SRIO.PAUSE", b"SRIO.HEARTBEAT", b"SRIO.UNREGISTER", b"SRIO.WORKERS"]),
                    st.lists(words, max_size=8)).map(lambda t: [t[0], *t[1]])
client_session = st.lists(st.one_of(*[ai_commands.map(lambda c: [c])] * 4, planted, planted, guarded.map(lambda c: [c])),
                          min_size=COMMANDS_PER_EXAMPLE[0], max_size=COMMANDS_PER_EXAMPLE[1]).map(
    lambda steps: [command for step in steps for command in step])
# The worker commands on a worker's connection: waits of a few milliseconds, or malformed ones (a
# huge one is bounded to a day, and would be waited for: test_bounded_input covers those)
waits = st.sampled_from([b"0", b"1", b"3", b"-1", b"-9223372036854775808", b"x", b""])
worker_commands = st.one_of(
    st.tuples(keys, waits).map(lambda t: [b"SRIO.POP", t[0], t[1]]),
    st.tuples(keys, keys, numbers, numbers, waits).map(lambda t: [b"SRIO.TAKE", *t]),
    st.tuples(keys, numbers, numbers, numbers, numbers, st.sampled_from([b"OK", b"ERROR", b"ok"]),
              st.lists(words, max_size=4)).map(lambda t: [b"SRIO.REPLY", *t[:6], *t[6]]),
    st.tuples(st.sampled_from([b"SRIO.RETURN", b"SRIO.HEARTBEAT"]), keys, numbers).map(list),
    st.tuples(st.sampled_from([b"SRIO.PAUSE", b"SRIO.UNREGISTER"]), keys).map(list),
    st.lists(words, max_size=6).map(lambda args: [b"SRIO.WORKERS", *args]),
)
worker_session = st.lists(worker_commands, min_size=5, max_size=15)


class Target:
    """Where each command goes: the server, or in a cluster the node that serves its key; as a client
    (no worker secret) or on a worker's connection (``SRIO.HELLO`` said)."""

    def __init__(self, database: RedisServer | RedisCluster) -> None:
        self.ports = database.ports if isinstance(database, RedisCluster) else [database.port]
        self.clients = {port: redis.Redis(host="127.0.0.1", port=port, socket_timeout=30) for port in self.ports}
        self.workers = {port: protocol_client(database, port) for port in self.ports}
        self.cluster = PlainCluster(host="127.0.0.1", port=self.ports[0]) if len(self.ports) > 1 else None
        self.sent = 0

    def port_of(self, command: list[bytes]) -> int:
        if self.cluster and len(command) > 1:
            return self.cluster.get_node_from_key(command[1]).port
        return self.ports[0]

    def send(self, command: list[bytes], as_worker: bool = False) -> None:
        client = (self.workers if as_worker else self.clients)[self.port_of(command)]
        try:
            reply: object = client.execute_command(*command)
        except redis.exceptions.ResponseError as exc:
            reply = exc
        self.sent += command[0].startswith(b"AI.")
        if command[0].startswith(b"SRIO.") and not as_worker:
            refused = isinstance(reply, redis.exceptions.NoPermissionError)
            assert refused or (command[0] == b"SRIO.HELLO" and "wrong number" in str(reply)), (command, reply)

    def alive(self) -> None:
        for port, client in self.clients.items():
            assert client.ping(), f"the server at port {port} stopped answering"

    def close(self) -> None:
        for client in (*self.clients.values(), *self.workers.values()):
            client.close()
        if self.cluster:
            self.cluster.close()


def _hammer(target: Target) -> None:
    """Client sessions first (no worker is registered: every run fails at once), then worker sessions."""
    # no shrinking: after a crash every later example fails the same way
    common = {"deadline": None, "database": None, "phases": (Phase.explicit, Phase.generate),
              "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]}

    @settings(max_examples=EXAMPLES, **common)
    @given(session=client_session)
    def as_clients(session: list[list[bytes]]) -> None:
        for client in target.clients.values():
            client.flushall()  # what a session stores stays within a few tensors
        for command in session:
            target.send(command)
        target.alive()

    @settings(max_examples=EXAMPLES // 4, **common)
    @given(session=worker_session)
    def as_workers(session: list[list[bytes]]) -> None:
        for command in session:
            target.send(command, as_worker=True)
        target.alive()

    as_clients()
    as_workers()


def _peak_memory(ports: list[int]) -> int:
    peaks = []
    for port in ports:
        with redis.Redis(host="127.0.0.1", port=port) as client:
            peaks.append(client.info("memory")["used_memory_peak"])
    return max(peaks)


def _check(database: RedisServer | RedisCluster) -> None:
    target = Target(database)
    try:
        _hammer(target)
        assert target.sent >= AI_COMMANDS_PER_RUN, f"only {target.sent} AI.* commands were sent"
        assert _peak_memory(target.ports) < PEAK_MEMORY_BYTES, "a command made the server allocate more than it stores"
    finally:
        target.close()


@pytest.mark.slow
def test_hostile_commands_on_a_server() -> None:
    with sanitized(max_allocation_mb=8) as module, RedisServer(module_args=MODULE_ARGS, **module) as server:
        _check(server)


@pytest.mark.slow
def test_hostile_commands_on_a_cluster() -> None:
    with sanitized(max_allocation_mb=8) as module, RedisCluster(3, module_args=MODULE_ARGS, **module) as cluster:
        _check(cluster)
