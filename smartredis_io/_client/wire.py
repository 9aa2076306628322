"""Wire format of tensors on Redis: a small header (dtype, shape) followed by the raw bytes.

A value larger than the bulk limit (Redis' ``proto-max-bulk-len``, 512 MB) is split: its chunks go to
keys that share the tensor key's cluster hash tag (so they live on the tensor's shard), carry a
version, and are checked with a CRC-32; the header, written last, publishes them. A reader that
races an overwrite finds a chunk gone or a checksum off and reads again.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.crc import key_slot

from smartredis_io._client.connection import Command, Database
from smartredis_io.error import RedisInternalError, RedisKeyError, RedisReplyError, RedisRuntimeError

MiB = 1 << 20
BULK_LIMIT_BYTES = 512 * MiB
BULK_LIMIT_ENV = "SRIO_BULK_LIMIT_BYTES"
MAX_NDIM = 32
MAGIC = b"SRT1"
INLINE, CHUNKED = 0, 1
_FIXED = struct.Struct("<4sBBBB")  # magic, layout, dtype code, ndim, reserved
_CHUNKS = struct.Struct("<IIQ16s")  # chunk count, CRC-32 of the payload, payload bytes, version
HEADER_MAX_BYTES = _FIXED.size + 8 * MAX_NDIM + _CHUNKS.size
READ_RETRIES = 3
LEASE_MARGIN_S = 60.0  # how much longer than its operation's deadline an unpublished part lives
MAX_CHUNKS = 1 << 20
PROBE_FIRST = 16  # chunk keys a read looks at in its first round trip; each further one looks at 4x more
MAX_ARRAY_BYTES = 1 << 63  # numpy's limit on an array's extent, zero-length dimensions aside  # more chunks than any real value has (512 TB at the bulk limit)

#: numpy has no bfloat16: such tensors travel as their raw 16-bit pattern with this dtype, which is
#: ``uint16`` tagged with metadata so that the bfloat16 type is kept through put/get.
bfloat16 = np.dtype(np.uint16, metadata={"smartredis_io.dtype": "bfloat16"})

_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f8"), 2: np.dtype("<f4"), 3: np.dtype("i1"), 4: np.dtype("<i2"), 5: np.dtype("<i4"),
    6: np.dtype("<i8"), 7: np.dtype("u1"), 8: np.dtype("<u2"), 9: np.dtype("<f2"), 10: np.dtype("?"),
    11: bfloat16,
}
_BF16_CODE = 11
_CODES = {dt: code for code, dt in _DTYPES.items() if code != _BF16_CODE}
SUPPORTED_DTYPES = tuple(dt.name for dt in _CODES) + ("bfloat16",)


def bulk_limit() -> int:
    """The largest value written as one Redis string; ``$SRIO_BULK_LIMIT_BYTES`` lowers it (tests)."""
    return int(os.environ.get(BULK_LIMIT_ENV, BULK_LIMIT_BYTES))


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a bfloat16 (ours, or a foreign one such as ml_dtypes')."""
    # type.__name__ is what dtype.name gives for a foreign (ml_dtypes) bfloat16, at ~1/30 of the cost
    return dtype.type.__name__ == "bfloat16" or bool(dtype.metadata and dtype.metadata.get("smartredis_io.dtype") == "bfloat16")


