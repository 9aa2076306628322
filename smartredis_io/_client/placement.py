"""Where SmartRedis clients keep models and scripts in a Redis Cluster, and the calls that put them there.

SmartRedis 0.6.1 stores a model or script on *every* shard of a cluster, at ``{<prefix>}.<name>``,
where ``<prefix>`` is a short binary string whose hash slot is the lowest slot of that shard's range
(the inverse CRC16 of ``RedisCluster::_get_crc16_prefix``); it reads it from the shard that serves
slot 0 and runs it on any shard. With the smartredis_io Redis module loaded, ``smartredis_io`` does
the same through RedisAI's commands, so that models and scripts stored by either kind of client are
the same objects. Without the module a cluster keeps them at ``<name>`` (``smartredis_io._client.protocol``).
On a standalone server both kinds of client use ``<name>``.
"""

from __future__ import annotations

import redis

from smartredis_io._client import protocol
from smartredis_io._client.connection import Database
from smartredis_io.error import RedisKeyError

__all__ = ["delete", "exists", "first_shard_key", "get_blob", "key_on_shard", "module_loaded", "shard_keys",
           "shard_prefix", "shard_ranges", "store"]

_POLY = 0x11021  # x^16 + x^12 + x^5 + 1, CRC16-CCITT as Redis Cluster hashes keys
_MAX_BULK = 511 * 1024 * 1024  # a model larger than this goes in several BLOB arguments (RedisAI's chunk size)


def _xor_shift(remainder: int, initial_shift: int, n_bits: int) -> int:
    digit, poly = 1 << initial_shift, _POLY << initial_shift
    for _ in range(n_bits):
        if remainder & digit:
            remainder ^= poly
        digit <<= 1
        poly <<= 1
    return remainder


def _valid(bits: int, n_chars: int) -> bool:
    bits >>= 16
    for _ in range(n_chars):
        if bits & 0xFF in (ord("{"), ord("}")):
            return False
        bits >>= 8
    return True


def shard_prefix(slot: int) -> bytes:
    """SmartRedis' prefix of the shard whose range starts at ``slot``: bytes hashing to that slot."""
    if not 0 <= slot < 16384:
        raise ValueError(f"hash slot {slot} is outside 0..16383")
    shifts, n_chars = 16, 2
    bits = _xor_shift(slot, 0, shifts)
    while not _valid(bits, n_chars):
        bits = _xor_shift(bits, shifts, 1)
        shifts += 1
        n_chars = (shifts + 7) // 8
    return ((bits >> 16) & ((1 << 8 * n_chars) - 1)).to_bytes(n_chars, "big")


def _key(prefix: bytes, name: str) -> bytes:
    return b"{" + prefix + b"}." + name.encode()


def shard_keys(db: Database, name: str) -> list[bytes]:
    """The key of ``name`` on each shard (one per slot range of ``CLUSTER SLOTS``, as SmartRedis)."""
    (ranges,) = db.exchange([("CLUSTER", "SLOTS")])
    return [_key(shard_prefix(int(entry[0])), name) for entry in sorted(ranges, key=lambda entry: int(entry[0]))]


def shard_ranges(db: Database) -> list[tuple[int, int, bytes]]:
    """``(first slot, last slot, prefix)`` of every shard's slot range (``CLUSTER SLOTS``)."""
    (ranges,) = db.exchange([("CLUSTER", "SLOTS")])
    return sorted((int(entry[0]), int(entry[1]), shard_prefix(int(entry[0]))) for entry in ranges)


def key_on_shard(ranges: list[tuple[int, int, bytes]], slot: int, name: str) -> bytes:
    """The key of ``name`` on the shard that serves ``slot`` (``ranges`` from :func:`shard_ranges`)."""
    for first, last, prefix in ranges:
        if first <= slot <= last:
            return _key(prefix, name)
    raise KeyError(f"no shard serves hash slot {slot}")


def first_shard_key(name: str) -> bytes:
    """The key SmartRedis reads ``name`` from: on the shard serving slot 0."""
    return _key(shard_prefix(0), name)


def module_loaded(db: Database) -> bool:
    """Whether the database's servers load the smartredis_io Redis module (RedisAI's commands)."""
    try:
        db.exchange([("AI.CONFIG", "GET", "MODEL_CHUNK_SIZE")])
    except redis.exceptions.NoPermissionError:
        return True  # the command exists; this user may not run it
    except redis.exceptions.ResponseError as exc:
        if "unknown command" in str(exc).lower():
            return False
        raise
    return True


def _chunks(blob: bytes, chunk_bytes: int | None) -> list[memoryview]:
    size = min(chunk_bytes or _MAX_BULK, _MAX_BULK)
    view = memoryview(blob)
    return [view[i:i + size] for i in range(0, len(blob), size)] or [view]


def _store_command(key: bytes, blob: bytes, manifest: protocol.Manifest, chunk_bytes: int | None) -> list:
    if manifest.kind == "script":
        return ["AI.SCRIPTSET", key, manifest.device, *(["TAG", manifest.tag] if manifest.tag else []), "SOURCE", blob]
    command: list = ["AI.MODELSTORE", key, manifest.backend, manifest.device]
    if manifest.tag:
        command += ["TAG", manifest.tag]
    if manifest.batch_size:
        command += ["BATCHSIZE", manifest.batch_size]
        if manifest.min_batch_size:
            command += ["MINBATCHSIZE", manifest.min_batch_size]
            if manifest.min_batch_timeout:
                command += ["MINBATCHTIMEOUT", manifest.min_batch_timeout]
    return [*command, "BLOB", *_chunks(blob, chunk_bytes)]


def store(db: Database, name: str, blob: bytes, manifest: protocol.Manifest, chunk_bytes: int | None = None) -> None:
    """Store a model or script on every shard, as SmartRedis does (AI.MODELSTORE / AI.SCRIPTSET)."""
    for key in shard_keys(db, name):
        db.redis.execute_command(*_store_command(key, blob, manifest, chunk_bytes))


def get_blob(db: Database, name: str, kind: str) -> bytes:
    """The bytes of the model or script ``name``, from the shard SmartRedis reads it from."""
    key = first_shard_key(name)
    command = ("AI.MODELGET", key, "BLOB") if kind == "model" else ("AI.SCRIPTGET", key, "SOURCE")
    try:
        reply = db.redis.execute_command(*command)
    except redis.exceptions.ResponseError as exc:
        if "key is empty" in str(exc) or "WRONGTYPE" in str(exc):
            raise RedisKeyError(f"No {kind} stored at key {name!r}") from None
        raise
    return b"".join(reply) if isinstance(reply, list) else reply


def exists(db: Database, name: str) -> bool:
    """Whether a model or script ``name`` is stored (SmartRedis' check: the key on the first shard)."""
    return bool(db.redis.exists(first_shard_key(name)))


def delete(db: Database, name: str, kind: str) -> None:
    """Delete the model or script ``name`` from every shard; ``RedisKeyError`` when there is none."""
    command = "AI.MODELDEL" if kind == "model" else "AI.SCRIPTDEL"
    found = False
    for key in shard_keys(db, name):
        try:
            db.redis.execute_command(command, key)
            found = True
        except redis.exceptions.ResponseError as exc:
            if "key is empty" not in str(exc) and "WRONGTYPE" not in str(exc):
                raise
    if not found:
        raise RedisKeyError(f"No {kind} stored at key {name!r}")
