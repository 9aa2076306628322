"""The protocol that clients, the Redis module and execution workers share: how models and scripts
are stored, and the requests that the workers receive.

A model or script key holds a small JSON manifest (kind, backend, device, batching, version); the
bytes live at ``{key}.blob.<version>`` (a uint8 tensor, so chunked like any tensor) and the manifest,
written last with one SET, publishes them: a worker loads either the old or the new version, never
a half-written one, and notices a new version by the manifest alone.

Runs go through the smartredis_io Redis module: clients send RedisAI's ``AI.MODELEXECUTE`` /
``AI.SCRIPTEXECUTE`` (:func:`execute_command`), the module queues the request in the server's memory,
and workers take it with ``SRIO.POP`` as a :class:`Request`, which carries the manifest and the
inputs the module found on its node, so that a worker with the model loaded runs it at once.
docs/smartredis.md describes every command of that protocol.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from smartredis_io._client import wire
from smartredis_io._client.connection import Database
from smartredis_io.error import RedisKeyError

MANIFEST_PREFIX = b'{"kind": '  # how a stored manifest (json.dumps of Manifest) starts
_INTERNAL_KEY = re.compile(r"\.(blob|chunk)\.[0-9a-f]{32}(\.\d+)?$")


def is_internal_key(key: str) -> bool:
    """Whether ``key`` holds a part of a stored value (a model's blob, a chunk): never a run's output."""
    return bool(_INTERNAL_KEY.search(key))


@dataclass
class Manifest:
    """What is stored at a model or script key."""

    kind: str  # "model" or "script"
    version: str
    backend: str = "TORCH"
    device: str = "CPU"
    batch_size: int = 0
    min_batch_size: int = 0
    min_batch_timeout: int = 0  # ms
    tag: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    blob: str = ""  # set for an alias: the blob of the model it points to (owned by that model)


def blob_key(key: str, version: str) -> str:
    """The key of the blob of version ``version`` of the model or script at ``key``."""
    return wire.tagged_key(key, f".blob.{version}")


def _blob_of(key: str, manifest: Manifest) -> str:
    return manifest.blob or blob_key(key, manifest.version)


def _publish(db: Database, key: str, manifest: Manifest) -> None:
    """Write the manifest (one SET) and drop the blob of the one it replaced, if that one owned it."""
    previous = parse(db.redis.set(key, json.dumps(asdict(manifest)), get=True))
    if previous and not previous.blob:
        wire.delete_value(db, blob_key(key, previous.version))


def store(db: Database, key: str, blob: bytes, manifest: Manifest, chunk_bytes: int | None = None) -> None:
    """Write the blob under a new version, publish the manifest, then drop the previous blob.

    The blob is leased (it expires if this writer dies before the manifest is written);
    ``chunk_bytes`` caps the size of one stored value (default: the bulk limit).
    """
    blob_at = blob_key(key, manifest.version)
    wire.put_array(db, blob_at, np.frombuffer(blob, dtype=np.uint8), wire.lease_ms(db), chunk_bytes=chunk_bytes)
    wire.persist(db, [blob_at])
    _publish(db, key, manifest)


def alias(db: Database, alias_key: str, target_key: str) -> None:
    """Point ``alias_key`` at the model stored at ``target_key`` (one SET: callers see old or new)."""
    target = load_manifest(db, target_key)
    if target is None:
        raise RedisKeyError(f"No model stored at key {target_key!r}")
    target.blob = _blob_of(target_key, target)
    _publish(db, alias_key, target)


def new_version() -> str:
    """A fresh version id."""
    return uuid.uuid4().hex


def parse(raw: bytes | None) -> Manifest | None:
    """The manifest in ``raw``, or None when it holds none."""
    if not raw:
        return None
    try:
        return Manifest(**json.loads(raw))
    except (ValueError, TypeError):
        return None


def load_manifest(db: Database, key: str) -> Manifest | None:
    """The manifest at ``key``, or None when there is none (or the key holds something else)."""
    return parse(db.redis.get(key))


def load_blob(db: Database, key: str, manifest: Manifest) -> bytes:
    """The bytes of the model or script ``manifest`` describes."""
    return wire.get_array(db, _blob_of(key, manifest)).tobytes()


def delete(db: Database, key: str) -> bool:
    """Delete the model or script at ``key`` and the blob it owns; False when there is none."""
    manifest = load_manifest(db, key)
    if manifest is None:
        return False
    db.redis.delete(key)
    if not manifest.blob:
        wire.delete_value(db, blob_key(key, manifest.version))
    return True




#: The module commands a client sends; the worker commands (``SRIO.*``) are in docs/smartredis.md.
MODULE_HINT = (
    "load the smartredis_io Redis module into redis-server (`--loadmodule \"$(python -m smartredis_io.redis_module)\"`); "
    "Orchestrator, RedisServer and RedisCluster load it themselves"
)
#: inputs up to this size travel with the request (exec.c's EMBED_MAX_BYTES); the worker reads larger ones
EMBED_MAX_BYTES = 64 * 1024
#: bytes of a replaced output that SRIO.REPLY returns: a tensor header, to find the chunks it referenced
REPLACED_HEAD_BYTES = wire.HEADER_MAX_BYTES
KINDS = ("model", "script", "script-lists")


def execute_command(kind: str, key: str, fn: str, inputs: list[str], outputs: list[str], timeout_ms: int) -> tuple:
    """The RedisAI command that runs a model (``AI.MODELEXECUTE``) or a script function (``AI.SCRIPTEXECUTE``,
    which calls a function of the usual positional signature with the input tensors)."""
    if kind == "model":
        return ("AI.MODELEXECUTE", key, "INPUTS", len(inputs), *inputs, "OUTPUTS", len(outputs), *outputs,
                "TIMEOUT", timeout_ms)
    return ("AI.SCRIPTEXECUTE", key, fn, "INPUTS", len(inputs), *inputs, "OUTPUTS", len(outputs), *outputs,
            "TIMEOUT", timeout_ms)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    if isinstance(value, str):
        return value
    raise ValueError(f"expected a string, got {type(value).__name__}")


def _texts(values: Any) -> list[str]:
    if not isinstance(values, list):
        raise ValueError(f"expected a list, got {type(values).__name__}")
    return [_text(v) for v in values]


@dataclass
class Request:
    """One run as a worker receives it from ``SRIO.POP`` / ``SRIO.TAKE`` (see docs/smartredis.md)."""

    id: int
    kind: str  # "model", "script" (positional tensors), "script-lists" (AI.SCRIPTEXECUTE: lists if the function takes them)
    key: str
    fn: str
    deadline: float  # time.monotonic() seconds
    attempt: int
    user: str  # the ACL user that asked for the run
    inputs: list[str]
    outputs: list[str]
    manifest: bytes | None  # what the model or script key held when the request was handed over; None: not read
    values: list[bytes | None]  # what each input held then; None: not read (absent, large, or on another shard)
    keys: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    variadic: int = -1  # index of the first input passed as one list (AI.SCRIPTRUN's ``$``); -1: none
    node: Any = None  # the connection to the server whose module handed it over (answers go there)

    @property
    def what(self) -> str:
        """How error messages name it: ``model 'key'`` or ``script 'key'``."""
        return f"{'model' if self.kind == 'model' else 'script'} {self.key!r}"

    @classmethod
    def from_reply(cls, reply: Any, node: Any, received_at: float) -> Request:
        """The request in a module's reply; ``ValueError`` when the reply is not one."""
        if not isinstance(reply, list) or len(reply) != 14:
            raise ValueError(f"not a request: {reply!r:.80}")
        (id_, kind, key, fn, left_ms, attempt, user, inputs, outputs, manifest, values, keys, args,
         variadic) = reply
        kind = _text(kind)
        if kind not in KINDS or not isinstance(id_, int) or not isinstance(left_ms, int):
            raise ValueError(f"not a request: {reply!r:.80}")
        inputs = _texts(inputs)
        if not isinstance(values, list) or len(values) != len(inputs):
            raise ValueError("a request's values do not match its inputs")
        return cls(id_, kind, _text(key), _text(fn), received_at + left_ms / 1000, int(attempt), _text(user), inputs,
                   _texts(outputs), manifest if isinstance(manifest, bytes) else None,
                   [v if isinstance(v, bytes) else None for v in values], _texts(keys), _texts(args), int(variadic),
                   node)
