"""How models and scripts are stored, and the request/reply protocol between clients and workers.

A model or script key holds a small JSON manifest (kind, backend, device, batching, version); the
bytes live at ``{key}.blob.<version>`` (a uint8 tensor, so chunked like any tensor) and the manifest,
written last with one SET, publishes them: a worker loads either the old or the new version, never
a half-written one, and notices a new version by the manifest alone.

Run requests go to one Redis list that every worker pops; each entry is
``<model key as JSON>\\n<attempt>\\n<json>`` (the key's JSON form has no newline, so any key is
carried), followed on a single node by ``\\n<values>``: the manifest and the input tensors as they
were when the request was queued (``ENQUEUE_LUA``), so that the worker needs no round trip before it
runs the model. Replies go to a per-request list that the caller pops with BLPOP until the request's
deadline. All protocol keys share the ``{srio}`` hash tag (one shard in a cluster).

A worker registers in ``{srio}.workers`` and keeps ``{srio}.alive.<name>`` alive with a heartbeat;
it pops with BLMOVE into ``{srio}.inflight.<name>``, so a request is never out of both lists. When
the heartbeat of a registered worker has expired, whoever notices first (a caller waiting for its
reply, an idle worker) unregisters it atomically (``REAP_LUA``) and puts its request back at the
head of the queue once; a request whose worker dies a second time gets an error reply at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from smartredis_io import wire
from smartredis_io.connection import Database
from smartredis_io.error import RedisKeyError

QUEUE_KEY = "{srio}.requests"
WORKERS_KEY = "{srio}.workers"  # hash: worker name -> pid
ALIVE_PREFIX = "{srio}.alive."  # + worker name: exists while the worker's heartbeat runs
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_MS = 3_000  # a worker whose heartbeat stopped this long ago is dead
MAX_ATTEMPTS = 2  # a request whose worker dies is run once more
INFLIGHT_PREFIX = "{srio}.inflight."  # + worker name: a list holding the request the worker is running
REPLY_TTL_MS = 60_000  # a reply nobody collects (its caller timed out) expires after this
SEPARATOR = "\n"
OK_REPLY_PREFIX = b'{"ok": true,'  # how a success reply starts (``ok_reply``); any other reply carries an error
EMBED_MAX_BYTES = 64 * 1024  # larger inputs are not copied into the request: the worker reads them

# Queue a request: ARGV[1] is its entry; appended to it are the manifest at KEYS[2] and the inputs
# at KEYS[3..], each as <length>:<bytes>, or as '-' when it is absent, not a string or over ARGV[2]
# bytes (the worker then reads it itself). Reads run with the caller's rights.
ENQUEUE_LUA = """
local parts = {ARGV[1], '\\n'}
local limit = tonumber(ARGV[2])
for i = 2, #KEYS do
  local n = redis.pcall('STRLEN', KEYS[i])
  if type(n) == 'number' and n > 0 and n <= limit then
    local v = redis.call('GET', KEYS[i])
    parts[#parts + 1] = #v .. ':' .. v
  else
    parts[#parts + 1] = '-'
  end
end
return redis.call('RPUSH', KEYS[1], table.concat(parts))
"""

# Store a run's outputs and answer its caller, atomically: KEYS[1..n] are the outputs (n = #ARGV - 5),
# KEYS[n + 1] the reply list; ARGV[1]: how a manifest starts, ARGV[2]: bytes of each replaced value
# to return, ARGV[3]: the reply's expiry (ms), ARGV[4]: the success reply, ARGV[5]: the worker's
# name, ARGV[6..]: the values. An output that holds a model or script is not replaced: the caller
# gets an error and nothing is written. Returns the first ARGV[2] bytes each output replaced.
STORE_LUA = """
local n = #ARGV - 5
local heads = {}
for i = 1, n do
  local head = redis.pcall('GETRANGE', KEYS[i], 0, tonumber(ARGV[2]) - 1)
  if type(head) ~= 'string' then head = '' end
  if string.sub(head, 1, #ARGV[1]) == ARGV[1] then
    redis.call('RPUSH', KEYS[n + 1], cjson.encode({ok = false, worker = ARGV[5],
      error = "ERR output key '" .. KEYS[i] .. "' holds a model or script; a run does not replace it"}))
    redis.call('PEXPIRE', KEYS[n + 1], tonumber(ARGV[3]))
    return false
  end
  heads[i] = head
end
for i = 1, n do redis.call('SET', KEYS[i], ARGV[5 + i]) end
redis.call('RPUSH', KEYS[n + 1], ARGV[4])
redis.call('PEXPIRE', KEYS[n + 1], tonumber(ARGV[3]))
return heads
"""

# Take up to ARGV[2] requests for model ARGV[1] from the first ARGV[3] queue entries, atomically.
TAKE_BATCH_LUA = """
local items = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
local out = {}
for _, v in ipairs(items) do
  if #out >= tonumber(ARGV[2]) then break end
  if string.sub(v, 1, #ARGV[1]) == ARGV[1] then
    if redis.call('LREM', KEYS[1], 1, v) == 1 then table.insert(out, v) end
  end
end
return out
"""

# A worker that pops a request for a model another worker is batching hands it over, atomically
# with respect to the batching worker's release (RELEASE_BATCH_LUA), so no request is stranded.
HANDOFF_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""
RELEASE_BATCH_LUA = """
redis.call('DEL', KEYS[1])
local rest = redis.call('LRANGE', KEYS[2], 0, -1)
redis.call('DEL', KEYS[2])
return rest
"""


#: what the workers count per model or script key (RedisAI's AI.INFO statistics); duration in microseconds
STATS_FIELDS = ("duration", "samples", "calls", "errors")


def stats_key(key: str) -> str:
    """The hash holding the statistics of the model or script at ``key``."""
    return f"{{srio}}.stats.{key}"


MANIFEST_PREFIX = b'{"kind": '  # how a stored manifest (json.dumps of Manifest) starts
_INTERNAL_KEY = re.compile(r"^\{srio\}\.|\.(blob|chunk)\.[0-9a-f]{32}(\.\d+)?$")


def is_internal_key(key: str) -> bool:
    """Whether ``key`` belongs to the protocol or to the parts of a stored value (never a run's output)."""
    return bool(_INTERNAL_KEY.search(key))


# Unregister every registered worker whose heartbeat expired (ARGV[1]: the alive-key prefix) and
# requeue the request in its in-flight list (ARGV[2]: that list's prefix) at the head of the queue
# (attempt + 1), or, at attempt ARGV[3] - 1, answer it with an error. Returns the names of the
# workers removed.
REAP_LUA = """
local removed = {}
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. name) == 0 then
    local inflight = ARGV[2] .. name
    local reqs = redis.call('LRANGE', inflight, 0, -1)
    redis.call('DEL', inflight)
    redis.call('HDEL', KEYS[1], name)
    table.insert(removed, name)
    for i = #reqs, 1, -1 do
      local req = reqs[i]
      local first = string.find(req, '\\n', 1, true)
      local second = string.find(req, '\\n', first + 1, true)
      local attempt = tonumber(string.sub(req, first + 1, second - 1))
      local rest = string.sub(req, second + 1)
      if attempt + 1 < tonumber(ARGV[3]) then
        redis.call('LPUSH', KEYS[2], string.sub(req, 1, first) .. (attempt + 1) .. '\\n' .. rest)
      else
        local third = string.find(rest, '\\n', 1, true)
        local request = cjson.decode(third and string.sub(rest, 1, third - 1) or rest)
        local reply = '{srio}.reply.' .. request['id']
        redis.call('RPUSH', reply, cjson.encode({ok = false, worker = name, error = 'ERR the worker ' .. name ..
          ' died while running ' .. request['kind'] .. ' ' .. request['key'] .. ', which had been retried once already'}))
        redis.call('PEXPIRE', reply, tonumber(ARGV[4]))
      end
    end
  end
end
return removed
"""


def ok_reply(worker: str) -> str:
    """The reply of the worker named ``worker`` to a request it ran."""
    return json.dumps({"ok": True, "error": "", "worker": worker})


def error_reply(worker: str, error: str) -> str:
    """The reply of the worker named ``worker`` to a request that failed with ``error``."""
    return json.dumps({"ok": False, "error": error, "worker": worker})


def inflight_key(worker: str) -> str:
    """The list holding the request the worker named ``worker`` is running."""
    return INFLIGHT_PREFIX + worker


def reap_dead_workers(db: Database) -> list[str]:
    """Unregister workers whose heartbeat expired, retrying or failing their requests; their names."""
    removed = db.redis.eval(REAP_LUA, 2, WORKERS_KEY, QUEUE_KEY, ALIVE_PREFIX, INFLIGHT_PREFIX, MAX_ATTEMPTS,
                            REPLY_TTL_MS)
    return [name.decode() if isinstance(name, bytes) else name for name in removed]


def batch_keys(key: str) -> tuple[str, str]:
    """The lock a worker holds while it gathers a batch for ``key``, and its hand-over list."""
    return f"{{srio}}.batching.{key}", f"{{srio}}.handoff.{key}"


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
    db.redis.delete(stats_key(key))
    return True


@dataclass
class Request:
    """One run_model / run_script call."""

    id: str
    kind: str
    key: str
    inputs: list[str]
    outputs: list[str]
    deadline: float  # time.time() seconds
    fn: str = ""
    attempt: int = 0  # how many times a worker died running it
    # The manifest then the inputs as read when the request was queued (None: not read), or None
    # when nothing was read (a cluster's keys live on other shards than the queue).
    embedded: list[bytes | None] | None = None

    @property
    def reply_key(self) -> str:
        """The list the caller pops the reply from."""
        return f"{{srio}}.reply.{self.id}"

    def encode(self) -> str:
        """The queue entry without embedded values: the key's JSON, the attempt, the request's JSON, one per line."""
        body = {"id": self.id, "kind": self.kind, "key": self.key, "inputs": self.inputs, "outputs": self.outputs,
                "deadline": self.deadline, "fn": self.fn}
        return f"{queue_prefix(self.key)}{self.attempt}{SEPARATOR}{json.dumps(body)}"

    def enqueue_command(self) -> tuple[Any, ...]:
        """The command that queues this request with its manifest and inputs (``ENQUEUE_LUA``), on one node."""
        return ("EVAL", ENQUEUE_LUA, 2 + len(self.inputs), QUEUE_KEY, self.key, *self.inputs,
                self.encode(), EMBED_MAX_BYTES)

    @classmethod
    def decode(cls, raw: bytes | str) -> Request:
        """The request in a queue entry; ``ValueError`` when it is not one."""
        data = raw.encode() if isinstance(raw, str) else raw
        parts = data.split(b"\n", 3)
        if len(parts) < 3 or not parts[1].isdigit():
            raise ValueError(f"Malformed request {data[:80]!r}")
        request = cls(**json.loads(parts[2]), attempt=int(parts[1]))
        if len(parts) == 4:
            request.embedded = _unpack_values(parts[3], 1 + len(request.inputs))
        return request


def _unpack_values(data: bytes, count: int) -> list[bytes | None]:
    """The ``count`` values ``ENQUEUE_LUA`` appended (``<length>:<bytes>`` or ``-``); ``ValueError`` if malformed."""
    values: list[bytes | None] = []
    at = 0
    while at < len(data):
        if data[at:at + 1] == b"-":
            values.append(None)
            at += 1
            continue
        colon = data.find(b":", at, at + 21)
        if colon < 0 or not data[at:colon].isdigit():
            raise ValueError(f"Malformed request values at byte {at}")
        end = colon + 1 + int(data[at:colon])
        if end > len(data):
            raise ValueError(f"Request value at byte {at} runs past the end ({end} > {len(data)} bytes)")
        values.append(data[colon + 1:end])
        at = end
    if len(values) != count:
        raise ValueError(f"Request carries {len(values)} values, expected {count}")
    return values


def queue_prefix(key: str) -> str:
    """How every queued request for the model or script ``key`` starts."""
    return f"{json.dumps(key)}{SEPARATOR}"
