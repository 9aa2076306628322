"""Tiered sharded (DCP) checkpoints: every rank waits for its node's NVMe, and the checkpoint is
published in GCS once every rank's shard is there.

    tier = ShardedLocalTier("/mnt/nvme0/tier")        # one per process, kept across saves
    dcp.save(state, storage_writer=DatafluxStorageWriter("gs://bucket/run/step-100", local_dir=tier))
    dcp.load(state, storage_reader=DatafluxStorageReader("gs://bucket/run/step-100", local_dir=tier))
    tier.close()                                       # waits for the uploads in flight

**Save.** Each rank writes its items into its own file under the local tier with FastPersist's DCP
storage (torch's layout: every item a ``torch.save`` record), and the coordinator writes the
checkpoint's metadata beside them; then ``dcp.save`` returns. Training waits for nothing else. In
the background each rank takes its file's crc32c (and one per ``block_size`` bytes of every item),
uploads the file as it is to ``<prefix>/__<rank>_0.<token>.distcp`` (parallel parts, crc32c, the
atomic publish and generation precondition of every Dataflux upload), then publishes a small
*marker*, ``__<rank>_0.<token>.distcp.uploaded``, holding those checksums and the generation
uploaded. The coordinator uploads the metadata as ``.metadata.<token>.pending``. With
``remote_every=N`` only every N-th save round goes to GCS: the coordinator decides as it plans the
save and tells every rank in its plan; the saves of the other rounds take their checksums and stay
on the node.

**Publish.** ``.metadata`` is written only once the pending metadata and every marker it names are
in GCS, by whichever rank sees that first: the rank that uploads the last marker, or the
coordinator, which keeps looking until the checkpoint is published or replaced (so a rank that died
after its marker still gets its checkpoint published). The publisher holds the checkpoint's save
lock (the ``.dcp-save.lock`` object of every Dataflux DCP save), checks that every shard object is
the generation its marker names, and replaces ``.metadata`` under a precondition on the generation
it read, with one crc32c per ``block_size`` bytes of every item (so GCS loads check every block they
use, as for any Dataflux DCP checkpoint). Two ranks that finish together publish once.

Why markers, and not a collective: the uploads run after ``dcp.save`` returned, while the ranks are
in training steps whose collectives must not meet ours; a collective at the next save or at
teardown would leave every checkpoint undurable for a whole save interval, and the last one of a
job killed before its teardown for ever. Markers need no rank to wait for another, and a restart of
any rank finishes its own part.

**Order.** A tiered save's token begins with the coordinator's clock (milliseconds), so tokens order
saves. A publish never replaces a newer checkpoint (a tiered one of a later token, or one another
writer published after this save began): it is then *superseded*. After its publish, the publisher
deletes the objects of earlier saves (their shards, markers and pending metadata), never those of
later ones still uploading.

**The local tier.** ``<local_dir>/dcp-<key>/`` holds one checkpoint (``key``: a digest of its
``gs://`` prefix), shared by the ranks of a node::

    __<rank>_0.<token>.distcp        a rank's shard of one save
    .metadata.<token>                the save's metadata (the coordinator's node)
    .job-<token>-<rank|metadata>.json  the manifest of each: size, crc32c, state, owner process

A manifest is written (``writing``) before its file, and again (``written``, with the size) once
FastPersist renamed the file into place whole: a crash leaves either a manifest naming a whole file
or one that says ``writing``, which the next writer removes with its file. Then ``uploaded``
(marker or pending metadata in GCS), and ``published`` or ``superseded``; a save that stays on the
node goes from ``written`` to ``local`` once its checksums are taken. The local tier keeps the
newest ``keep_local`` saves; an older one leaves once none of its jobs is pending.

**Restart.** :meth:`ShardedLocalTier.finish_pending` (a writer's first save calls it) takes over the
jobs of processes that are certainly gone (:class:`~lightning_storage_plugins.owners.Owner`) and
finishes them: checksums, uploads, markers, the publish.

**Load.** The ranks agree on one version of the checkpoint: the newest save whose every shard each
rank finds whole on its node (its size, and its crc32c as it is read), if it is as new as GCS's;
else GCS's. With a process group, the agreement is one ``all_gather_object`` (and the chosen
metadata one ``broadcast_object_list``) on the reader's ``process_group``, in ``read_metadata``,
which every rank calls. The chosen version's files are read from the local tier where they are
there and whole, else from GCS with the Dataflux reader's ranged reads; a resharded load reads the
other ranks' files locally where they are on the node (ranks of one node share ``local_dir``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import pickle
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dataflux_ckpt.checksums import crc32c_b64, crc32c_extend
from dataflux_ckpt.dcp_objects import (
    LOCK_LEASE_S,
    GcsItemInfo,
    _BlockCrcs,
    _Connection,
    _GcsSaveLock,
    _read_small,
    write_commit_record,
)
from dataflux_ckpt.errors import ConcurrentWriteError, DataCorruptionError
from dataflux_ckpt.mapped import mapped_blocks
from dataflux_ckpt.options import CRC_BLOCK_BYTES, TransferOptions
from dataflux_ckpt.paths import GcsPath, parse_gcs_path
from dataflux_ckpt.retry import Deadline
from dataflux_ckpt.tiered import (
    DEFAULT_KEEP_LOCAL,
    DEFAULT_TEARDOWN_TIMEOUT_S,
    PROGRESS_EVERY_S,
    RETRY_INITIAL_S,
    RETRY_MAX_S,
    LocalTierFullError,
    ManifestError,
    TieredOptions,
    TieredStats,
    _crc_text,
    _fastpersist,
    _LocalCopy,
    _LocalTier,
    _SaveRounds,
    _unlink_quietly,
    _Worker,
    _write_atomically,
)
from dataflux_ckpt.upload import UploadStopped, upload_file
from lightning_storage_plugins.dcp import (
    LOCK_NAME,
    METADATA_NAME,
    SaveLock,
    ShardPlan,
    load_metadata,
    stamp_version,
)
from lightning_storage_plugins.errors import ConcurrentWriteError as SaveInProgressError
from lightning_storage_plugins.ordering import remove_local
from lightning_storage_plugins.owners import Owner

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
    from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["TIERED_SAVE_ID_PREFIX", "LoadVersion", "ShardedLocalTier", "choose_version"]

log = logging.getLogger(__name__)

DIR_PREFIX = "dcp-"
JOB_PREFIX = ".job-"
JOB_SUFFIX = ".json"
JOB_TEMP_SUFFIX = ".json-tmp"
MARKER_SUFFIX = ".uploaded"
PENDING_SUFFIX = ".pending"
RECOVERY_LOCK_NAME = ".dcp-recovery.lock"
MANIFEST_FORMAT = 1
MARKER_FORMAT = 1
#: What the ``save_id`` of a checkpoint's ``storage_meta`` begins with when a tiered save published it.
TIERED_SAVE_ID_PREFIX = "tiered-"
TOKEN_HEX = 12
TOKEN_TIME_HEX = 11  # milliseconds since the epoch, for 557 years
# Per item, what FastPersist writes besides its bytes (the torch.save records around them), and per shard.
ITEM_OVERHEAD_BYTES = 4096
SHARD_OVERHEAD_BYTES = 1 * 2**20
# The coordinator looks again for the markers after this long, doubling up to the maximum.
PUBLISH_POLL_INITIAL_S = 0.25
PUBLISH_POLL_MAX_S = 10.0
# Objects of other saves created this long before a publishing save began are leftovers of saves
# that are over, whatever their token (the margin covers the clocks of the coordinator and of GCS).
LEFTOVER_MARGIN_S = 60.0

WRITING, WRITTEN, UPLOADED, PUBLISHED, SUPERSEDED = "writing", "written", "uploaded", "published", "superseded"
LOCAL_ONLY = "local"  # a save of a round ``remote_every`` skips: whole on the node, never uploaded
_STATES = (WRITING, WRITTEN, UPLOADED, PUBLISHED, SUPERSEDED, LOCAL_ONLY)
_OVER = (PUBLISHED, SUPERSEDED)

_SHARD_RE = re.compile(r"^__(?P<rank>\d+)_(?P<index>\d+)\.(?P<token>[0-9a-f]+)\.distcp")
_PENDING_RE = re.compile(rf"^\.metadata\.(?P<token>[0-9a-f]+){re.escape(PENDING_SUFFIX)}$")
_TOKEN_RE = re.compile(rf"^[0-9a-f]{{{TOKEN_HEX}}}$")
_LAST_RE = re.compile(r"^last(-v?\d+)?\.ckpt$")
_JOB_RE = re.compile(rf"^{re.escape(JOB_PREFIX)}(?P<token>[0-9a-f]{{{TOKEN_HEX}}})-(?P<who>\d+|metadata)"
                     rf"{re.escape(JOB_SUFFIX)}$")


# Tokens --------------------------------------------------------------------------------------------
def ordered_save_id(after: str | None = None) -> str:
    """A new ``save_id`` whose first ``TOKEN_HEX`` digits (the save's token) order saves by this
    clock: milliseconds since the epoch, then a random digit; later than ``after`` when given."""
    millis = time.time_ns() // 1_000_000
    if after is not None and _TOKEN_RE.match(after[:TOKEN_HEX]):
        millis = max(millis, int(after[:TOKEN_TIME_HEX], 16) + 1)
    return f"{millis:0{TOKEN_TIME_HEX}x}" + secrets.token_hex(16)[: 32 - TOKEN_TIME_HEX]


def token_time(token: str) -> float:
    """When the save of ``token`` began (seconds since the epoch, by its coordinator's clock)."""
    return int(token[:TOKEN_TIME_HEX], 16) / 1000.0


def token_of(name: str) -> str | None:
    """The token of a save's object or file name (a shard, its parts or marker, a pending metadata)."""
    match = _SHARD_RE.match(name) or _PENDING_RE.match(name)
    return match["token"] if match else None


def shard_rank(name: str) -> tuple[int, str]:
    """The rank and token a shard file's name holds.

    Raises:
        ValueError: ``name`` is not a shard file's name.
    """
    match = _SHARD_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not the name of a DCP shard file")
    return int(match["rank"]), match["token"]


def pending_name(token: str) -> str:
    return f"{METADATA_NAME}.{token}{PENDING_SUFFIX}"


def local_metadata_name(token: str) -> str:
    return f"{METADATA_NAME}.{token}"


def _tiered_token(metadata: Metadata) -> str | None:
    """The token of a checkpoint a tiered save published (``None`` for any other checkpoint)."""
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None) or ""
    token = save_id[len(TIERED_SAVE_ID_PREFIX) :][:TOKEN_HEX] if save_id.startswith(TIERED_SAVE_ID_PREFIX) else ""
    return token if _TOKEN_RE.match(token) else None


# Manifests -----------------------------------------------------------------------------------------
def _positive_int(name: str, value: Any, *, optional: bool = True, zero: bool = True) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ManifestError(f"job manifest field {name!r} must be a {'count' if zero else 'positive integer'}, "
                            f"not {value!r}")


@dataclass(frozen=True)
class _JobManifest:
    """What the local tier knows of one file of one save on this node: a rank's shard, or the
    checkpoint's metadata (``rank`` ``None``), and how far its way to GCS has gone.

    Raises:
        ManifestError: a field is missing, of the wrong type or out of range (the message names it).
    """

    uri: str
    token: str
    rank: int | None
    name: str
    saved_at: float
    owner: str
    state: str
    size: int | None = None
    crc32c: str | None = None
    generation: int | None = None
    block_size: int = CRC_BLOCK_BYTES
    items: tuple[tuple[int, int], ...] = ()
    block_crcs: tuple[tuple[int, ...], ...] | None = None
    remote: bool = True

    def __post_init__(self) -> None:
        try:
            parse_gcs_path(self.uri)
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"job manifest field 'uri': {exc}") from None
        if not isinstance(self.token, str) or not _TOKEN_RE.match(self.token):
            raise ManifestError(f"job manifest field 'token' must be {TOKEN_HEX} hex digits, not {self.token!r}")
        _positive_int("rank", self.rank)
        if self.rank is None:
            named = self.name == local_metadata_name(self.token)
        else:
            match = _SHARD_RE.match(self.name) if isinstance(self.name, str) else None
            named = match is not None and (match["token"], int(match["rank"])) == (self.token, self.rank)
        if not named:
            raise ManifestError(f"job manifest field 'name' {self.name!r} is not the file of rank {self.rank} of "
                                f"save {self.token}")
        if (isinstance(self.saved_at, bool) or not isinstance(self.saved_at, (int, float))
                or not math.isfinite(self.saved_at)):
            raise ManifestError(f"job manifest field 'saved_at' must be a time, not {self.saved_at!r}")
        if not isinstance(self.owner, str) or Owner.from_token(self.owner) is None:
            raise ManifestError(f"job manifest field 'owner' must be an owner token, not {self.owner!r}")
        if self.state not in _STATES:
            raise ManifestError(f"job manifest field 'state' must be one of {_STATES}, not {self.state!r}")
        _positive_int("size", self.size)
        if self.state != WRITING and self.size is None:
            raise ManifestError(f"job manifest in state {self.state!r} has no size")
        if self.crc32c is not None and _crc_text(self.crc32c) is None:
            raise ManifestError(f"job manifest field 'crc32c' must be a base64 crc32c or null, not {self.crc32c!r}")
        _positive_int("generation", self.generation, zero=False)
        _positive_int("block_size", self.block_size, optional=False, zero=False)
        if not isinstance(self.remote, bool):
            raise ManifestError(f"job manifest field 'remote' must be true or false, not {self.remote!r}")
        items = tuple(tuple(item) for item in self.items)
        if any(len(item) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in item)
               for item in items):
            raise ManifestError(f"job manifest field 'items' must be (offset, length) pairs, not {self.items!r}")
        object.__setattr__(self, "items", items)
        if self.block_crcs is not None:
            crcs = tuple(tuple(values) for values in self.block_crcs)
            if len(crcs) != len(items) or any(
                    len(values) != -(-length // self.block_size) for values, (_, length) in zip(crcs, items, strict=True)):
                raise ManifestError("job manifest field 'block_crcs' does not match its items and block size")
            object.__setattr__(self, "block_crcs", crcs)

    @property
    def pending(self) -> bool:
        """Whether something is left to do for this file on this node: its checksums and upload, or
        (the metadata's) the publish. A shard whose marker is in GCS waits for nothing more here: the
        coordinator, or the last rank, publishes. A save kept on the node only (``remote``
        false) waits for its checksums."""
        return self.state in (WRITING, WRITTEN) or (self.state == UPLOADED and self.rank is None)

    def replace(self, **changes: Any) -> _JobManifest:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> bytes:
        return json.dumps({"format": MANIFEST_FORMAT, **dataclasses.asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> _JobManifest:
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestError(f"not a job manifest: {exc}") from None
        if not isinstance(fields, dict) or fields.pop("format", None) != MANIFEST_FORMAT:
            raise ManifestError(f"not a job manifest of format {MANIFEST_FORMAT}")
        known = {field.name for field in dataclasses.fields(cls)}
        if set(fields) - known:
            raise ManifestError(f"job manifest fields {sorted(set(fields) - known)} are unknown")
        try:
            return cls(**fields)
        except TypeError as exc:  # a missing field
            raise ManifestError(f"job manifest: {exc}") from None


class _CheckpointDir:
    """The local tier's files of one checkpoint (one ``gs://`` prefix) on this node."""

    def __init__(self, root: str, uri: str) -> None:
        self.uri = uri
        self.path = os.path.join(root, DIR_PREFIX + _LocalTier.key(uri))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @staticmethod
    def job_name(token: str, rank: int | None) -> str:
        return f"{JOB_PREFIX}{token}-{'metadata' if rank is None else rank}{JOB_SUFFIX}"

    def read_job(self, token: str, rank: int | None) -> _JobManifest | None:
        """The manifest of a file of save ``token``; ``None`` when there is none or it is unreadable (logged)."""
        path = self.file(self.job_name(token, rank))
        try:
            with open(path, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return None
        try:
            return _JobManifest.from_json(data)
        except ManifestError as exc:
            log.warning("ignoring the local tier's manifest %s: %s", path, exc)
            return None

    def write_job(self, manifest: _JobManifest) -> None:
        name = self.job_name(manifest.token, manifest.rank)
        _write_atomically(self.file(name), manifest.to_json(), self.file(f".{uuid.uuid4().hex[:8]}{JOB_TEMP_SUFFIX}"))

    def jobs(self) -> list[_JobManifest]:
        """Every readable manifest of this checkpoint on the node."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _JOB_RE.match(name)
            if match is None:
                continue
            who = match["who"]
            manifest = self.read_job(match["token"], None if who == "metadata" else int(who))
            if manifest is not None and manifest.uri == self.uri:
                found.append(manifest)
        return found

    def remove_save(self, token: str, *, free_now: bool = False) -> None:
        """Remove every file of save ``token`` from this node: its manifests last (until then a
        later clean-up still finds what is left)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return
        data = [name for name in names if token_of(name) == token or name == local_metadata_name(token)]
        for name in data:
            if free_now:
                _unlink_quietly(self.file(name))
            else:
                remove_local(self.file(name))
        for name in names:
            if (match := _JOB_RE.match(name)) and match["token"] == token:
                _unlink_quietly(self.file(name))

    def remove_if_empty(self) -> None:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return
        if all(name in (LOCK_NAME,) or name.endswith(JOB_TEMP_SUFFIX) for name in names):
            for name in names:
                _unlink_quietly(self.file(name))
            with contextlib.suppress(OSError):  # another rank of the node is saving here again
                os.rmdir(self.path)


def _checkpoint_dirs(root: str) -> Iterable[tuple[str, list[_JobManifest]]]:
    """Each checkpoint directory of the local tier ``root``, with its manifests."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        path = os.path.join(root, name)
        manifests = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.listdir(path):
                if _JOB_RE.match(entry):
                    with contextlib.suppress(FileNotFoundError), open(os.path.join(path, entry), "rb") as file:
                        try:
                            manifests.append(_JobManifest.from_json(file.read()))
                        except ManifestError as exc:
                            log.warning("ignoring the local tier's manifest %s: %s", os.path.join(path, entry), exc)
        yield path, manifests


# Checksums of a shard file ------------------------------------------------------------------------
def _shard_checksums(fd: int, size: int, items: Sequence[tuple[int, int]], block_size: int,
                     stop: Callable[[], bool] | None = None) -> tuple[int, list[tuple[int, ...]]]:
    """The crc32c of the first ``size`` bytes of ``fd``, and of every ``block_size`` bytes of each
    item (``(offset, length)``), in one pass over the file.

    Raises:
        DataCorruptionError: the file is shorter than ``size`` or than an item's end.
        UploadStopped: ``stop`` answered ``True`` between blocks.
    """
    order = sorted(range(len(items)), key=lambda index: items[index][0])
    crcs = [_BlockCrcs(block_size) for _ in items]
    whole, next_item = 0, 0
    open_items: list[int] = []
    for offset, view in mapped_blocks(fd, size, "a shard of the local tier"):
        if stop is not None and stop():
            raise UploadStopped("checksum stopped")
        end = offset + view.nbytes
        whole = crc32c_extend(whole, view)
        while next_item < len(order) and items[order[next_item]][0] < end:
            open_items.append(order[next_item])
            next_item += 1
        still_open = []
        for index in open_items:
            start, length = items[index]
            lo, hi = max(start, offset), min(start + length, end)
            if hi > lo:
                crcs[index].update(view[lo - offset : hi - offset])
            if start + length > end:
                still_open.append(index)
        open_items = still_open
    if any(start + length > size for start, length in items):
        raise DataCorruptionError(f"an item ends after the file's {size} bytes")
    return whole, [crc.values() for crc in crcs]


# The save lock of the training path ----------------------------------------------------------------
class _LocalSaveLock(SaveLock):
    """The coordinator's right to save one checkpoint on its node, for the planning and the local
    writes: an exclusive ``flock`` on the checkpoint directory's ``.dcp-save.lock`` (the kernel lets go
    when the process dies). GCS's save lock is taken by the publish, in the background."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self._directory = directory
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SaveInProgressError(f"{directory}: another save to this checkpoint is in progress on this node (it "
                                      f"holds {LOCK_NAME} in the local tier); this save wrote nothing",
                                      target=directory) from None
        self._fd: int | None = fd

    def confirm(self) -> float:
        if self._fd is None:
            raise SaveInProgressError(f"{self._directory}: the save lock was already let go", target=self._directory)
        return math.inf

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# Background work -----------------------------------------------------------------------------------
class _Job:
    """One file of one save on its way to GCS: a rank's shard, or the checkpoint's metadata."""

    def __init__(self, directory: _CheckpointDir, manifest: _JobManifest, fd: int, connection: _Connection,
                 started: float) -> None:
        self.directory, self.manifest, self.fd, self.connection = directory, manifest, fd, connection
        self.started = started
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.running = False
        #: The metadata's next look for the markers, while it waits for it.
        self.timer: threading.Timer | None = None
        self.pause = PUBLISH_POLL_INITIAL_S
        self.publish_by = time.monotonic() + connection.options.deadline_s

    @property
    def key(self) -> tuple[str, str, int | None]:
        return self.manifest.uri, self.manifest.token, self.manifest.rank

    def record(self, **changes: Any) -> _JobManifest | None:
        """Update the manifest on disk (unless the save was removed from the local tier meanwhile)."""
        current = self.directory.read_job(self.manifest.token, self.manifest.rank)
        if current is None:
            self.cancelled.set()
            return None
        self.manifest = current.replace(**changes)
        self.directory.write_job(self.manifest)
        return self.manifest

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        what = "metadata" if self.manifest.rank is None else f"shard of rank {self.manifest.rank}"
        return f"{self.manifest.uri} ({what}, save {self.manifest.token})"


class _Stop(Exception):
    """The job was cancelled, or the tier is closing."""


# The tier --------------------------------------------------------------------------------------------
class ShardedLocalTier:
    """The local tier of sharded (DCP) checkpoints on this node, and this process' uploads to GCS.

    Give it to :class:`~dataflux_ckpt.DatafluxStorageWriter` and
    :class:`~dataflux_ckpt.DatafluxStorageReader` as ``local_dir`` (they also take the directory,
    and then make one each); the strategies make one per process from their ``local_dir``. One tier
    serves any number of saves, of any checkpoints, one after another or in threads; the ranks of a
    node share its directory. See :mod:`dataflux_ckpt.tiered_dcp` for what it does.

    Args:
        local_dir: the local tier's directory (a node-local NVMe filesystem; the same for the ranks
            of a node, so that a resharded load finds their files).
        remote_every: upload every N-th save round to GCS (``1``: every one); the saves of the
            other rounds stay on the node's local tier only. The coordinator's tier counts the
            rounds: a save is one, and under the Lightning strategies the saves of one
            ``global_step`` (a step's checkpoint and ``last.ckpt``) are one.
        keep_local: the local tier keeps the newest K saves (of any checkpoint); an older one
            leaves it once nothing of it is left to upload. ``None``: no limit.
        min_free_bytes: bytes a save must leave free on the local filesystem.
        teardown_timeout_s: how long :meth:`close` waits for the uploads in flight.
        io_buffer_mb: FastPersist's staging buffer (MiB).
        engine: FastPersist's engine (``"aio"``, ``"python"``, ``"gds"``; default ``"aio"``).
        project_name, storage_client, options: the GCS client and the transfer options of the
            uploads (those of the writer that saves, for its saves; these for the uploads a
            crashed process left, which :meth:`finish_pending` takes over).

    Raises:
        ImportError: the ``[nvme]`` extra (FastPersist and DeepSpeed) is not installed.
        TypeError, ValueError: an option is of the wrong type or out of range (the message names it).
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        *,
        remote_every: int = 1,
        keep_local: int | None = DEFAULT_KEEP_LOCAL,
        min_free_bytes: int = 0,
        teardown_timeout_s: float = DEFAULT_TEARDOWN_TIMEOUT_S,
        io_buffer_mb: float = 256,
        engine: str | None = None,
        project_name: str | None = None,
        storage_client: Any = None,
        options: TransferOptions | None = None,
    ) -> None:
        #: The local tier's options, checked.
        self.tier_options = TieredOptions(local_dir=local_dir, remote_every=remote_every, keep_local=keep_local,
                                          min_free_bytes=min_free_bytes, teardown_timeout_s=teardown_timeout_s,
                                          io_buffer_mb=io_buffer_mb, engine=engine)
        _fastpersist(self.tier_options.engine, "a DCP save with local_dir")
        if options is not None and not isinstance(options, TransferOptions):
            raise TypeError(f"ShardedLocalTier: options must be a TransferOptions, not {options!r}")
        self._connection = _Connection(project_name, storage_client, options or TransferOptions())
        self._start_process_state()

    def _start_process_state(self) -> None:
        self._pid = os.getpid()
        self._owner = Owner.current()
        self._lock = threading.RLock()
        self._jobs: dict[tuple[str, str, int | None], _Job] = {}
        self._uploader: _Worker | None = None
        self._publisher: _Worker | None = None
        self._context: Any = None
        self._writing = False
        self._stats = TieredStats()
        self._rounds = _SaveRounds(self.tier_options.remote_every)

    def _in_this_process(self) -> None:
        """Start over in a forked child: the parent's threads and open files stay the parent's."""
        if self._pid != os.getpid():
            self._start_process_state()

    def __getstate__(self) -> dict[str, Any]:
        return {"tier_options": self.tier_options, "_connection": self._connection}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_process_state()

    def __enter__(self) -> ShardedLocalTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def local_dir(self) -> str:
        """The local tier's directory (absolute)."""
        return self.tier_options.local_dir

    def __repr__(self) -> str:
        return f"ShardedLocalTier({self.local_dir!r})"

    def _dir(self, uri: str) -> _CheckpointDir:
        return _CheckpointDir(self.local_dir, uri)

    # Observability ------------------------------------------------------------------------------
    def stats(self) -> TieredStats:
        """What this tier did in this process so far: local saves and how long each rank waited for
        them, uploads pending, done and failed, and how long the last checkpoint it published took
        from its save to its publish."""
        with self._lock:
            pending = sum(1 for job in self._jobs.values() if job.manifest.remote)
            return dataclasses.replace(self._stats, uploads_pending=pending)

    def _count(self, **changes: Any) -> None:
        with self._lock:
            self._stats = dataclasses.replace(self._stats, **changes)

    # Becoming a writer ------------------------------------------------------------------------------
    def finish_pending(self) -> int:
        """Become one of the local tier's writers: remove what crashed writers left half-written, and
        take over, in the background, the uploads and publishes of processes that are certainly
        gone (a restart on the same node). A save calls it first; call it yourself to finish them
        without saving.

        Returns:
            How many files' uploads or publishes were taken over.
        """
        self._in_this_process()
        with self._lock:
            first = not self._writing
            if first:
                os.makedirs(self.local_dir, exist_ok=True)
                self._uploader = _Worker("dataflux-tiered-dcp-upload", self._run_upload)
                self._publisher = _Worker("dataflux-tiered-dcp-publish", self._run_publish)
                self._writing = True
        if not first:
            return 0
        return self._take_over()

    def _take_over(self) -> int:
        fd = os.open(os.path.join(self.local_dir, RECOVERY_LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        taken = []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one process of the node claims the orphans at a time
            fastpersist = _fastpersist(self.tier_options.engine, "a DCP save with local_dir")
            for path, manifests in _checkpoint_dirs(self.local_dir):
                fastpersist.remove_stale_temporaries(path)
                for manifest in sorted(manifests, key=lambda m: (m.token, -1 if m.rank is None else m.rank)):
                    if not manifest.pending:
                        continue
                    owner = Owner.from_token(manifest.owner)
                    reason = owner.gone(self._owner) if owner is not None else "its owner is unreadable"
                    if reason is None:
                        continue
                    directory = self._dir(manifest.uri)
                    if manifest.state == WRITING:
                        log.warning("removing the half-written %s of save %s of %s from the local tier (%s)",
                                    manifest.name, manifest.token, manifest.uri, reason)
                        _unlink_quietly(directory.file(manifest.name))
                        _unlink_quietly(directory.file(directory.job_name(manifest.token, manifest.rank)))
                        continue
                    claimed = manifest.replace(owner=self._owner.token())
                    directory.write_job(claimed)
                    taken.append((directory, claimed, reason))
                self._remove_unclaimed(path)
        finally:
            os.close(fd)
        for directory, manifest, reason in taken:
            log.info("finishing the %s of %s that a previous writer left pending (%s)",
                     "publish" if manifest.rank is None else
                     f"{'upload' if manifest.remote else 'checksums'} of rank {manifest.rank}'s shard",
                     manifest.uri, reason)
            self._queue(directory, manifest, self._connection, time.perf_counter())
        self._evict()
        return len(taken)

    def _remove_unclaimed(self, path: str) -> None:
        """Remove files of this checkpoint directory that no manifest names (a removal or an
        eviction that was killed before its manifests went), and manifest temporaries of writes
        killed midway (a write takes milliseconds: one older than a minute is over)."""
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return
        for name in names:
            file = os.path.join(path, name)
            if name.endswith(JOB_TEMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - os.stat(file).st_mtime > LEFTOVER_MARGIN_S:
                        _unlink_quietly(file)
                continue
            match = _SHARD_RE.match(name)
            if match:
                job = _CheckpointDir.job_name(match["token"], int(match["rank"]))
            elif name.startswith(METADATA_NAME + "."):
                job = _CheckpointDir.job_name(name[len(METADATA_NAME) + 1 :], None)
            else:
                continue
            # A writer names its file in a manifest before the file exists: asked now, not from the
            # listing, the manifest of a file a live writer just made is there.
            if not os.path.exists(os.path.join(path, job)):
                remove_local(file)

    # Saving (the training path) ------------------------------------------------------------------
    def _next_round(self, key: object = None) -> bool:
        """Count a save (the coordinator's, as it plans it) of round ``key``; whether it goes to
        GCS (see ``remote_every``)."""
        self._in_this_process()
        return self._rounds.next(key)

    def _save_lock(self, uri: str) -> SaveLock:
        """The coordinator's lock on saving ``uri`` from this node, held from planning to its local
        metadata (see :class:`_LocalSaveLock`).

        Raises:
            ConcurrentWriteError: another save to ``uri`` is in progress on this node.
        """
        self._in_this_process()
        return _LocalSaveLock(self._dir(uri).path)

    def _save_shard(self, uri: str, name: str, items: Sequence[WriteItem], planner: SavePlanner,
                   connection: _Connection, block_size: int, remote: bool = True) -> list[WriteResult]:
        """Write this rank's items to its local file ``name`` with FastPersist, record it, and queue
        its checksums and (``remote``) its upload; what training waits for.

        Raises:
            LocalTierFullError: the local filesystem has no room for the shard (nothing written).
            ValueError: ``name`` is not a shard file's name.
            OSError: the local write failed (its file is removed).
        """
        from torch.distributed.checkpoint.planner import SavePlan

        started = time.perf_counter()
        self.finish_pending()
        rank, token = shard_rank(name)
        directory = self._dir(uri)
        os.makedirs(directory.path, exist_ok=True)
        self._make_room(_estimated_bytes(items, planner))
        manifest = _JobManifest(uri, token, rank, name, time.time(), self._owner.token(), WRITING,
                                block_size=block_size, remote=remote)
        directory.write_job(manifest)
        fastpersist = _fastpersist(self.tier_options.engine, "a DCP save with local_dir")
        try:
            with self._lock:
                if self._context is None:
                    self._context = fastpersist.FastPersistContext(engine=self.tier_options.engine,
                                                                   io_buffer_mb=self.tier_options.io_buffer_mb)
                context = self._context
            writer = fastpersist.FastPersistStorageWriter(directory.path, context=context)
            results = writer.write_data(SavePlan(list(items), storage_data=ShardPlan(rank, token)), planner).value()
            fd = os.open(directory.file(name), os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            _unlink_quietly(directory.file(name))
            _unlink_quietly(directory.file(directory.job_name(token, rank)))
            raise
        try:
            spans = tuple((result.storage_data.offset, result.storage_data.length) for result in results)
            manifest = manifest.replace(state=WRITTEN, size=os.fstat(fd).st_size, items=spans,
                                        saved_at=time.time())
            directory.write_job(manifest)
        except BaseException:
            os.close(fd)
            raise
        self._add_job(_Job(directory, manifest, fd, connection, started))
        waited = time.perf_counter() - started
        with self._lock:
            self._count(saves=self._stats.saves + 1, last_save_s=waited, total_save_s=self._stats.total_save_s + waited)
        log.info("saved rank %d's shard of %s to the local tier (%d bytes) in %.3f s; %s", rank, uri, manifest.size,
                 waited, "uploading it in the background" if remote else
                 f"not uploaded (remote_every={self.tier_options.remote_every})")
        self._evict()
        return results

    def _commit(self, uri: str, token: str, metadata: bytes, connection: _Connection, remote: bool = True) -> None:
        """Write the checkpoint's metadata (the coordinator's) beside its shards, and queue its
        publish (``remote``): the save is whole on the local tier once this returns.

        Raises:
            OSError: the local write failed (nothing of it is left).
        """
        self.finish_pending()
        directory = self._dir(uri)
        name = local_metadata_name(token)
        manifest = _JobManifest(uri, token, None, name, time.time(), self._owner.token(), WRITING, remote=remote)
        directory.write_job(manifest)
        try:
            _write_atomically(directory.file(name), metadata, directory.file(f".{uuid.uuid4().hex[:8]}{JOB_TEMP_SUFFIX}"))
            fd = os.open(directory.file(name), os.O_RDONLY | os.O_CLOEXEC) if remote else -1  # for its publish
        except BaseException:
            _unlink_quietly(directory.file(name))
            _unlink_quietly(directory.file(directory.job_name(token, None)))
            raise
        manifest = manifest.replace(state=WRITTEN if remote else LOCAL_ONLY, size=len(metadata),
                                    crc32c=crc32c_b64(crc32c_extend(0, metadata)))
        try:
            directory.write_job(manifest)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        if not remote:
            log.info("saved %s (save %s) to the local tier only (remote_every=%d)", uri, token,
                     self.tier_options.remote_every)
            return
        self._add_job(_Job(directory, manifest, fd, connection, time.perf_counter()))

    def _abort(self, uri: str, token: str, rank: int | None) -> None:
        """Forget a failed save's files of this process: stop their uploads, delete what they put in
        GCS (best effort), and remove them from the local tier."""
        self._in_this_process()
        directory = self._dir(uri)
        with self._lock:
            jobs = [job for key, job in self._jobs.items() if key[:2] == (uri, token) and key[2] in (rank, None)]
        self._stop_jobs(jobs)
        for job in jobs:
            self._delete_objects(job, [job.manifest.name, job.manifest.name + MARKER_SUFFIX]
                                 if job.manifest.rank is not None else [pending_name(token)])
        for who in {rank, None}:
            manifest = directory.read_job(token, who)
            if manifest is not None and manifest.owner == self._owner.token():
                _unlink_quietly(directory.file(manifest.name))
                _unlink_quietly(directory.file(directory.job_name(token, who)))

    def _forget(self, uri: str) -> None:
        """Stop this process' uploads and publishes of ``uri`` and remove the checkpoint from this
        node's local tier (before it is removed from GCS)."""
        self._in_this_process()
        with self._lock:
            jobs = [job for key, job in self._jobs.items() if key[0] == uri]
        self._stop_jobs(jobs)
        directory = self._dir(uri)
        for token in {manifest.token for manifest in directory.jobs()}:
            directory.remove_save(token)
        directory.remove_if_empty()

    def _stop_jobs(self, jobs: Sequence[_Job]) -> None:
        for job in jobs:
            job.cancelled.set()
            self._let_go(job)
        timeout = self._connection.options.cleanup_timeout_s + self._connection.options.request_timeout_s
        for job in jobs:
            if not job.finished.wait(timeout):
                log.warning("the upload of %s did not stop within %g s; it publishes nothing", job, timeout)

    def _delete_objects(self, job: _Job, names: Sequence[str]) -> None:
        base = parse_gcs_path(job.manifest.uri)
        gcs = job.connection.gcs
        deadline = Deadline(job.connection.options.cleanup_timeout_s, "clean-up", job.manifest.uri)
        for name in names:
            try:
                gcs.delete(base.bucket, f"{base.key}/{name}", deadline)
            except Exception as exc:  # a later publish removes what is left
                log.warning("could not delete gs://%s/%s/%s (%s)", base.bucket, base.key, name, exc)

    def _make_room(self, needed: int) -> None:
        """Check, before writing, that the local filesystem can take ``needed`` more bytes; evict
        early the saves this one pushes out of the newest ``keep_local`` where that makes room.

        Raises:
            LocalTierFullError: not enough room.
        """
        def room() -> int:
            stats = os.statvfs(self.local_dir)
            return stats.f_bavail * stats.f_frsize - self.tier_options.min_free_bytes

        if needed <= room():
            return
        for directory, token in self._evictable(extra=1):
            log.info("evicting save %s of %s from the local tier early to make room for a new shard",
                     token, directory.uri)
            directory.remove_save(token, free_now=True)
            if needed <= room():
                return
        stats = os.statvfs(self.local_dir)
        free = stats.f_bavail * stats.f_frsize
        raise LocalTierFullError(
            errno.ENOSPC,
            f"the local tier {self.local_dir} has {free} bytes free, and this rank's shard needs about {needed} "
            f"(plus min_free_bytes={self.tier_options.min_free_bytes}); nothing was written. Free space, lower "
            "keep_local or point local_dir at a larger disk", self.local_dir)

    def _evictable(self, *, extra: int = 0) -> list[tuple[_CheckpointDir, str]]:
        """The saves beyond the newest ``keep_local`` of the local tier (counting ``extra`` newer ones
        to come), oldest first, of which nothing is left to upload or publish."""
        limit = self.tier_options.keep_local
        if limit is None:
            return []
        saves: dict[tuple[str, str], list[_JobManifest]] = {}
        for _, manifests in _checkpoint_dirs(self.local_dir):
            for manifest in manifests:
                saves.setdefault((manifest.uri, manifest.token), []).append(manifest)
        newest_first = sorted(saves, key=lambda key: key[1], reverse=True)
        keep = max(limit - extra, 0)
        return [(self._dir(uri), token) for uri, token in reversed(newest_first[keep:])
                if not any(manifest.pending for manifest in saves[(uri, token)])]

    def _evict(self) -> None:
        for directory, token in self._evictable():
            log.debug("evicting save %s of %s from the local tier (keep_local=%s)", token, directory.uri,
                      self.tier_options.keep_local)
            directory.remove_save(token)
            directory.remove_if_empty()

    # Background ----------------------------------------------------------------------------------
    def _add_job(self, job: _Job) -> None:
        with self._lock:
            self._jobs[job.key] = job
        (self._publisher if job.manifest.rank is None else self._uploader).put(job)  # type: ignore[union-attr]

    def _queue(self, directory: _CheckpointDir, manifest: _JobManifest, connection: _Connection,
               started: float) -> None:
        """Queue a job taken over from a crashed writer."""
        try:
            fd = os.open(directory.file(manifest.name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1
        if fd < 0 or os.fstat(fd).st_size != manifest.size:
            log.warning("the local copy %s of %s is missing or damaged; removing save %s from the local tier",
                        directory.file(manifest.name), manifest.uri, manifest.token)
            if fd >= 0:
                os.close(fd)
            directory.remove_save(manifest.token)
            return
        self._add_job(_Job(directory, manifest, fd, connection, started))

    def _let_go(self, job: _Job) -> None:
        """Finish ``job`` at once if it is not running: queued, or waiting to look for its markers again."""
        with self._lock:
            timer, job.timer = job.timer, None
        if timer is not None:
            timer.cancel()
            self._finish(job)
        for worker in (self._uploader, self._publisher):
            if worker is not None and worker.discard(job):
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        job.close()
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
        job.finished.set()

    def _stopping(self, job: _Job) -> Callable[[], bool]:
        worker = self._publisher if job.manifest.rank is None else self._uploader
        return lambda: job.cancelled.is_set() or worker is None or worker.stopping

    def _retrying(self, job: _Job, what: str, step: Callable[[], Any]) -> Any:
        """Run ``step`` until it succeeds, trying again after a failure (1 s, doubling to 60 s), as
        long as the job is not stopped; a failure is logged as a warning.

        Raises:
            _Stop: the job was cancelled, or the tier is closing.
        """
        stopping = self._stopping(job)
        worker = self._publisher if job.manifest.rank is None else self._uploader
        attempts = 0
        while True:
            if stopping():
                raise _Stop
            try:
                return step()
            except (_Stop, UploadStopped):
                raise _Stop from None
            except (ConcurrentWriteError, DataCorruptionError):
                raise
            except Exception as exc:
                attempts += 1
                delay = min(RETRY_INITIAL_S * 2 ** (attempts - 1), RETRY_MAX_S)
                self._count(upload_failures=self._stats.upload_failures + 1)
                log.warning("%s of %s failed (attempt %d: %s); trying again in %.0f s. Training goes on: the "
                            "checkpoint is whole on the local tier, but not durable until it is published in GCS",
                            what, job, attempts, exc, delay)
                assert worker is not None
                worker.sleep(delay, stopping)

    @contextlib.contextmanager
    def _running(self, job: _Job, what: str) -> Iterator[list[bool]]:
        """Run ``job``'s work (the ``with`` block): a stop or a refusal is logged, not raised; unless the
        block sets the yielded flag to ``False`` (the job comes back later), the job then ends, after an
        eviction (so that a wait for it sees the local tier as it stays)."""
        job.running = True
        done = [True]
        try:
            yield done
        except _Stop:
            log.info("stopped the %s of %s", what, job)
        except (ConcurrentWriteError, DataCorruptionError) as exc:
            log.warning("gave up the %s of %s: %s", what, job, exc)
        finally:
            job.running = False
            if done[0]:
                try:
                    self._evict()
                finally:
                    self._finish(job)

    def _run_upload(self, job: _Job) -> None:
        """A rank's shard (the uploader thread): checksums, the upload, the marker, one publish attempt."""
        with self._running(job, "upload"):
            self._upload_shard(job)

    def _upload_shard(self, job: _Job) -> None:
        manifest = job.manifest
        stopping = self._stopping(job)
        base = parse_gcs_path(manifest.uri)
        target = GcsPath(base.bucket, f"{base.key}/{manifest.name}")
        if manifest.crc32c is None or manifest.block_crcs is None:
            assert manifest.size is not None
            whole, blocks = _shard_checksums(job.fd, manifest.size, manifest.items, manifest.block_size, stopping)
            if job.record(crc32c=crc32c_b64(whole), block_crcs=tuple(blocks)) is None:
                raise _Stop
        manifest = job.manifest
        if manifest.state == WRITTEN and not manifest.remote:  # its checksums were all it waited for
            if job.record(state=LOCAL_ONLY) is None:
                raise _Stop
            return
        if manifest.state == WRITTEN:
            assert manifest.size is not None and manifest.crc32c is not None
            crc = int.from_bytes(base64.b64decode(manifest.crc32c), "big")
            options = job.connection.options
            from dataflux_ckpt.upload import ObjectWriter

            def upload() -> int | None:
                writer = ObjectWriter(job.connection.gcs, target, chunk_size=options.chunk_size,
                                      max_workers=options.max_workers, mode=options.upload_mode,
                                      deadline_s=options.deadline_s, cleanup_timeout_s=options.cleanup_timeout_s)
                return upload_file(writer, job.fd, manifest.size or 0, expected_crc32c=crc, stop=stopping)

            try:
                generation = self._retrying(job, "the upload", upload)
            except ConcurrentWriteError:
                generation = None  # another upload of this very file (a writer that took it over) won
            info = job.connection.gcs.stat(target, self._deadline(job, "stat"))
            if (info.size, info.crc32c) != (manifest.size, manifest.crc32c):
                raise ConcurrentWriteError(manifest.uri, f"{target} holds other bytes than {job}'s local file")
            generation = generation or info.generation
            marker = json.dumps({"format": MARKER_FORMAT, "name": manifest.name, "size": manifest.size,
                                 "crc32c": manifest.crc32c, "generation": generation,
                                 "block_size": manifest.block_size, "items": [list(item) for item in manifest.items],
                                 "block_crcs": [list(crcs) for crcs in manifest.block_crcs or ()]}).encode()
            self._retrying(job, "the upload of the marker", lambda: job.connection.gcs.upload_object(
                GcsPath(base.bucket, f"{target.key}{MARKER_SUFFIX}"), memoryview(marker), crc32c_extend(0, marker),
                self._deadline(job, "upload")))
            if job.record(state=UPLOADED, generation=generation) is None:
                raise _Stop
            self._count(uploads_done=self._stats.uploads_done + 1)
            log.debug("uploaded %s (generation %s) and its marker", job, generation)
        if job.manifest.state == UPLOADED:
            self._publish(job)

    def _run_publish(self, job: _Job) -> None:
        """The checkpoint's metadata (the publisher thread): the pending metadata, then a look for the
        markers; while they are not all there, the job comes back after a pause (from 0.25 s,
        doubling to 10 s, for up to the transfer options' ``deadline_s``), so that the publisher
        serves the saves that follow meanwhile."""
        with self._running(job, "publish") as done:
            manifest = job.manifest
            base = parse_gcs_path(manifest.uri)
            if manifest.state == WRITTEN:
                data = os.pread(job.fd, manifest.size or 0, 0)
                if len(data) != manifest.size or crc32c_b64(crc32c_extend(0, data)) != manifest.crc32c:
                    raise DataCorruptionError(f"the local metadata of save {manifest.token} is damaged")
                self._retrying(job, "the upload of the pending metadata", lambda: job.connection.gcs.upload_object(
                    GcsPath(base.bucket, f"{base.key}/{pending_name(manifest.token)}"), memoryview(data),
                    crc32c_extend(0, data), self._deadline(job, "upload")))
                if job.record(state=UPLOADED) is None:
                    raise _Stop
            if not self._publish(job):
                if time.monotonic() + job.pause > job.publish_by:
                    log.warning("%s: not every rank's marker appeared in GCS within %g s of its save; it is not "
                                "published (the next writer of the local tier tries again)", job,
                                job.connection.options.deadline_s)
                else:
                    done[0] = False
                    self._look_again(job)

    def _look_again(self, job: _Job) -> None:
        def requeue() -> None:
            with self._lock:
                publisher = self._publisher
                job.timer = None
            if publisher is None or job.cancelled.is_set():
                self._finish(job)
            else:
                publisher.put(job)

        with self._lock:
            job.timer = threading.Timer(job.pause, requeue)
            job.timer.daemon = True
            job.timer.start()
        job.pause = min(job.pause * 2, PUBLISH_POLL_MAX_S)

    def _deadline(self, job: _Job, operation: str) -> Deadline:
        return Deadline(job.connection.options.deadline_s, operation, job.manifest.uri)

    def _publish(self, job: _Job) -> bool:
        """Publish the checkpoint of ``job``'s save if its pending metadata and every marker are in
        GCS, or learn that it was published or replaced; whether that is settled. A failure is
        logged (the coordinator looks again).

        Raises:
            DataCorruptionError: a marker does not describe the metadata's items.
        """
        try:
            outcome = _Publish(job.connection, job.manifest.uri, job.manifest.token).run()
        except DataCorruptionError:
            raise
        except Exception as exc:
            self._count(upload_failures=self._stats.upload_failures + 1)
            log.warning("the publish of %s failed (%s); %s", job, exc,
                        "trying again" if job.manifest.rank is None else "its coordinator tries again")
            return False
        if outcome in _OVER:
            self._over(job, outcome)
            return True
        log.debug("%s: not published yet, waiting for %s", job, outcome)
        if job.manifest.rank is None and self._newer_save_queued(job):
            log.info("%s: not published (it waited for %s); a newer save of the checkpoint is on its way", job,
                     outcome)
            self._over(job, SUPERSEDED)
            return True
        return False

    def _newer_save_queued(self, job: _Job) -> bool:
        """Whether this process saved the checkpoint again since, and that save is whole on every
        rank's local tier (its metadata was written): when every rank's uploads follow their saves'
        order, a save not published by then never will be."""
        with self._lock:
            return any(key[0] == job.manifest.uri and key[1] > job.manifest.token and key[2] is None
                       and other.manifest.state == UPLOADED for key, other in self._jobs.items())

    def _over(self, job: _Job, outcome: str) -> None:
        """Record that ``job``'s save was published (durable) or replaced in GCS."""
        if job.record(state=outcome) is None:
            return
        if outcome == PUBLISHED:
            if job.manifest.rank is None:
                durable_s = time.perf_counter() - job.started
                self._count(last_durable_s=durable_s, last_durable=job.manifest.uri)
                log.info("%s (save %s) is durable in GCS, %.2f s after its save", job.manifest.uri,
                         job.manifest.token, durable_s)
        else:
            log.info("%s: replaced in GCS by a newer save; this one stays on the local tier only", job)

    # Waiting and closing ---------------------------------------------------------------------------
    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until this process' uploads and publishes in flight are over (or ``timeout_s``,
        default ``teardown_timeout_s``), saying what for every 30 s.

        Returns:
            Whether they all ended.
        """
        self._in_this_process()
        timeout_s = self.tier_options.teardown_timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + timeout_s
        said = time.monotonic()
        while True:
            with self._lock:
                jobs = list(self._jobs.values())
            if not jobs:
                return True
            now = time.monotonic()
            if now >= end:
                return False
            if now - said >= PROGRESS_EVERY_S:
                log.info("waiting up to %.0f s for %d upload(s) to GCS: %s", end - now, len(jobs),
                         ", ".join(map(str, jobs)))
                said = now
            jobs[0].finished.wait(min(end - now, 1.0))

    def close(self, timeout_s: float | None = None) -> None:
        """Wait (up to ``timeout_s``, default ``teardown_timeout_s``) for the uploads and publishes in
        flight, then stop: what is left stays on the local tier, for the next writer (see
        :meth:`finish_pending`). The tier may be used again afterwards."""
        self._in_this_process()
        if not self.wait(timeout_s):
            with self._lock:
                jobs = list(self._jobs.values())
            log.warning("%d upload(s) to GCS did not finish within %g s: %s. They stay on the local tier %s and the "
                        "next process saving there finishes them", len(jobs),
                        self.tier_options.teardown_timeout_s if timeout_s is None else timeout_s,
                        ", ".join(map(str, jobs)), self.local_dir)
        with self._lock:
            jobs = list(self._jobs.values())
            uploader, publisher = self._uploader, self._publisher
            self._uploader = self._publisher = None
            self._writing = False
        for job in jobs:
            job.cancelled.set()
            with self._lock:
                timer, job.timer = job.timer, None
            if timer is not None:
                timer.cancel()
        cleanup = self._connection.options.cleanup_timeout_s
        for worker in (uploader, publisher):
            if worker is not None:
                worker.stop(cleanup)
        busy = [job for job in jobs if job.running and not job.finished.is_set()]
        if busy:
            log.warning("%s is still stopping after %g s; it ends on its own (nothing more of it is published)",
                        ", ".join(map(str, busy)), cleanup)
        for job in jobs:
            if job not in busy:  # a running one lets go of its file itself
                self._finish(job)
        with self._lock:
            context, self._context = self._context, None
        if context is not None:
            context.close()

    # Reading ---------------------------------------------------------------------------------------
    def last_checkpoints(self, directory: str) -> dict[str, str]:
        """The ``last`` checkpoints (``last.ckpt``, ``last-v1.ckpt``...) of the ``gs://`` ``directory``
        whose metadata this node holds: by ``gs://`` path, the local metadata file of the newest
        save (for ``ckpt_path="last"``, which dates the candidates by their files)."""
        prefix = directory.rstrip("/") + "/"
        newest: dict[str, _JobManifest] = {}
        for _, manifests in _checkpoint_dirs(self.local_dir):
            for manifest in manifests:
                name = manifest.uri[len(prefix) :] if manifest.uri.startswith(prefix) else ""
                if (manifest.rank is None and manifest.state != WRITING and _LAST_RE.match(name)
                        and (manifest.uri not in newest or manifest.token > newest[manifest.uri].token)):
                    newest[manifest.uri] = manifest
        return {uri: self._dir(uri).file(manifest.name) for uri, manifest in newest.items()
                if os.path.exists(self._dir(uri).file(manifest.name))}

    def checkpoint_of(self, path: str | os.PathLike[str]) -> str | None:
        """The ``gs://`` checkpoint whose local metadata file ``path`` is (``None`` for any other path)."""
        text = os.path.abspath(os.fspath(path))
        directory, name = os.path.split(text)
        if os.path.dirname(directory) != self.local_dir or not name.startswith(METADATA_NAME + "."):
            return None
        token = name[len(METADATA_NAME) + 1 :]
        for _, manifests in _checkpoint_dirs(self.local_dir):
            for manifest in manifests:
                if manifest.rank is None and manifest.token == token and self._dir(manifest.uri).path == directory:
                    return manifest.uri
        return None

    def _local_saves(self, uri: str) -> dict[str, dict[str, Any]]:
        """What this node holds of ``uri``, by save token: whether its metadata is here
        (``"metadata"``: its path), and which shard files are here whole by size (``"shards"``:
        name → (path, size, crc32c or ``None``))."""
        self._in_this_process()
        directory = self._dir(uri)
        saves: dict[str, dict[str, Any]] = {}
        for manifest in directory.jobs():
            if manifest.state == WRITING:
                continue
            path = directory.file(manifest.name)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            if size != manifest.size:
                log.warning("the local copy %s is %d bytes, not the %s written; not loading it", path, size,
                            manifest.size)
                continue
            save = saves.setdefault(manifest.token, {"metadata": None, "shards": {}})
            if manifest.rank is None:
                save["metadata"] = path
            else:
                save["shards"][manifest.name] = (path, size, manifest.crc32c)
        return saves

    def _holds(self, uri: str) -> bool:
        """Whether this node holds a save of ``uri`` whole by size: its metadata and every file it names."""
        for save in self._local_saves(uri).values():
            needed = _files_named(save["metadata"])
            if needed is not None and set(needed) <= set(save["shards"]):
                return True
        return False

    def _read_local(self, uri: str, name: str, path: str, size: int, crc32c: str | None) -> _LocalCopy:
        """The local file ``path`` (``name`` of ``uri``) read whole into memory, once its size and,
        where recorded, its crc32c match.

        Raises:
            DataCorruptionError: they do not.
            OSError: it cannot be read.
        """
        base = parse_gcs_path(uri)
        copy = _LocalCopy(GcsPath(base.bucket, f"{base.key}/{name}"), path, size, crc32c)
        try:
            copy.verify()  # every byte read, and checked where the crc32c is known
        except BaseException:
            copy.abandon()
            raise
        return copy


def _estimated_bytes(items: Sequence[WriteItem], planner: SavePlanner) -> int:
    """About the bytes FastPersist writes for ``items``: each tensor's bytes, each pickled item's, and
    the records around them."""
    import torch
    from torch.distributed.checkpoint.planner import WriteItemType

    total = SHARD_OVERHEAD_BYTES
    for item in items:
        total += ITEM_OVERHEAD_BYTES
        if item.type == WriteItemType.BYTE_IO:
            total += planner.resolve_data(item).getbuffer().nbytes
        elif item.tensor_data is not None:
            element = torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
            total += math.prod(item.tensor_data.chunk.sizes) * element
    return total


# The publish -------------------------------------------------------------------------------------
class _Publish:
    """One look at a save's objects in GCS, and its publish when they are all there.

    ``run()`` answers ``published`` (the checkpoint's ``.metadata`` is this save's, now or before),
    ``superseded`` (GCS holds a newer checkpoint, or the save was removed), or what it still waits
    for (a sentence).
    """

    def __init__(self, connection: _Connection, uri: str, token: str) -> None:
        self.connection, self.uri, self.token = connection, uri, token
        self.gcs = connection.gcs
        self.base = parse_gcs_path(uri)
        self.deadline = Deadline(connection.options.deadline_s, "publish", uri)

    def _object(self, name: str) -> GcsPath:
        return GcsPath(self.base.bucket, f"{self.base.key}/{name}")

    def _read(self, name: str) -> bytes | None:
        return _read_small(self.gcs, self._object(name), self.deadline)

    def run(self) -> str:
        objects, _ = self.gcs.list_objects(self.base.bucket, self.base.key + "/", self.deadline)
        listed = {item.name[len(self.base.key) + 1 :]: item for item in objects}
        state = self._current(listed)
        if state is not None:
            return state
        if pending_name(self.token) not in listed:
            return f"the pending metadata of save {self.token}"
        data = self._read(pending_name(self.token))
        if data is None:
            return f"the pending metadata of save {self.token}"
        metadata = load_metadata(data, f"{self.uri}/{pending_name(self.token)}")
        shards = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
        missing = [name for name in shards if name + MARKER_SUFFIX not in listed or name not in listed]
        if missing:
            return f"the markers of {', '.join(missing)}"
        return self._publish_locked(metadata, shards)

    def _current(self, listed: dict[str, Any]) -> str | None:
        """``published`` or ``superseded`` when GCS's checkpoint is this save's or newer; else ``None``."""
        if METADATA_NAME not in listed:
            return None
        data = self._read(METADATA_NAME)
        if data is None:
            return None
        return _compare(data, listed[METADATA_NAME].generation, self.token, f"{self.uri}/{METADATA_NAME}")

    def _publish_locked(self, metadata: Metadata, shards: list[str]) -> str:
        lock = _GcsSaveLock(self.gcs, self._object(LOCK_NAME), self.uri, f"{TIERED_SAVE_ID_PREFIX}{self.token}",
                            LOCK_LEASE_S, self.connection.options.deadline_s)
        try:
            lock.acquire()
        except ConcurrentWriteError:
            return "the checkpoint's save lock (another publish or save holds it)"
        try:
            objects, _ = self.gcs.list_objects(self.base.bucket, self.base.key + "/", self.deadline)
            listed = {item.name[len(self.base.key) + 1 :]: item for item in objects}
            state = self._current(listed)
            if state is not None:
                return state
            markers: dict[str, dict[str, Any]] = {}
            for name in shards:
                raw = self._read(name + MARKER_SUFFIX)
                marker = _parse_marker(raw, name)
                if marker is None or name not in listed or listed[name].generation != marker["generation"]:
                    return f"the marker of {name} to name its object's generation"
                markers[name] = marker
            storage: dict[Any, Any] = {}
            for index, info in (metadata.storage_data or {}).items():
                marker = markers[info.relative_path]
                spans = {tuple(item): crcs for item, crcs in zip(marker["items"], marker["block_crcs"], strict=True)}
                crcs = spans.get((info.offset, info.length))
                if crcs is None:
                    raise DataCorruptionError(f"{self.uri}: the marker of {info.relative_path} has no checksums "
                                              f"for bytes {info.offset}-{info.offset + info.length - 1}")
                storage[index] = GcsItemInfo(info.relative_path, info.offset, info.length, crc32c=tuple(crcs),
                                             block_size=marker["block_size"])
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_data = storage
            save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None) or self.token
            metadata.storage_meta = StorageMeta(checkpoint_id=self.uri, save_id=TIERED_SAVE_ID_PREFIX + save_id)
            stamp_version(metadata)
            body = pickle.dumps(metadata)
            current = listed.get(METADATA_NAME)
            lock.confirm()
            self.gcs.upload_object(self._object(METADATA_NAME), memoryview(body), crc32c_extend(0, body),
                                   self.deadline, if_generation_match=current.generation if current else 0)
            write_commit_record(self.gcs, self.uri, metadata.storage_meta.save_id, self.deadline)
            log.debug("published %s (save %s, %d shards)", self.uri, self.token, len(shards))
            self._sweep(listed, set(shards))
            return PUBLISHED
        except ConcurrentWriteError:  # .metadata changed since it was read: look again
            return "a publish that raced this one"
        finally:
            lock.release()

    def _sweep(self, listed: dict[str, Any], keep: set[str]) -> None:
        """Delete the objects of earlier saves, and this save's markers and pending metadata."""
        began = token_time(self.token) - LEFTOVER_MARGIN_S
        stale = []
        for name, item in listed.items():
            token = token_of(name)
            if token is None or name in keep:
                continue
            if token == self.token:
                if name.endswith(MARKER_SUFFIX) or name == pending_name(self.token):
                    stale.append(item)
            elif token < self.token or item.created < began:
                stale.append(item)
        for item in stale:
            try:
                self.gcs.delete(self.base.bucket, item.name, self.deadline, if_generation_match=item.generation)
            except Exception as exc:  # the next publish tries again
                log.debug("could not delete gs://%s/%s (%s)", self.base.bucket, item.name, exc)


def _parse_marker(raw: bytes | None, name: str) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        marker = json.loads(raw)
        if (marker.get("format") != MARKER_FORMAT or marker.get("name") != name
                or not isinstance(marker.get("generation"), int) or not isinstance(marker.get("block_size"), int)
                or len(marker.get("items", ())) != len(marker.get("block_crcs", ()))):
            raise ValueError("unexpected fields")
    except (ValueError, AttributeError, TypeError) as exc:
        log.warning("ignoring the marker of %s: %s", name, exc)
        return None
    return marker


def _compare(data: bytes, generation: int, token: str, where: str) -> str | None:
    """How the checkpoint ``data`` (GCS's ``.metadata``, of ``generation``) stands to save ``token``:
    ``published`` (it is that save's), ``superseded`` (it is newer), ``None`` (older)."""
    try:
        metadata = load_metadata(data, where, allowed=[(GcsItemInfo.__module__, GcsItemInfo.__qualname__)])
    except pickle.UnpicklingError:
        return None  # not a checkpoint this reads: replace it
    current = _tiered_token(metadata)
    if current is not None:
        if current == token:
            return PUBLISHED
        return SUPERSEDED if current > token else None
    # Another writer's: newer when it was published after this save began (a generation is the
    # object's creation time in microseconds).
    return SUPERSEDED if generation / 1e6 > token_time(token) else None


def gcs_version(metadata: Metadata, generation: int) -> tuple[str | None, float]:
    """GCS's checkpoint as loads compare it with the local tier's saves: its tiered save token
    (``None`` for another writer's), and when it was published (seconds since the epoch)."""
    return _tiered_token(metadata), generation / 1e6


def local_is_as_new(token: str, gcs: tuple[str | None, float] | None) -> bool:
    """Whether the local tier's save ``token`` is the same as GCS's checkpoint ``gcs``, or newer."""
    if gcs is None:
        return True
    gcs_token, published = gcs
    if gcs_token is not None:
        return token >= gcs_token
    return token_time(token) >= published




# Choosing the version a load reads ----------------------------------------------------------------------
@dataclass(frozen=True)
class LoadVersion:
    """The version of a checkpoint that the ranks of a load agreed on, as this rank reads it."""

    token: str | None
    """Its tiered save's token (``None``: a checkpoint another writer published in GCS)."""
    tier: str
    """Where its metadata was chosen from: ``"local"`` (a local tier's save, as new as GCS's or
    newer) or ``"gcs"``."""
    metadata: bytes
    """Its ``.metadata``, the same bytes on every rank."""
    local_files: dict[str, tuple[str, int, str | None]]
    """Its files whole by size on this node's local tier: name → (path, size, crc32c or ``None``)."""
    in_gcs: bool
    """Whether GCS holds this version (a file not read locally is read there)."""


def choose_version(tier: ShardedLocalTier, uri: str, read_gcs: Callable[[], tuple[bytes, int] | None],
                   process_group: Any = None) -> LoadVersion:
    """Agree with the other ranks of ``process_group`` on the version of ``uri`` to load (every rank
    calls this at the same point of its load): the newest save of the local tiers whose every file
    each rank finds on its node, if it is as new as GCS's checkpoint, else GCS's checkpoint.

    Where torch.distributed is initialized, one ``all_gather_object`` shares what each rank has
    (the group's first rank asks GCS, with ``read_gcs``), and one ``broadcast_object_list`` sends
    the chosen metadata from a rank that holds it, so every rank reads the same bytes.

    Raises:
        FileNotFoundError: neither tier holds the checkpoint (on every rank).
        Exception: GCS could not be asked and no local save can be read instead (on the first
            rank, the error itself; on the others, a ``RuntimeError`` naming it).
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(process_group) if distributed else 1
    me = dist.get_rank(process_group) if distributed else 0
    saves = tier._local_saves(uri)
    report: dict[str, Any] = {"saves": {}, "gcs": None, "gcs_error": None}
    for token, save in saves.items():
        report["saves"][token] = {"needed": _files_named(save["metadata"]), "whole": sorted(save["shards"])}
    gcs_data: tuple[bytes, int] | None = None
    gcs_failure: BaseException | None = None
    if me == 0:
        try:
            gcs_data = read_gcs()
        except Exception as exc:  # GCS unreachable: a local save may still be read
            gcs_failure = exc
            report["gcs_error"] = f"{type(exc).__name__}: {exc}"
        if gcs_data is not None:
            try:
                metadata = load_metadata(gcs_data[0], f"{uri}/{METADATA_NAME}",
                                         allowed=[(GcsItemInfo.__module__, GcsItemInfo.__qualname__)])
                report["gcs"] = (_tiered_token(metadata), gcs_data[1] / 1e6)
            except pickle.UnpicklingError:  # another writer's (weights_only=False): loaded from GCS
                report["gcs"] = (None, gcs_data[1] / 1e6)
    reports: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(reports, report, group=process_group)
    else:
        reports = [report]
    gcs = reports[0]["gcs"]
    candidates = []
    for token in set().union(*(entry["saves"] for entry in reports)):
        holders = [rank for rank, entry in enumerate(reports) if (entry["saves"].get(token) or {}).get("needed")]
        if not holders:
            continue
        needed = set(reports[holders[0]]["saves"][token]["needed"])
        if all(needed <= set((entry["saves"].get(token) or {}).get("whole", ())) for entry in reports) and (
                gcs is None or local_is_as_new(token, tuple(gcs))):
            candidates.append((token, holders[0]))
    if candidates:
        token, holder = max(candidates)
        if reports[0]["gcs_error"]:
            log.warning("could not ask GCS which checkpoint %s holds (%s); loading save %s from the local tier",
                        uri, reports[0]["gcs_error"], token)
        data = None
        if me == holder:
            with open(saves[token]["metadata"], "rb") as file:
                data = file.read()
        data = _shared(data, holder, world, process_group)
        in_gcs = gcs is not None and gcs[0] == token
        log.info("loading %s from the local tier (save %s%s)", uri, token, ", also in GCS" if in_gcs else
                 ", newer than GCS's")
        return LoadVersion(token, "local", data, dict(saves.get(token, {}).get("shards", {})), in_gcs)
    if reports[0]["gcs_error"]:
        if gcs_failure is not None:
            raise gcs_failure
        raise RuntimeError(f"could not load {uri}: the first rank could not ask GCS for it "
                           f"({reports[0]['gcs_error']}), and no save of it is whole on every rank's local tier")
    if gcs is None:
        raise FileNotFoundError(f"no checkpoint at {uri} (no {METADATA_NAME} in GCS, and no save of it whole on "
                                "every rank's local tier)")
    data = _shared(gcs_data[0] if gcs_data is not None else None, 0, world, process_group)
    token = gcs[0]
    local = dict(saves.get(token, {}).get("shards", {})) if token is not None else {}
    log.info("loading %s from GCS%s", uri, f" ({len(local)} of its files from the local tier)" if local else "")
    return LoadVersion(token, "gcs", data, local, True)


def _files_named(metadata: str | None) -> list[str] | None:
    """The files the local metadata file ``metadata`` names (``None`` without a readable one)."""
    if metadata is None:
        return None
    try:
        with open(metadata, "rb") as file:
            local = load_metadata(file.read(), metadata)
    except (OSError, pickle.UnpicklingError) as exc:
        log.warning("ignoring the local tier's metadata %s: %s", metadata, exc)
        return None
    return sorted({info.relative_path for info in (local.storage_data or {}).values()})


def _shared(data: bytes | None, holder: int, world: int, process_group: Any) -> bytes:
    """``data`` as the group's rank ``holder`` has it, on every rank."""
    if world > 1:
        import torch.distributed as dist

        source = holder if process_group is None else dist.get_global_rank(process_group, holder)
        box = [data]
        dist.broadcast_object_list(box, src=source, group=process_group)
        data = box[0]
    assert data is not None
    return data
