"""Streaming uploads: a writable file-like that ``torch.save`` writes into.

With the transfer manager the bytes are cut into ``chunk_size`` parts as they are produced and
``max_workers`` threads upload them concurrently, so memory stays bounded by about
``(max_workers + 1) x chunk_size``. Parts go through one of two engines, chosen once per bucket:

* ``xml``: GCS's XML API multipart upload (parts, then one completion);
* ``composite``: part objects under a temporary prefix, composed (32 sources at a time, in a tree)
  into the final name, then deleted; for servers without XML multipart (fake-gcs-server).

Without the transfer manager it is one resumable upload, fed by one background thread.

Publishing is atomic: nothing appears under the final name until the upload is complete, and a
failure cleans up after itself within its own time budget. Where GCS supports it (single upload,
compose, resumable upload) the publish carries a generation precondition, the generation found
when the writer started: a save that another writer overtook fails with
:class:`~dataflux_ckpt.errors.ConcurrentWriteError` and publishes nothing. XML multipart
completions take no preconditions (the last completion wins). The crc32c of what was published is
checked from the publishing request's own answer, and a damaged object is deleted only in the
generation this writer created.

Temporary part objects are named ``<key>.dataflux-parts/<upload id>-<lease>s-<owner>/<n>.dataflux-part``:
the lease is the writer's deadline plus its clean-up budget, after which the writer is certainly
finished; the owner is the writer's process (see :class:`~lightning_storage_plugins.owners.Owner`);
the suffix lets a bucket lifecycle rule find them. An upload is over, and its part objects are
removed, once its owner is certainly gone (its process on this machine has exited, or it ran in an
earlier attempt of this Slurm job) or its lease ran out (by the server's clock) after its newest
part: those of writers that died without cleaning up, never those of a live writer. Every save
removes those of uploads to its path; a restart (``DatafluxCheckpointIO.preflight``) those of
uploads to every object of its checkpoint directories.
"""

from __future__ import annotations

import io
import logging
import math
import mmap
import queue
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from functools import partial
from typing import Any, Protocol

from dataflux_ckpt.checksums import BytesLike, crc32c_b64, crc32c_combine, crc32c_extend
from dataflux_ckpt.errors import DataCorruptionError, DeadlineExceededError, HttpStatusError, TransferError
from dataflux_ckpt.gcs import Gcs, ListedObject, ObjectInfo
from dataflux_ckpt.mapped import map_file, read_ahead
from dataflux_ckpt.paths import GcsPath
from dataflux_ckpt.retry import Deadline
from lightning_storage_plugins.owners import Owner

log = logging.getLogger(__name__)

MAX_COMPOSE_SOURCES = 32
PARTS_SUFFIX = ".dataflux-parts/"
# Every temporary part object's name ends so, for a bucket lifecycle rule (``matchesSuffix``).
PART_OBJECT_SUFFIX = ".dataflux-part"
# Statuses with which a server says it does not serve XML multipart uploads.
XML_UNSUPPORTED_STATUS = frozenset({400, 404, 405, 501})
# GCS refuses XML multipart parts (but the last) smaller than this; "auto" picks composite below it.
XML_MIN_PART_BYTES = 5 * 2**20
UPLOAD_MODES = ("auto", "xml", "composite")
BUFFER_WAIT_S = 0.05
DEADLINE_S = 1800.0
CLEANUP_TIMEOUT_S = 30.0
# Part objects under a prefix without a lease tag are removed once they are this old.
UNTAGGED_UPLOAD_LEASE_S = 24 * 3600.0
# An upload's directory: "<upload id>-<lease>s-<owner>" (uploads before owners were recorded: no owner).
_UPLOAD_DIR_RE = re.compile(r"^(?P<id>[0-9a-f]{32})-(?P<lease>\d+)s(?:-(?P<owner>[0-9a-z.]+))?$")