def dtype_code(dtype: np.dtype) -> int:
    """The wire code of ``dtype``; ``TypeError`` (as SmartRedis) for an unsupported one."""
    if is_bfloat16(dtype):
        return _BF16_CODE
    code = _CODES.get(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
    if code is None:
        raise TypeError(f"Unsupported numpy dtype {dtype}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return code


def _hash_tag(key: str) -> str | None:
    """Redis Cluster's hash tag of ``key``: the text between the first ``{`` and the first ``}`` after
    it, when not empty; None when the whole key is hashed."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else None


@functools.lru_cache(maxsize=1024)
def _slot_tag(slot: int) -> str:
    """``srio<n>`` for the smallest n whose cluster slot is ``slot``."""
    return next(f"srio{n}" for n in itertools.count() if key_slot(f"srio{n}".encode()) == slot)


def tagged_key(key: str, suffix: str) -> str:
    """A key on the same cluster slot as ``key``, followed by ``suffix``: the key itself when it has a
    hash tag, ``{key}`` when it has no ``}``, else ``{srio<n>}key`` with a tag of the key's slot (the
    Redis module derives the same names)."""
    if _hash_tag(key) is not None:
        return f"{key}{suffix}"
    if key and "}" not in key:
        return f"{{{key}}}{suffix}"
    return f"{{{_slot_tag(key_slot(key.encode('utf-8', 'surrogateescape')))}}}{key}{suffix}"


@dataclass(frozen=True)
class Header:
    """What a tensor value's header says."""

    code: int
    shape: tuple[int, ...]
    size: int  # header bytes
    chunks: int = 0
    crc: int = 0
    payload_bytes: int = 0
    version: str = ""

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the elements."""
        return _DTYPES[self.code]

    @property
    def nbytes(self) -> int:
        """Bytes of data the shape and dtype call for."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def written_at(self) -> float | None:
        """When a chunked value was written (seconds since the epoch); None for an inline value."""
        return int(self.version[:16], 16) / 1e9 if self.chunks else None

    def chunk_keys(self, key: str, indices: range | None = None) -> list[str]:
        """The keys of the chunks of the value at ``key``, in order (``indices``: of those only)."""
        return [tagged_key(key, f".chunk.{self.version}.{i}") for i in (indices or range(self.chunks))]

    def probes(self) -> Iterator[range]:
        """The chunk indices in batches that grow fourfold: a header that claims more chunks than
        exist is found out after as many round trips as the stored chunks take, not the claimed."""
        start, size = 0, PROBE_FIRST
        while start < self.chunks:
            end = min(start + size, self.chunks)
            yield range(start, end)
            start, size = end, size * 4


def encode_header(code: int, shape: Sequence[int], chunks: int = 0, crc: int = 0, payload: int = 0,
                  version: str = "") -> bytes:
    """The header of a value: magic, layout, dtype code, shape, and for a chunked value its chunk count, CRC-32, size and version."""
    if len(shape) > MAX_NDIM:
        raise RedisRuntimeError(f"Tensors of more than {MAX_NDIM} dimensions are not supported")
    head = _FIXED.pack(MAGIC, CHUNKED if chunks else INLINE, code, len(shape), 0) + struct.pack(f"<{len(shape)}Q", *shape)
    if chunks:
        head += _CHUNKS.pack(chunks, crc, payload, bytes.fromhex(version))
    return head


def decode_header(buf: bytes | memoryview, key: str) -> Header:
    """Parse a header; ``RedisRuntimeError`` when ``key`` does not hold a tensor."""
    if len(buf) < _FIXED.size:
        raise RedisRuntimeError(f"The value at key {key!r} is not a tensor")
    magic, layout, code, ndim, _ = _FIXED.unpack_from(buf)
    if magic != MAGIC or code not in _DTYPES or ndim > MAX_NDIM:
        raise RedisRuntimeError(f"The value at key {key!r} is not a tensor")
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED.size)
    if math.prod(d for d in shape if d) * _DTYPES[code].itemsize >= MAX_ARRAY_BYTES:
        raise RedisInternalError(f"The value at key {key!r} is corrupt: no array has the shape {shape}")
    size = _FIXED.size + 8 * ndim
    if layout == INLINE:
        return Header(code, shape, size)
    chunks, crc, payload, version = _CHUNKS.unpack_from(buf, size)
    return Header(code, shape, size + _CHUNKS.size, chunks, crc, payload, version.hex())


