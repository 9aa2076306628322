"""How models and scripts are stored, and the request/reply protocol between clients and workers.

A model or script key holds a small JSON manifest (kind, backend, device, batching, version); the
bytes live at ``{key}.blob.<version>`` (a uint8 tensor, so chunked like any tensor) and the manifest,
written last with one SET, publishes them: a worker loads either the old or the new version, never
a half-written one, and notices a new version by the manifest alone.

Run requests go to one Redis list that every worker pops with BLPOP; each entry is
``<model key as JSON>\\n<attempt>\\n<json>`` (the key's JSON form has no newline, so any key is
carried). Replies go to a per-request list that the caller pops with BLPOP until the request's
deadline. All protocol keys share the ``{srio}`` hash tag (one shard in a cluster).

A worker registers in ``{srio}.workers`` and keeps ``{srio}.alive.<name>`` alive with a heartbeat;
while it runs a request, the request sits in ``{srio}.inflight`` under its name. When the heartbeat
of a registered worker has expired, whoever notices first (a caller waiting for its reply, an idle
worker) unregisters it atomically (``REAP_LUA``) and puts its request back at the head of the queue
once; a request whose worker dies a second time gets an error reply at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field

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
INFLIGHT_KEY = "{srio}.inflight"  # hash: worker name -> the request it is running (as queued)
REPLY_TTL_MS = 60_000  # a reply nobody collects (its caller timed out) expires after this
SEPARATOR = "\n"

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


MANIFEST_PREFIX = b'{"kind": '  # how a stored manifest (json.dumps of Manifest) starts
_INTERNAL_KEY = re.compile(r"^\{srio\}\.|\.(blob|chunk)\.[0-9a-f]{32}(\.\d+)?$")


def is_internal_key(key: str) -> bool:
    """Whether ``key`` belongs to the protocol or to the parts of a stored value (never a run's output)."""
    return bool(_INTERNAL_KEY.search(key))


# Unregister every registered worker whose heartbeat expired (ARGV[1]: the alive-key prefix) and
# requeue its in-flight request at the head of the queue (attempt + 1), or, at attempt ARGV[2] - 1,
# answer it with an error. Returns the names of the workers removed.
REAP_LUA = """
local removed = {}
for _, name in ipairs(redis.call('HKEYS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. name) == 0 then
    local req = redis.call('HGET', KEYS[2], name)
    redis.call('HDEL', KEYS[1], name)
    redis.call('HDEL', KEYS[2], name)
    table.insert(removed, name)
    if req then
      local first = string.find(req, '\\n', 1, true)
      local second = string.find(req, '\\n', first + 1, true)
      local attempt = tonumber(string.sub(req, first + 1, second - 1))
      local body = string.sub(req, second + 1)
      if attempt + 1 < tonumber(ARGV[2]) then
        redis.call('LPUSH', KEYS[3], string.sub(req, 1, first) .. (attempt + 1) .. '\\n' .. body)
      else
        local request = cjson.decode(body)
        local reply = '{srio}.reply.' .. request['id']
        redis.call('RPUSH', reply, cjson.encode({ok = false, worker = name, error = 'ERR the worker ' .. name ..
          ' died while running ' .. request['kind'] .. ' ' .. request['key'] .. ', which had been retried once already'}))
        redis.call('PEXPIRE', reply, tonumber(ARGV[3]))
      end
    end
  end
end
return removed
"""


def reap_dead_workers(db: Database) -> list[str]:
    """Unregister workers whose heartbeat expired, retrying or failing their requests; their names."""
    removed = db.redis.eval(REAP_LUA, 3, WORKERS_KEY, INFLIGHT_KEY, QUEUE_KEY, ALIVE_PREFIX, MAX_ATTEMPTS,
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


def store(db: Database, key: str, blob: bytes, manifest: Manifest) -> None:
    """Write the blob under a new version, publish the manifest, then drop the previous blob.

    The blob is leased (it expires if this writer dies before the manifest is written).
    """
    blob_at = blob_key(key, manifest.version)
    wire.put_array(db, blob_at, np.frombuffer(blob, dtype=np.uint8), wire.lease_ms(db))
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

    @property
    def reply_key(self) -> str:
        """The list the caller pops the reply from."""
        return f"{{srio}}.reply.{self.id}"

    def encode(self) -> str:
        """The queue entry: the key's JSON, the attempt, the request's JSON, one per line."""
        body = {k: v for k, v in vars(self).items() if k != "attempt"}  # vars: asdict's deep copy costs ~10x
        return f"{queue_prefix(self.key)}{self.attempt}{SEPARATOR}{json.dumps(body)}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Request:
        """The request in a queue entry; ``ValueError`` when it is not one."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        parts = text.split(SEPARATOR, 2)
        if len(parts) != 3 or not parts[1].isdigit():
            raise ValueError(f"Malformed request {text[:80]!r}")
        return cls(**json.loads(parts[2]), attempt=int(parts[1]))


def queue_prefix(key: str) -> str:
    """How every queued request for the model or script ``key`` starts."""
    return f"{json.dumps(key)}{SEPARATOR}"
