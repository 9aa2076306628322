"""What a sharded (DCP) checkpoint keeps in GCS, for both of its writers: the storage writer that
uploads each rank's shard (:mod:`dataflux_ckpt.dcp`) and the local tier that uploads it in the
background (:mod:`dataflux_ckpt.tiered_dcp`).

Each item's place in its object with a crc32c per block (:class:`GcsItemInfo`, recorded in
``.metadata``), the save lock ``.dcp-save.lock`` under which a checkpoint is published or removed,
and the commit record that dates a published checkpoint; with the GCS connection of a writer or
reader, and the small reads they make.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from dataflux_ckpt.checksums import crc32c_extend
from dataflux_ckpt.errors import BucketNotFoundError, ConcurrentWriteError
from dataflux_ckpt.gcs import CONNECT_TIMEOUT_S, Gcs, make_client
from dataflux_ckpt.options import CRC_BLOCK_BYTES, TransferOptions
from dataflux_ckpt.paths import GcsPath, parse_gcs_path
from dataflux_ckpt.retry import Deadline
from dataflux_ckpt.upload import CLEANUP_TIMEOUT_S
from lightning_storage_plugins.dcp import LOCK_NAME, METADATA_NAME, SaveLock, StorageInfo
from lightning_storage_plugins.owners import Owner

if TYPE_CHECKING:
    from google.cloud import storage

log = logging.getLogger(__name__)

__all__ = ["GcsItemInfo", "write_commit_record"]

# A save lock not renewed for this long, by the server's clock, belongs to a save that is over.
LOCK_LEASE_S = 30.0
# How far before its lease runs out (by this process' clock) a holder stops counting on its lock.
LOCK_MARGIN_S = 2.0


@dataclasses.dataclass(kw_only=True)
class GcsItemInfo(StorageInfo):
    """Where an item lies in its object, with a crc32c per ``block_size`` bytes of it.

    Tensors are stored raw: ``dtype`` and ``shape`` (C order); pickled items have neither.
    """

    crc32c: tuple[int, ...] = ()
    block_size: int = CRC_BLOCK_BYTES
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


# The name checkpoints' pickled metadata records for this class, and the one their readers allow
# (this release's and earlier ones'): dataflux_ckpt.dcp, which exports it.
GcsItemInfo.__module__ = "dataflux_ckpt.dcp"


def _checkpoint_path(checkpoint_id: str | os.PathLike[str]) -> GcsPath:
    path = parse_gcs_path(checkpoint_id)
    return GcsPath(path.bucket, path.key.rstrip("/"))


class _Connection:
    """The GCS client of one writer or reader: made from the environment on first use, never pickled."""

    def __init__(self, project_name: str | None, storage_client: storage.Client | None,
                 options: TransferOptions) -> None:
        self.project_name, self.options = project_name, options
        self._client = storage_client
        self._gcs: Gcs | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_gcs": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def gcs(self) -> Gcs:
        with self._lock:
            if self._gcs is None:
                options = self.options
                self._gcs = Gcs(self._client or make_client(self.project_name), retry=options.retry,
                                connections=options.max_workers, request_timeout_s=options.request_timeout_s,
                                connect_timeout_s=min(CONNECT_TIMEOUT_S, options.request_timeout_s))
            return self._gcs


class _GcsSaveLock(SaveLock):
    """A save's lock on a checkpoint: the object ``<prefix>/.dcp-save.lock``, created under
    ``ifGenerationMatch=0`` and renewed by a background thread every quarter of its lease, each time
    under a precondition on the generation this lock wrote last. It records its process
    (:class:`~lightning_storage_plugins.owners.Owner`): a lock whose process is certainly gone is
    taken over at once, one whose lease ran out too.

    Args:
        gcs: the writer's GCS operations.
        path: the lock object.
        checkpoint: the checkpoint's ``gs://`` prefix, for errors.
        owner: the save's id, recorded in the object.
        lease_s: how long the lock stays held without renewal.
        deadline_s: the longest any one request for the lock may take.
    """

    def __init__(self, gcs: Gcs, path: GcsPath, checkpoint: str, owner: str, lease_s: float, deadline_s: float) -> None:
        self._gcs, self._path, self._checkpoint, self._owner = gcs, path, checkpoint, owner
        self._process = Owner.current()
        self._lease_s, self._deadline_s = lease_s, min(deadline_s, lease_s / 2)
        self._generation = 0
        self._writes = 0
        self._held_until = 0.0
        self._lost: str | None = None
        self._released = False
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _deadline(self) -> Deadline:
        return Deadline(self._deadline_s, "save lock", self._path.uri)

    def _write(self, if_generation_match: int) -> None:
        self._writes += 1
        body = json.dumps({"save": self._owner, "write": self._writes, "lease_s": self._lease_s,
                           "owner": self._process.token()}).encode()
        sent = time.monotonic()
        info = self._gcs.upload_object(self._path, memoryview(body), crc32c_extend(0, body), self._deadline(),
                                       if_generation_match=if_generation_match)
        self._generation = info.generation
        # The server dates the new generation after ``sent``: the lease runs at least this long from here.
        self._held_until = sent + self._lease_s - LOCK_MARGIN_S

    def acquire(self) -> _GcsSaveLock:
        """Take the lock, or take it over from a save whose lease ran out.

        Raises:
            ConcurrentWriteError: a live save holds it.
        """
        try:
            self._write(0)
        except ConcurrentWriteError:
            self._take_over()
        self._thread = threading.Thread(target=self._renew_until_stopped, name="dataflux-dcp-lock", daemon=True)
        self._thread.start()
        return self

    def _take_over(self) -> None:
        bucket, key = self._path
        objects, now = self._gcs.list_objects(bucket, key, self._deadline())
        held = next((item for item in objects if item.name == key), None)
        if held is None:  # let go of since our attempt
            self._write(0)
            return
        lease_s, holder = self._recorded()
        now = time.time() if now is None else now
        # A holder certainly gone (killed on this machine, or in an earlier attempt of this Slurm job)
        # publishes nothing more: its lock is taken over at once, not after its lease.
        gone = holder.gone() if holder is not None else None
        if gone is None and now <= held.created + lease_s:
            raise ConcurrentWriteError(self._checkpoint, f"another save to this checkpoint is in progress (it "
                                       f"holds {LOCK_NAME}, renewed {max(now - held.created, 0):.0f} s ago); "
                                       "this save wrote nothing")
        log.warning("%s: taking over the save lock of a save that is over (%s)", self._checkpoint,
                    gone or f"not renewed for {now - held.created:.0f} s")
        self._write(held.generation)

    def _recorded(self) -> tuple[float, Owner | None]:
        """The lease and the owner the lock object records (the default lease where unreadable)."""
        data = _read_small(self._gcs, self._path, self._deadline())
        try:
            record = json.loads(data or b"{}")
            lease_s = float(record.get("lease_s", LOCK_LEASE_S))
            owner = record.get("owner")
        except (ValueError, TypeError, AttributeError):
            lease_s, owner = LOCK_LEASE_S, None
        lease_s = min(max(lease_s, 1.0), 24 * 3600.0) if math.isfinite(lease_s) else LOCK_LEASE_S
        return lease_s, Owner.from_token(owner) if isinstance(owner, str) else None

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self._lease_s / 4):
            with self._mutex:
                if self._stop.is_set() or self._lost is not None:
                    return
                try:
                    self._write(self._generation)
                except ConcurrentWriteError:
                    self._lost = "another save took the lock over"
                    return
                except Exception as err:  # a failed renewal: the lease still runs; try again
                    if time.monotonic() >= self._held_until:
                        self._lost = f"it could not be renewed within its lease ({err})"
                        return
                    log.debug("%s: renewing the save lock failed (%s); retrying", self._checkpoint, err)

    def confirm(self) -> float:
        with self._mutex:
            if self._lost is None and not self._released:
                try:
                    self._write(self._generation)
                except ConcurrentWriteError:
                    self._lost = "another save took the lock over"
            if self._lost is not None or self._released:
                raise ConcurrentWriteError(self._checkpoint, f"this save lost its save lock: {self._lost or 'let go'}")
            return self._held_until

    def release(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._deadline_s + 1)
        with self._mutex:
            if self._released or not self._generation:
                return
            self._released = True
            try:  # only the generation this lock wrote: never a lock another save took over
                self._gcs.delete(*self._path, Deadline(CLEANUP_TIMEOUT_S, "save lock release", self._path.uri),
                                 if_generation_match=self._generation)
            except Exception as err:  # the lease runs out by itself
                log.warning("%s: could not let go of the save lock (%s); it expires within %.0f s",
                            self._checkpoint, err, self._lease_s)


def write_commit_record(gcs: Gcs, checkpoint: str, save_id: str, deadline: Deadline) -> None:
    """Write the commit record of the sharded checkpoint ``checkpoint`` (``gs://bucket/prefix``), once
    its ``.metadata`` is published: a small object at the checkpoint's own name.

    Why: Lightning's ``ckpt_path="last"`` dates every candidate with its filesystem's ``modified``, and
    gcsfs gives a prefix none (``KeyError: 'mtime'``): with an object at the prefix's name, gcsfs
    answers with that object's time, the time of the commit. The record is written after
    ``.metadata``, so a save killed before it leaves the checkpoint dated at its previous commit; a
    load reads ``.metadata`` only.

    Raises:
        TransferError, DeadlineExceededError: GCS failed, or did not answer in time.
    """
    record = _checkpoint_path(checkpoint)
    if not record.key:  # a whole bucket: there is no name to date
        return
    body = json.dumps({"checkpoint": "torch.distributed.checkpoint", "metadata": METADATA_NAME,
                       "save_id": save_id}).encode()
    gcs.upload_object(record, memoryview(body), crc32c_extend(0, body), deadline)


def _read_small(gcs: Gcs, path: GcsPath, deadline: Deadline) -> bytes | None:
    """One small object whole, or ``None`` when it does not exist.

    Raises:
        BucketNotFoundError: the bucket does not exist.
    """
    what = f"download of {path.uri}"

    def get() -> bytes | None:
        response = gcs.request("GET", gcs.media_url(*path), what, deadline, ok=(200, 404))
        return None if response.status_code == 404 else response.content

    data = gcs.retry.call(get, what, deadline)
    if data is None and gcs.bucket_exists(path.bucket, deadline) is False:
        raise BucketNotFoundError(f"bucket {path.bucket!r} of {path.uri} does not exist")
    return data


class _BlockCrcs:
    """The crc32c of every ``block_size`` bytes of a stream, fed in pieces of any size."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._crcs: list[int] = []
        self._crc = 0
        self._fill = 0

    def update(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        offset = 0
        while offset < view.nbytes:
            take = min(self._block_size - self._fill, view.nbytes - offset)
            self._crc = crc32c_extend(self._crc, view[offset : offset + take])
            self._fill += take
            offset += take
            if self._fill == self._block_size:
                self._crcs.append(self._crc)
                self._crc, self._fill = 0, 0

    def values(self) -> tuple[int, ...]:
        return tuple(self._crcs + ([self._crc] if self._fill else []))