def parts_prefix(path: GcsPath) -> str:
    """Where the temporary part objects of uploads to ``path`` live."""
    return path.key + PARTS_SUFFIX


def upload_prefix(path: GcsPath, lease_s: float, owner: Owner) -> str:
    """Where the part objects of a new upload to ``path`` go: its own directory, named by a fresh
    upload id, the upload's lease and its owner."""
    return f"{parts_prefix(path)}{uuid.uuid4().hex}-{math.ceil(lease_s)}s-{owner.token()}/"


def sweep_stale_parts(gcs: Gcs, path: GcsPath, deadline: Deadline) -> int:
    """Delete the part objects of uploads to ``path`` that are over (see the module docstring);
    each object only in the generation that was listed.

    Returns:
        How many part objects were deleted.
    """
    return _sweep(gcs, path.bucket, parts_prefix(path), deadline)


def sweep_dead_uploads(gcs: Gcs, directory: GcsPath, deadline: Deadline) -> int:
    """Delete the part objects of every upload that is over to an object under ``directory``
    (``gs://bucket/prefix/``; what saves killed in the middle left there).

    Returns:
        How many part objects were deleted.

    Raises:
        BucketNotFoundError: the bucket does not exist.
        DeadlineExceededError: the listing or a deletion did not finish by ``deadline``.
    """
    return _sweep(gcs, directory.bucket, directory.key, deadline)


def _sweep(gcs: Gcs, bucket: str, prefix: str, deadline: Deadline) -> int:
    """Delete the part objects listed under ``prefix`` whose uploads are over."""
    objects, now = gcs.list_objects(bucket, prefix, deadline)
    uploads: dict[tuple[str, str], list[ListedObject]] = {}
    for item in objects:
        key, suffix, rest = item.name.partition(PARTS_SUFFIX)
        if suffix:
            uploads.setdefault((key, rest.partition("/")[0]), []).append(item)
    if not uploads:
        return 0
    now = time.time() if now is None else now
    observer = Owner.current()
    deleted = 0
    for (key, upload_dir), items in uploads.items():
        reason = _upload_over(upload_dir, max(item.created for item in items), now, observer)
        if reason is None:
            continue
        log.warning("removing %d part objects of an upload to gs://%s/%s that is over: %s (%s)",
                    len(items), bucket, key, reason, upload_dir)
        for item in items:
            deleted += gcs.delete(bucket, item.name, deadline, if_generation_match=item.generation)
    return deleted


def _upload_over(upload_dir: str, newest: float, now: float, observer: Owner) -> str | None:
    """Why the upload whose parts are in ``upload_dir`` (newest created at ``newest``, by the
    server's clock, which reads ``now``) is certainly over, or ``None`` when it may be running."""
    match = _UPLOAD_DIR_RE.match(upload_dir)
    owner = Owner.from_token(match["owner"]) if match and match["owner"] else None
    reason = owner.gone(observer) if owner is not None else None
    if reason is not None:
        return reason
    lease_s = float(match["lease"]) if match else UNTAGGED_UPLOAD_LEASE_S
    if now <= newest + lease_s:
        return None
    return f"its lease of {lease_s:.0f} s ran out {now - newest - lease_s:.0f} s ago"


class _PartEngine(Protocol):
    mode: str

    def upload_part(self, number: int, data: memoryview, crc: int, deadline: Deadline) -> Any: ...

    def complete(self, tokens: list[Any], crc: int, deadline: Deadline) -> ObjectInfo: ...

    def abort(self, deadline: Deadline) -> None: ...