def _as_bytes(array: np.ndarray) -> memoryview:
    """A byte view of ``array``'s data (made contiguous and little-endian first if it is not)."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))  # copy: the wire is little-endian
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # copy: the wire holds C-order bytes
    return memoryview(array.reshape(-1).view(np.uint8))


def _crc(views: Sequence[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc


def delete_replaced_chunks(db: Database, key: str, old: bytes) -> None:
    """Remove the chunks a replaced value referenced (none for an inline value or a non-tensor)."""
    try:
        header = decode_header(old, key)
    except RedisRuntimeError:
        return
    if header.chunks:
        _delete_chunks(db, key, header)


def _delete_chunks(db: Database, key: str, header: Header) -> None:
    """Delete the chunks a header names, up to the first one that does not exist (one slot: the
    chunks share the key's hash tag)."""
    for batch in header.probes():
        names = header.chunk_keys(key, batch)
        if db.redis.delete(*names) < len(names):
            return


def stored_chunk_keys(read: Callable[[Sequence[Command]], list[Any]], key: str, old: Any) -> list[str]:
    """The chunk keys the header ``old`` (read from ``key``) names, up to the batch that finds one
    missing (one EXISTS per batch through ``read``); none for an inline value or a non-tensor."""
    if not isinstance(old, bytes):
        return []
    try:
        header = decode_header(old, key)
    except RedisReplyError:
        return []
    names: list[str] = []
    for batch in header.probes():
        batch_names = header.chunk_keys(key, batch)
        names += batch_names
        (present,) = read([("EXISTS", *batch_names)])
        if present < len(batch_names):
            break
    return names


def encode_inline(array: np.ndarray) -> bytes | None:
    """Header and data as one bytes value (for pipelines), or None when it needs chunks."""
    payload = _as_bytes(array)
    if payload.nbytes + HEADER_MAX_BYTES > bulk_limit():
        return None
    return encode_header(dtype_code(array.dtype), array.shape) + payload  # one copy: a pipeline takes bytes


def decode_value(db: Database, key: str, raw: bytes) -> np.ndarray:
    """The array in a value fetched with GET (a view of ``raw`` when inline; chunks are read here)."""
    header = decode_header(raw, key)
    if header.chunks:
        return get_array(db, key)
    if header.size + header.nbytes != len(raw):
        raise RedisInternalError(f"The value at key {key!r} is truncated")
    return np.frombuffer(raw, dtype=header.dtype, offset=header.size).reshape(header.shape)


def lease_ms(db: Database) -> int:
    """How long a part written now lives unless its publisher makes it permanent (milliseconds).

    Parts are written with this expiry and made permanent (PERSIST) when the value they belong to is
    published; a writer that dies before that leaves parts that Redis removes by itself.
    """
    return int((db.time_left() + LEASE_MARGIN_S) * 1000)


def persist(db: Database, keys: Sequence[str]) -> list[Any]:
    """Make leased parts permanent (one round trip per node); the replies (0 for a key that is gone
    or already permanent)."""
    if keys:
        return db.exchange([("PERSIST", key) for key in keys])
    return []


def put_array(db: Database, key: str, array: np.ndarray, lease: int | None = None, *,
              chunk_bytes: int | None = None) -> None:
    """Store ``array`` at ``key``: inline up to the bulk limit (or ``chunk_bytes``), else as checksummed chunks.

    With ``lease`` (ms) the value itself expires unless the caller persists it (it is a part of a
    larger value, e.g. a dataset's tensor); its chunks are persisted here either way.
    """
    code = dtype_code(array.dtype)
    payload = _as_bytes(array)
    limit = bulk_limit() if chunk_bytes is None else min(chunk_bytes, bulk_limit())
    if payload.nbytes + HEADER_MAX_BYTES <= limit:
        old = db.set_parts(key, [encode_header(code, array.shape), payload], HEADER_MAX_BYTES, lease)
        if old:
            delete_replaced_chunks(db, key, old)
        return
    writer = ChunkedWriter(db, key, limit, code, array.shape, header_lease=lease)
    with writer:
        for i in range(0, payload.nbytes, limit):
            writer.put_chunk(payload[i:i + limit])


def stage_value(db: Database, key: str, array: np.ndarray) -> tuple[bytes, memoryview, list[str]]:
    """What a caller writes to ``key`` itself (e.g. in a transaction) to store ``array`` there: the
    header and the payload (a view, not a copy) of an inline value; for a value above the bulk limit,
    its chunks are written here with a lease (``lease_ms``), and the header alone is returned with their
    keys, which the caller makes permanent (PERSIST) when it publishes the header."""
    code = dtype_code(array.dtype)
    payload = _as_bytes(array)
    limit = bulk_limit()
    if payload.nbytes + HEADER_MAX_BYTES <= limit:
        return encode_header(code, array.shape), payload, []
    writer = ChunkedWriter(db, key, limit, code, array.shape)
    try:
        for i in range(0, payload.nbytes, limit):
            writer.put_chunk(payload[i:i + limit])
    except BaseException:
        writer._abort()
        raise
    header = encode_header(code, array.shape, len(writer._written), writer._crc, writer._nbytes, writer._version)
    return header, memoryview(b""), list(writer._written)


class ChunkedWriter:
    """Writes a value as versioned chunks, then publishes it with its header (the manifest) last.

    Used as a context manager: a clean exit publishes and removes the chunks of the value it
    replaces; an exception removes the chunks written so far and leaves the previous value as it was.
    Chunks are written with an expiry (``lease_ms``), made permanent in the MULTI/EXEC that writes
    the header and leases the replaced value's chunks: whenever a writer is killed, what it leaves
    disappears by itself.
    ``write`` (file-like, e.g. for ``torch.save``) gathers small writes in one preallocated chunk buffer.
    With ``owner`` (a name for the writing process), that name is stored beside the chunks, with
    their expiry, at :func:`owner_key`, until the value is published or abandoned: a process that
    knows the owner gone may remove the chunks sooner (:func:`read_owner_key`, :func:`delete_unpublished`).
    """

    def __init__(self, db: Database, key: str, chunk_bytes: int, code: int = 7, shape: Sequence[int] | None = None,
                 header_lease: int | None = None, owner: str | None = None):
        self._db, self._key, self._chunk_bytes = db, key, chunk_bytes
        self._code, self._shape = code, shape
        self._header_lease = header_lease
        self._owner = owner
        self._version = new_version()
        self._written: list[str] = []
        self._crc = 0
        self._nbytes = 0
        self._buffer: bytearray | None = None
        self._filled = 0
        self.error: BaseException | None = None

    def put_chunk(self, part: memoryview) -> None:
        """Store one chunk (at most ``chunk_bytes``) as it is, without copying it."""
        chunk_key = tagged_key(self._key, f".chunk.{self._version}.{len(self._written)}")
        if self._owner is not None and not self._written:
            record = f"{self._owner}\n{self._key}".encode("utf-8", "surrogateescape")
            self._db.redis.set(owner_key(self._key, self._version), record, px=lease_ms(self._db))
        self._db.set_parts(chunk_key, [part], 1, lease_ms(self._db))  # expires if this writer dies
        self._written.append(chunk_key)
        self._crc = zlib.crc32(part, self._crc)
        self._nbytes += part.nbytes

    def write(self, data: bytes | memoryview) -> int:
        """File-like write (for ``torch.save``): buffered into chunks; a database error is also kept in ``error``."""
        try:
            return self._write(data)
        except BaseException as exc:
            self.error = exc  # kept: a caller like torch.save may mask it with an error of its own
            raise

    def _write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self._buffer is None:
            self._buffer = bytearray(self._chunk_bytes)
        total = view.nbytes
        while view.nbytes:
            n = min(view.nbytes, self._chunk_bytes - self._filled)
            self._buffer[self._filled:self._filled + n] = view[:n]  # copy: torch.save's buffers are transient
            self._filled += n
            view = view[n:]
            if self._filled == self._chunk_bytes:
                self._flush()
        return total

    def flush(self) -> None:
        """Nothing to do: chunks go out when full and at the end."""

    def _flush(self) -> None:
        if self._filled:
            self.put_chunk(memoryview(self._buffer)[:self._filled])
            self._filled = 0

    def __enter__(self) -> ChunkedWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self._publish()
                return
            except BaseException:
                self._abort()
                raise
        self._abort()

    def _publish(self) -> None:
        """Make the chunks permanent, write the header, drop the owner record and lease the replaced
        value's chunks, all in one MULTI/EXEC: a writer killed at any moment leaves nothing that
        does not expire. The replaced chunks are then deleted at once."""
        self._flush()
        shape = self._shape if self._shape is not None else (self._nbytes,)
        head = encode_header(self._code, shape, len(self._written), self._crc, self._nbytes, self._version)
        expiry = () if self._header_lease is None else ("PX", int(self._header_lease))
        owner = [owner_key(self._key, self._version)] if self._owner is not None and self._written else []
        replaced: list[str] = []

        def prepare(read: Callable[[Sequence[Command]], list[Any]]) -> list[Command]:
            checks = [("GETRANGE", self._key, 0, HEADER_MAX_BYTES - 1)]
            if self._written:
                checks.append(("EXISTS", *self._written))
            old, *present = read(checks)
            if self._written and present[0] != len(self._written):
                raise RedisInternalError(
                    f"{len(self._written) - present[0]} of the {len(self._written)} chunks of {self._key!r} were "
                    "removed before the value was published (their lease ran out, or a clean-up took this writer "
                    "for a dead one); nothing was published")
            replaced[:] = stored_chunk_keys(read, self._key, old)
            lease = lease_ms(self._db)
            return [*(("PERSIST", name) for name in self._written), ("SET", self._key, head, *expiry),
                    *(("DEL", name) for name in owner), *(("PEXPIRE", name, lease) for name in replaced)]

        self._db.transaction(self._key, [self._key, *self._written], prepare)
        if replaced:
            self._db.redis.delete(*replaced)

    def _abort(self) -> None:
        if self._written:
            self._db.redis.delete(*self._written)
            self._forget_owner()
        self._written = []

    def _forget_owner(self) -> None:
        if self._owner is not None and self._written:
            self._db.redis.delete(owner_key(self._key, self._version))


OWNER_SUFFIX = ".owner"
_OWNER_KEY_RE = re.compile(r"^.*\.chunk\.(?P<version>[0-9a-f]{32})\.owner\Z", re.DOTALL)
# What SCAN matches: every owner key, whichever of tagged_key's forms holds it.
OWNER_KEY_PATTERN = "*.chunk.*" + OWNER_SUFFIX


def owner_key(key: str, version: str) -> str:
    """Where a :class:`ChunkedWriter` with an owner names it while it writes the chunks of ``version``."""
    return tagged_key(key, f".chunk.{version}{OWNER_SUFFIX}")


def read_owner_key(db: Database, name: str) -> tuple[str, str, str] | None:
    """The value key, chunk version and owner that the owner key ``name`` records; ``None`` when
    ``name`` is not an owner key or is gone."""
    match = _OWNER_KEY_RE.match(name)
    if match is None:
        return None
    raw = db.redis.get(name)
    owner, newline, key = (raw or b"").decode("utf-8", "surrogateescape").partition("\n")
    # Kept in the record: "{a}" and "a" both put their chunks under "{a}".
    if not newline or owner_key(key, match["version"]) != name:
        return None
    return key, match["version"], owner


def delete_unpublished(db: Database, key: str, version: str) -> int:
    """Delete the chunks of ``version`` of the value at ``key`` unless that version is published there
    (its header names it), and the owner key of that version; the number of chunks deleted.

    Only for a writer known to be gone: a live writer would publish a header naming missing chunks.
    """
    try:
        header = read_header(db, key)
    except RedisRuntimeError:
        header = None
    deleted = 0
    if header is None or header.version != version:
        unpublished = Header(0, (), 0, chunks=MAX_CHUNKS, version=version)
        for batch in unpublished.probes():
            names = unpublished.chunk_keys(key, batch)
            removed = db.redis.delete(*names)
            deleted += removed
            if removed < len(names):
                break
    db.redis.delete(owner_key(key, version))
    return deleted


def new_version() -> str:
    """A fresh chunk-set version: the time it was made (ns, 8 bytes) then 8 random bytes, as hex."""
    return (time.time_ns().to_bytes(8, "big") + os.urandom(8)).hex()


def read_header(db: Database, key: str) -> Header | None:
    """The header of the value at ``key`` (one GETRANGE); None when there is no value."""
    raw = db.redis.getrange(key, 0, HEADER_MAX_BYTES - 1)
    return decode_header(raw, key) if raw else None


def get_array(db: Database, key: str, out: np.ndarray | None = None) -> np.ndarray:
    """Read the tensor at ``key`` into ``out`` (checked for dtype, shape, contiguity) or a new array."""
    if out is not None:
        _check_out(out, key)
    for _ in range(READ_RETRIES):
        result = _try_get(db, key, out)
        if result is not None:
            return result
    raise RedisInternalError(f"The chunks of tensor {key!r} kept changing while being read")


def _check_out(out: np.ndarray, key: str) -> None:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"Argument out_array is of type {type(out)}, not {np.ndarray}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise RedisRuntimeError(f"unpack_tensor({key!r}): the output array must be C-contiguous and writeable")


def _target(header: Header, out: np.ndarray | None, key: str) -> np.ndarray:
    if out is None:
        return np.empty(header.shape, dtype=header.dtype)
    if dtype_code(out.dtype) != header.code:
        raise RedisRuntimeError(
            f"unpack_tensor({key!r}): the tensor is {_name(header)} but the output array is {out.dtype}"
        )
    if tuple(out.shape) != header.shape:
        raise RedisRuntimeError(
            f"unpack_tensor({key!r}): the tensor has shape {header.shape} but the output array {out.shape}"
        )
    return out


def _name(header: Header) -> str:
    return "bfloat16" if header.code == _BF16_CODE else header.dtype.name


def _try_get(db: Database, key: str, out: np.ndarray | None) -> np.ndarray | None:
    state: dict[str, object] = {}

    def plan(first: memoryview, length: int) -> tuple[int, memoryview]:
        header = decode_header(first, key)
        state["header"] = header
        if header.chunks:
            return length, memoryview(bytearray(0))
        if header.size + header.nbytes != length:  # checked before anything is allocated for it
            raise RedisInternalError(_claims(key, header.nbytes, length - header.size))
        target = _target(header, out, key)
        state["target"] = target
        return header.size, memoryview(target.reshape(-1).view(np.uint8))

    if not db.get_into(key, plan, HEADER_MAX_BYTES):
        raise RedisKeyError(f"The tensor {key!r} does not exist")
    header: Header = state["header"]  # type: ignore[assignment]
    if not header.chunks:
        return state["target"]  # type: ignore[return-value]
    stored = stored_chunk_bytes(db, key, header)
    if stored is None:
        if read_header(db, key) == header:
            raise RedisInternalError(f"The value at key {key!r} is corrupt: its header names "
                                     f"{header.chunks} chunks and some of them do not exist")
        return None  # overwritten while reading: the caller reads the new header
    if stored != header.payload_bytes or header.payload_bytes != header.nbytes:
        raise RedisInternalError(_claims(key, header.nbytes, stored))
    target = _target(header, out, key)
    return target if _read_chunks(db, key, header, target) else None


def _claims(key: str, claimed: int, stored: int) -> str:
    return (f"The value at key {key!r} is corrupt or truncated: its header claims {claimed} bytes of data "
            f"but {stored} are stored")


def stored_chunk_bytes(db: Database, key: str, header: Header) -> int | None:
    """Bytes the chunks of a chunked value hold; None when one of them is gone.

    Read before anything is allocated for the value, in batches (:meth:`Header.probes`) that stop
    at the first missing chunk or once more bytes than claimed are found: a header that claims more
    than is stored costs what is stored, not what it claims.
    """
    if header.chunks > MAX_CHUNKS or header.chunks > header.payload_bytes:
        raise RedisInternalError(f"The value at key {key!r} is corrupt: its header claims {header.chunks} chunks "
                                 f"of {header.payload_bytes} bytes in all")
    total = 0
    for batch in header.probes():
        lengths = db.exchange([("STRLEN", chunk) for chunk in header.chunk_keys(key, batch)])
        if any(n == 0 for n in lengths):
            return None
        total += sum(lengths)
        if total > header.payload_bytes:
            break  # more than claimed: corrupt, whatever the rest holds
    return total


def _read_chunks(db: Database, key: str, header: Header, target: np.ndarray) -> bool:
    whole = memoryview(target.reshape(-1).view(np.uint8))
    if whole.nbytes != header.payload_bytes:
        raise RedisInternalError(f"The chunk header of {key!r} does not match its shape")
    views: list[memoryview] = []

    def plan(first: memoryview, length: int) -> tuple[int, memoryview]:
        start = sum(v.nbytes for v in views)
        views.append(whole[start:start + length])
        return 0, views[-1]

    for chunk_key in header.chunk_keys(key):
        if not db.get_into(chunk_key, plan, 1):
            return False  # overwritten while reading: the caller reads the new header
    offset = sum(v.nbytes for v in views)
    if offset != header.payload_bytes or _crc(views) != header.crc:
        return False
    return True


def delete_value(db: Database, key: str) -> int:
    """Delete a value and its chunks; the number of top-level keys removed.

    The key goes and its chunks are leased in one MULTI/EXEC, then the chunks are deleted: no
    moment leaves a header naming missing chunks, or chunks that never expire."""
    chunks: list[str] = []

    def prepare(read: Callable[[Sequence[Command]], list[Any]]) -> list[Command]:
        (head,) = read([("GETRANGE", key, 0, HEADER_MAX_BYTES - 1)])
        chunks[:] = stored_chunk_keys(read, key, head)
        lease = lease_ms(db)
        return [("DEL", key), *(("PEXPIRE", name, lease) for name in chunks)]

    (deleted, *_) = db.transaction(key, [key], prepare)
    if chunks:
        db.redis.delete(*chunks)
    return deleted