class _CompositeEngine:
    """Part objects plus a compose tree; part objects are deleted afterwards."""

    mode = "composite"

    def __init__(self, gcs: Gcs, path: GcsPath, executor: ThreadPoolExecutor, expected_generation: int,
                 lease_s: float, cleanup_timeout_s: float) -> None:
        self._gcs, self._path, self._executor = gcs, path, executor
        self._expected_generation = expected_generation
        self._cleanup_timeout_s = cleanup_timeout_s
        self._prefix = upload_prefix(path, lease_s, Owner.current())

    def upload_part(self, number: int, data: memoryview, crc: int, deadline: Deadline) -> tuple[str, int]:
        name = f"{self._prefix}{number:06d}{PART_OBJECT_SUFFIX}"
        return name, self._gcs.upload_part_object(self._path.bucket, name, data, crc, deadline)

    def complete(self, tokens: list[tuple[str, int]], crc: int, deadline: Deadline) -> ObjectInfo:
        bucket, level = self._path.bucket, 0
        temporary = list(tokens)
        sources = [name for name, _ in tokens]
        while len(sources) > MAX_COMPOSE_SOURCES:
            groups = [sources[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(sources), MAX_COMPOSE_SOURCES)]
            names = [f"{self._prefix}c{level}-{i:06d}{PART_OBJECT_SUFFIX}" for i in range(len(groups))]
            composed = list(self._executor.map(lambda g, n: self._gcs.compose(bucket, g, n, deadline), groups, names))
            temporary += [(name, info.generation) for name, info in zip(names, composed, strict=True)]
            sources, level = names, level + 1
        info = self._gcs.compose(bucket, sources, self._path.key, deadline,
                                 if_generation_match=self._expected_generation, expected_crc=crc32c_b64(crc))
        # The object is complete: the save returns now and the parts are deleted in the background
        # (the plugin's teardown waits for that); a part left behind is only clutter.
        for name, generation in temporary:
            self._gcs.in_background(partial(self._delete_part, name, generation),
                                    f"deleting part object gs://{bucket}/{name} of {self._path}")
        return info

    def _delete_part(self, name: str, generation: int) -> None:
        deadline = Deadline(self._cleanup_timeout_s, "deletion", f"gs://{self._path.bucket}/{name}")
        self._gcs.delete(self._path.bucket, name, deadline, if_generation_match=generation)

    def abort(self, deadline: Deadline) -> None:
        names = self._gcs.list_names(self._path.bucket, self._prefix, deadline)
        list(self._executor.map(lambda n: self._gcs.delete(self._path.bucket, n, deadline), names))


class _XmlMultipartEngine:
    """GCS XML API multipart upload: parts, then one completion (no preconditions there)."""

    mode = "xml"

    def __init__(self, gcs: Gcs, path: GcsPath, deadline: Deadline) -> None:
        self._gcs, self._path = gcs, path
        self._upload_id = gcs.xml_initiate(path, deadline)

    def upload_part(self, number: int, data: memoryview, crc: int, deadline: Deadline) -> str:
        return self._gcs.xml_upload_part(self._path, self._upload_id, number, data, crc, deadline)

    def complete(self, tokens: list[str], crc: int, deadline: Deadline) -> ObjectInfo:
        generation, stored = self._gcs.xml_complete(self._path, self._upload_id, tokens, deadline)
        # Every part's crc32c was checked by the server on arrival; the whole object's is checked
        # here when the answer carries it.
        return ObjectInfo(0, stored if stored is not None else crc32c_b64(crc), generation or 0)

    def abort(self, deadline: Deadline) -> None:
        self._gcs.xml_abort(self._path, self._upload_id, deadline)


# A part that holds no slot (an empty last part cut before anything was written).
_NO_SLOT: Any = object()


class _ChunkingWriter(io.RawIOBase):
    """A write-only file-like that cuts what is written into ``chunk_size`` parts and hands each
    full one to :meth:`_submit_buffer`, with at most ``buffers`` parts alive at once.

    :meth:`write` copies into part buffers (the caller may reuse its memory at once);
    :meth:`write_borrowed` uploads whole parts straight from the caller's memory, which must stay
    alive and unchanged until the writer is closed. Either way a part holds one of ``buffers``
    slots from the moment it is cut until its upload ends, so at most ``buffers`` parts (copied or
    borrowed) are referenced at once, and at most ``buffers`` part buffers are ever allocated.

    ``close()`` (or leaving the ``with`` block normally) publishes the object; leaving it with an
    exception, or :meth:`abort`, discards the upload and leaves any previous object intact.

    After a successful ``close()``, :attr:`generation` is the generation it published (``None``
    where the server did not say).
    """

    def __init__(self, gcs: Gcs, path: GcsPath, *, chunk_size: int, buffers: int, deadline_s: float,
                 cleanup_timeout_s: float) -> None:
        if chunk_size <= 0 or buffers <= 1:
            raise ValueError(f"chunk_size ({chunk_size}) and the number of workers must be positive")
        if not deadline_s > 0 or not cleanup_timeout_s > 0:
            raise ValueError(f"deadline_s ({deadline_s}) and cleanup_timeout_s ({cleanup_timeout_s}) must be positive")
        super().__init__()
        self._gcs, self.path = gcs, path
        self._chunk_size, self._buffers = chunk_size, buffers
        self._cleanup_timeout_s = cleanup_timeout_s
        self._deadline = Deadline(deadline_s, "save", path.uri)
        # The part being cut: the slot it holds (with the buffer that slot last held, or None),
        # and either the buffer it is copied into or a full part of the caller's memory.
        self._slot: bytearray | None = _NO_SLOT
        self._buffer: bytearray | None = None
        self._borrowed: memoryview | None = None
        self._fill = 0
        self._size = 0
        self._crc = 0
        self._required_crc: int | None = None
        self._free: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()
        self._allocated = 0
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future[Any]] = []
        self._done = True  # until the constructor succeeds: nothing to abort
        self.generation: int | None = None
        # The generation there now: the precondition of the publish. A missing bucket fails here,
        # before anything is serialized.
        self._expected_generation = gcs.current_generation(path, self._deadline)
        self._done = False

    def require_crc32c(self, crc: int) -> None:
        """Publish only if all the bytes written have crc32c ``crc`` (the crc32c they were written
        with, taken earlier); otherwise :meth:`close` raises :class:`DataCorruptionError` and nothing
        is published. The bytes checked are the ones sent: each part's crc32c, taken when it is cut."""
        self._required_crc = crc

    def _check_required_crc(self) -> None:
        """Raise before the publish when every part is cut and the whole's crc32c is not the required one."""
        if self._required_crc is not None and self._crc != self._required_crc:
            raise DataCorruptionError(f"{self.path}: the bytes uploaded have crc32c {crc32c_b64(self._crc)}, not the "
                                      f"{crc32c_b64(self._required_crc)} they were written with; nothing is published")

    @property
    def chunk_size(self) -> int:
        """Bytes per part: whole parts handed to :meth:`write_borrowed` go up without a copy."""
        return self._chunk_size

    @property
    def lease_s(self) -> float:
        """How long after its newest part this upload may still be running (deadline + clean-up)."""
        return self._deadline.seconds + self._cleanup_timeout_s

    # io.RawIOBase ----------------------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: BytesLike) -> int:  # type: ignore[override]
        """Append ``data`` (copied: the caller may change its memory once this returns)."""
        return self._write(data, borrow=False)

    def write_borrowed(self, data: BytesLike) -> int:
        """Append ``data``, uploading each whole part of it from the caller's memory, not a copy.

        The caller keeps ``data`` alive and unchanged until :meth:`close` (or :meth:`abort`)
        returns: a part's crc32c is taken when it is cut and checked by the server, so bytes
        changed meanwhile fail the upload instead of being stored. Bytes that do not fill a whole
        part (where ``data`` starts or ends inside one) are copied as :meth:`write` does.
        """
        return self._write(data, borrow=True)

    def _write(self, data: BytesLike, borrow: bool) -> int:
        if self.closed or self._done:
            raise ValueError(f"write to a closed writer for {self.path}")
        view = memoryview(data).cast("B")
        offset, total = 0, view.nbytes
        while offset < total:
            # A full part is handed on only once more bytes follow, so that an object of exactly
            # one chunk still goes up in a single request.
            if self._fill == self._chunk_size:
                self._deadline.check()
                self._submit_buffer()
            take = min(self._chunk_size - self._fill, total - offset)
            if borrow and take == self._chunk_size:  # a whole part of the caller's memory
                self._slot = self._acquire_slot()
                self._borrowed = view[offset : offset + take]
            else:
                if self._buffer is None:
                    slot = self._acquire_slot()
                    self._slot = self._buffer = slot if slot is not None else bytearray(self._chunk_size)
                self._buffer[self._fill : self._fill + take] = view[offset : offset + take]
            self._fill += take
            offset += take
        self._size += total
        return total

    def close(self) -> None:
        """Finish the upload and publish the object (no-op when already closed).

        Raises:
            DeadlineExceededError: the save did not finish within its deadline (nothing published).
            ConcurrentWriteError: another writer replaced the object meanwhile (nothing published).
            TransferError: a part failed for good.
            BucketNotFoundError: the bucket does not exist.
        """
        if self.closed:
            return
        try:
            if not self._done:
                self._deadline.check()
                self._finish()
                self._done = True
                self._after_publish()
        except BaseException:
            self.abort()
            raise
        finally:
            self._shutdown()
            super().close()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        self.close()

    def __del__(self) -> None:
        # Never publish a half-written object from the garbage collector.
        if not getattr(self, "_done", True):
            self.abort()

    # Slots and buffers -----------------------------------------------------------------------
    def _acquire_slot(self) -> bytearray | None:
        """A free slot, as the buffer it last held (``None`` when it never held one); when every
        slot is taken by a part in flight, this waits for an upload to finish."""
        while True:
            self._raise_if_failed()
            try:
                return self._free.get_nowait()
            except queue.Empty:
                pass
            if self._allocated < self._buffers:
                self._allocated += 1
                return None
            self._deadline.check("waiting for a part upload to free a buffer")
            try:
                return self._free.get(timeout=BUFFER_WAIT_S)
            except queue.Empty:
                continue

    def _raise_if_failed(self) -> None:
        for future in self._futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _release_slot(self, slot: bytearray | None) -> None:
        """Give back the slot a part held (its upload ended)."""
        if slot is not _NO_SLOT:
            self._free.put(slot)

    def _cut_part(self) -> tuple[bytearray | None, memoryview, int]:
        """Take the current part; returns its slot (for :meth:`_release_slot`), its bytes, and their crc32c."""
        if self._borrowed is not None:
            data = self._borrowed
        else:
            data = memoryview(self._buffer if self._buffer is not None else b"")[: self._fill]
        slot = self._slot
        crc = crc32c_extend(0, data)
        self._crc = crc32c_combine(self._crc, crc, data.nbytes)
        self._slot, self._buffer, self._borrowed, self._fill = _NO_SLOT, None, None, 0
        return slot, data, crc

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._buffers - 1, thread_name_prefix="dataflux-upload")
        self._futures.append(self._executor.submit(fn, *args))

    def _wait_all(self) -> list[Any]:
        results = []
        for future in self._futures:
            try:
                # Each request ends by the deadline on its own; the grace covers a last backoff.
                results.append(future.result(timeout=max(self._deadline.remaining(), 0) + 1.0))
            except FutureTimeoutError:
                raise self._deadline.exceeded("waiting for the part uploads") from None
        return results

    def _stop_parts(self) -> None:
        for future in self._futures:
            future.cancel()
        for future in self._futures:
            if not future.cancelled():
                try:
                    # Requests end by the deadline; give each at most the clean-up budget beyond it.
                    future.exception(timeout=max(self._deadline.remaining(), 0) + self._cleanup_timeout_s)
                except FutureTimeoutError:
                    log.warning("a part upload of %s is still running after its deadline", self.path)

    def _check_published(self, info: ObjectInfo) -> None:
        """Check the published generation's crc32c; a damaged one is deleted (that generation only)."""
        self.generation = info.generation or None
        expected = crc32c_b64(self._crc)
        if info.crc32c == expected:
            return
        log.error("%s: stored crc32c %s != written %s; deleting generation %s",
                  self.path, info.crc32c, expected, info.generation)
        if info.generation:
            self._gcs.delete(self.path.bucket, self.path.key, self._cleanup_deadline(),
                             if_generation_match=info.generation)
        self.generation = None
        raise DataCorruptionError(f"{self.path}: stored crc32c {info.crc32c} != written {expected}")

    def _cleanup_deadline(self) -> Deadline:
        return Deadline(self._cleanup_timeout_s, "clean-up after the save", self.path.uri)

    def _after_publish(self) -> None:
        """Remove, in the background, part objects that dead uploads to this path left behind."""
        gcs, path, budget_s = self._gcs, self.path, self._cleanup_timeout_s

        def sweep() -> None:
            sweep_stale_parts(gcs, path, Deadline(budget_s, "removal of stale part objects", path.uri))

        gcs.in_background(sweep, f"removing stale part objects of {path}")

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        self._slot, self._buffer, self._borrowed = _NO_SLOT, None, None

    # Engine-specific -------------------------------------------------------------------------
    def _submit_buffer(self) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Discard the upload; nothing is published."""
        raise NotImplementedError


class ObjectWriter(_ChunkingWriter):
    """Uploads ``path`` in ``chunk_size`` parts, ``max_workers`` at a time, while it is written.

    Args:
        gcs: the GCS helper to talk through.
        path: where to publish.
        chunk_size: bytes per part.
        max_workers: concurrent part uploads.
        mode: ``"auto"`` (XML multipart where the bucket serves it and parts are at least 5 MiB,
            else composite), ``"xml"`` or ``"composite"``.
        deadline_s: the whole save must finish within this many seconds.
        cleanup_timeout_s: how long clean-up after a failure may take.

    Raises:
        BucketNotFoundError: the bucket does not exist.
        DeadlineExceededError: the server did not answer in time.
    """

    def __init__(self, gcs: Gcs, path: GcsPath, *, chunk_size: int, max_workers: int, mode: str = "auto",
                 deadline_s: float = DEADLINE_S, cleanup_timeout_s: float = CLEANUP_TIMEOUT_S) -> None:
        if mode not in UPLOAD_MODES:
            raise ValueError(f"upload mode must be one of {UPLOAD_MODES}, not {mode!r}")
        super().__init__(gcs, path, chunk_size=chunk_size, buffers=max_workers + 1, deadline_s=deadline_s,
                         cleanup_timeout_s=cleanup_timeout_s)
        self._mode = mode
        self._engine: _PartEngine | None = None

    def _start_engine(self) -> _PartEngine:
        """The engine for the mode; ``auto`` probes XML multipart once per bucket (see :class:`Gcs`)."""
        mode = self._mode
        if mode == "auto":
            mode = self._gcs.upload_mode(self.path.bucket) or "auto"
            if mode == "auto" and self._chunk_size < XML_MIN_PART_BYTES:
                mode = "composite"  # parts this small are refused by GCS's XML multipart uploads
        assert self._executor is not None
        if mode == "composite":
            return _CompositeEngine(self._gcs, self.path, self._executor, self._expected_generation, self.lease_s,
                                    self._cleanup_timeout_s)
        try:
            engine = _XmlMultipartEngine(self._gcs, self.path, self._deadline)
        except HttpStatusError as exc:
            if mode == "xml" or exc.status not in XML_UNSUPPORTED_STATUS:
                raise
            log.info("gs://%s does not serve XML multipart uploads (HTTP %s); using composite uploads",
                     self.path.bucket, exc.status)
            self._gcs.remember_upload_mode(self.path.bucket, "composite")
            return _CompositeEngine(self._gcs, self.path, self._executor, self._expected_generation, self.lease_s,
                                    self._cleanup_timeout_s)
        if self._mode == "auto":
            self._gcs.remember_upload_mode(self.path.bucket, "xml")
        return engine

    def _submit_buffer(self) -> None:
        if self._engine is None:
            self._executor = ThreadPoolExecutor(self._buffers - 1, thread_name_prefix="dataflux-upload")
            self._engine = self._start_engine()
            log.debug("uploading %s in parts with the %s engine", self.path, self._engine.mode)
        slot, data, crc = self._cut_part()
        self._submit(self._upload_part, len(self._futures) + 1, slot, data, crc)

    def _upload_part(self, number: int, slot: bytearray | None, data: memoryview, crc: int) -> Any:
        what = f"upload of part {number} of {self.path.uri} (bucket {self.path.bucket}, key {self.path.key})"
        assert self._engine is not None
        engine, deadline = self._engine, self._deadline
        try:
            return self._gcs.retry.call(lambda: engine.upload_part(number, data, crc, deadline), what, deadline)
        except DeadlineExceededError:
            raise
        except Exception as exc:
            raise TransferError(f"{what} failed: {exc}") from exc
        finally:
            self._release_slot(slot)

    def _finish(self) -> None:
        if self._engine is None:
            # Everything fits in one part: a single upload straight to the final name.
            _, data, crc = self._cut_part()
            self._check_required_crc()
            info = self._gcs.upload_object(self.path, data, crc, self._deadline,
                                           if_generation_match=self._expected_generation)
            self._check_published(info)
            return
        if self._fill:
            self._submit_buffer()
        self._check_required_crc()
        tokens = self._wait_all()
        self._check_published(self._engine.complete(tokens, self._crc, self._deadline))
        log.debug("uploaded %s: %d bytes in %d parts", self.path, self._size, len(tokens))

    def abort(self) -> None:
        """Stop the parts, then abort the multipart upload or delete the part objects."""
        if self._done:
            return
        self._done = True
        self._stop_parts()
        if self._engine is not None:
            log.warning("upload of %s failed; cleaning up its %s upload", self.path, self._engine.mode)
            try:
                self._engine.abort(self._cleanup_deadline())
            except Exception:
                log.exception("clean-up after the failed upload of %s failed; part objects left behind "
                              "are removed by a later save to this path", self.path)
        self._shutdown()


class StreamingWriter(_ChunkingWriter):
    """One resumable upload: the transfer-manager-disabled path.

    A single background thread feeds the upload while the caller fills the next buffer, so
    serialization and upload overlap; requests stay strictly sequential.

    Args:
        gcs: the GCS helper to talk through.
        path: where to publish.
        chunk_size: bytes per request; a multiple of 256 KiB.
        deadline_s: the whole save must finish within this many seconds.
        cleanup_timeout_s: how long clean-up after a failure may take.
    """

    def __init__(self, gcs: Gcs, path: GcsPath, *, chunk_size: int, deadline_s: float = DEADLINE_S,
                 cleanup_timeout_s: float = CLEANUP_TIMEOUT_S) -> None:
        super().__init__(gcs, path, chunk_size=chunk_size, buffers=2, deadline_s=deadline_s,
                         cleanup_timeout_s=cleanup_timeout_s)
        self._done = True
        # The generation precondition is evaluated when the session finishes.
        self._session = gcs.resumable_start(path, self._deadline, if_generation_match=self._expected_generation)
        self._done = False
        self._sent = 0
        self._result: ObjectInfo | None = None

    def _submit_buffer(self) -> None:
        slot, data, _ = self._cut_part()
        self._submit(self._send, slot, data, False)

    def _send(self, slot: bytearray | None, data: memoryview, last: bool) -> None:
        offset = self._sent
        total = offset + data.nbytes if last else None
        try:
            self._result = self._gcs.resumable_send(self.path, self._session, data, offset, total, self._deadline)
        except (DeadlineExceededError, TransferError):
            raise
        except Exception as exc:
            raise TransferError(f"resumable upload of {self.path} failed: {exc}") from exc
        finally:
            self._release_slot(slot)
        self._sent += data.nbytes

    def _finish(self) -> None:
        slot, data, _ = self._cut_part()
        self._check_required_crc()
        self._submit(self._send, slot, data, True)
        self._wait_all()
        if self._result is None:
            raise TransferError(f"resumable upload of {self.path}: the session did not finish")
        self._check_published(self._result)

    def abort(self) -> None:
        """Abandon the resumable upload; nothing is published."""
        if self._done:
            return
        self._done = True
        self._stop_parts()
        try:
            self._gcs.resumable_cancel(self._session, self._cleanup_deadline())
        except Exception as exc:
            log.debug("cancelling the resumable upload of %s: %s", self.path, exc)
        self._shutdown()


class UploadStopped(Exception):
    """:func:`upload_file` was stopped by its caller before it published anything."""


def upload_file(writer: ObjectWriter | StreamingWriter, fd: int, size: int, *,
                expected_crc32c: int | Callable[[], int] | None = None,
                stop: Callable[[], bool] | None = None) -> int | None:
    """Upload the first ``size`` bytes of the file open at ``fd`` through ``writer``, and publish them.

    The file is mapped, not read: whole parts go up straight from the page cache's pages
    (:meth:`~_ChunkingWriter.write_borrowed`), through the writer's own parallelism, integrity checks,
    atomic publish and generation precondition; nothing is serialized or copied. Before publishing,
    the crc32c of what was sent is compared with ``expected_crc32c``: a file that changed since that
    checksum was taken is never published. The file must not be truncated meanwhile (see
    :mod:`dataflux_ckpt.mapped`): upload only files written once and never changed in place.

    Args:
        writer: a fresh writer for the destination (it is closed or aborted here).
        fd: an open, readable file descriptor.
        size: how many bytes to upload.
        expected_crc32c: the crc32c the bytes must have (``None``: not checked), or a function that
            gives it, called once every part is handed over, before the publish (it may wait for a
            checksum taken meanwhile, or raise :class:`UploadStopped`).
        stop: asked between parts; when it answers ``True`` the upload is aborted.

    Returns:
        The generation published (``None`` where the server did not say).

    Raises:
        UploadStopped: ``stop`` answered ``True`` (nothing published).
        DataCorruptionError: the file is shorter than ``size`` or its bytes do not match
            ``expected_crc32c`` (nothing published).
        DeadlineExceededError, ConcurrentWriteError, TransferError, BucketNotFoundError: as the writer's
            ``close()``.
    """
    if isinstance(expected_crc32c, int):
        writer.require_crc32c(expected_crc32c)
    with writer:
        mapping = map_file(fd, size, f"upload of {writer.path}") if size else None
        try:
            with memoryview(mapping if mapping is not None else b"") as view:
                for start in range(0, size, writer.chunk_size):
                    if stop is not None and stop():
                        raise UploadStopped(f"upload of {writer.path} stopped after {start} of {size} bytes")
                    end = min(start + writer.chunk_size, size)
                    assert mapping is not None
                    read_ahead(mapping, start, end)
                    writer.write_borrowed(view[start:end])
                if callable(expected_crc32c):
                    writer.require_crc32c(expected_crc32c())
                if stop is not None and stop():
                    raise UploadStopped(f"upload of {writer.path} stopped before its publish")
                writer.close()  # publishes; the parts are borrowed from the mapping until then
        finally:
            if mapping is not None:
                writer.abort()  # nothing if published: the borrowed parts must be let go of before the unmapping
                _unmap(mapping)
    return writer.generation


def _unmap(mapping: mmap.mmap) -> None:
    """Unmap now, or once the last view of it (a part request still unwinding) is let go of."""
    try:
        mapping.close()
    except BufferError:
        pass
