"""Streaming uploads: a writable file-like that ``torch.save`` writes into.

With the transfer manager the bytes are cut into ``chunk_size`` parts as they are produced and
``max_workers`` threads upload them concurrently, so memory stays bounded by about
``(max_workers + 1) x chunk_size``. Parts go through one of two engines, chosen once per bucket:

* ``xml``: GCS's XML multipart upload, with google-cloud-storage's ``XMLMPUContainer``/``XMLMPUPart``;
* ``composite``: part objects under a temporary prefix, composed (32 sources at a time, in a tree)
  into the final name, then deleted; for servers without XML multipart (fake-gcs-server).

Without the transfer manager it is one streaming resumable upload (``blob.open("wb")``).
Either way nothing appears under the final name until the upload is complete, and a failure
cleans up after itself.
"""

from __future__ import annotations

import io
import logging
import queue
import struct
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

from google.cloud.storage import exceptions as media_exceptions
from google.cloud.storage._media.requests.upload import XMLMPUContainer, XMLMPUPart

from dataflux_ckpt.checksums import BytesLike, crc32c_b64, crc32c_combine, crc32c_extend
from dataflux_ckpt.errors import DataCorruptionError, TransferError
from dataflux_ckpt.gcs import HTTP_TIMEOUT_S, OCTET_STREAM, Gcs
from dataflux_ckpt.paths import GcsPath

log = logging.getLogger(__name__)

MAX_COMPOSE_SOURCES = 32
PARTS_SUFFIX = ".dataflux-parts/"
# Statuses with which a server says it does not serve XML multipart uploads.
XML_UNSUPPORTED_STATUS = frozenset({400, 404, 405, 501})
UPLOAD_MODES = ("auto", "xml", "composite")
BUFFER_WAIT_S = 0.05

_mode_cache: dict[tuple[str, str], str] = {}
_mode_lock = threading.Lock()


def parts_prefix(path: GcsPath) -> str:
    """Where the temporary part objects of uploads to ``path`` live."""
    return path.key + PARTS_SUFFIX


class _PartEngine(Protocol):
    mode: str

    def upload_part(self, number: int, data: memoryview, crc: int) -> str: ...

    def complete(self, tokens: list[str]) -> str: ...

    def abort(self) -> None: ...


class _CompositeEngine:
    """Part objects plus a compose tree; part objects are deleted afterwards."""

    mode = "composite"

    def __init__(self, gcs: Gcs, path: GcsPath, executor: ThreadPoolExecutor) -> None:
        self._gcs, self._path, self._executor = gcs, path, executor
        self._prefix = f"{parts_prefix(path)}{uuid.uuid4().hex}/"

    def upload_part(self, number: int, data: memoryview, crc: int) -> str:
        name = f"{self._prefix}{number:06d}"
        self._gcs.upload_object(self._path.bucket, name, data, crc, retried=False)
        return name

    def complete(self, tokens: list[str]) -> str:
        bucket, level, temporary = self._path.bucket, 0, list(tokens)
        while len(tokens) > MAX_COMPOSE_SOURCES:
            groups = [tokens[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(tokens), MAX_COMPOSE_SOURCES)]
            names = [f"{self._prefix}c{level}-{i:06d}" for i in range(len(groups))]
            list(self._executor.map(lambda g, n: self._gcs.compose(bucket, g, n), groups, names))
            temporary += names
            tokens, level = names, level + 1
        meta = self._gcs.compose(bucket, tokens, self._path.key)
        # The object is complete: the save returns now and the parts are deleted in the background
        # (the plugin's teardown waits for that); a part left behind is only clutter.
        for name in temporary:
            self._gcs.in_background(partial(self._gcs.delete, bucket, name),
                                    f"deleting part object gs://{bucket}/{name} of {self._path}")
        return meta.get("crc32c", "")

    def abort(self) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        names = self._gcs.list_names(self._path.bucket, self._prefix)
        list(self._executor.map(lambda n: self._gcs.delete(self._path.bucket, n), names))


class _KnownCrc32c:
    """A checksum object (as google-cloud-storage's media classes use them) with a known value."""

    def __init__(self, crc: int) -> None:
        self._crc = crc

    def digest(self) -> bytes:
        return struct.pack(">I", self._crc)


class _MemoryXMLMPUPart(XMLMPUPart):
    """``XMLMPUPart`` whose payload is a buffer in memory instead of a byte range of a file."""

    def __init__(self, upload_url: str, upload_id: str, number: int, data: memoryview, crc: int, headers: dict[str, str]) -> None:
        super().__init__(upload_url, upload_id, None, 0, len(data), number, headers=headers, checksum="crc32c", retry=None)
        self._payload = data
        self._crc = crc

    def _prepare_upload_request(self) -> tuple[str, str, Any, dict[str, str]]:
        if self.finished:
            raise ValueError("This part has already been uploaded.")
        self._checksum_object = _KnownCrc32c(self._crc)  # computed once, while the part was cut
        url = f"{self.upload_url}?partNumber={self.part_number}&uploadId={self.upload_id}"
        return "PUT", url, self._payload, self._headers


class _XmlMultipartEngine:
    """GCS XML multipart upload through google-cloud-storage's own MPU classes."""

    mode = "xml"

    def __init__(self, gcs: Gcs, path: GcsPath) -> None:
        self._gcs, self._path = gcs, path
        self._url = gcs.xml_url(*path)
        self._container = XMLMPUContainer(self._url, path.key, headers={}, retry=None)
        self._container.initiate(gcs.session, OCTET_STREAM, timeout=HTTP_TIMEOUT_S)

    def upload_part(self, number: int, data: memoryview, crc: int) -> str:
        part = _MemoryXMLMPUPart(self._url, self._container.upload_id, number, data, crc, {})
        part.upload(self._gcs.session, timeout=HTTP_TIMEOUT_S)
        return part.etag

    def complete(self, tokens: list[str]) -> str:
        for number, etag in enumerate(tokens, start=1):
            self._container.register_part(number, etag)
        self._gcs.retry.call(lambda: self._container.finalize(self._gcs.session, timeout=HTTP_TIMEOUT_S),
                             f"completion of the multipart upload of {self._path}")
        return self._gcs.stat(self._path).crc32c

    def abort(self) -> None:
        if self._container.upload_id is not None and not self._container.finished:
            self._container.cancel(self._gcs.session, timeout=HTTP_TIMEOUT_S)


def _start_engine(gcs: Gcs, path: GcsPath, mode: str, executor: ThreadPoolExecutor) -> _PartEngine:
    """The engine for ``mode``; ``auto`` probes XML multipart once per endpoint and bucket."""
    cache_key = (gcs.host, path.bucket)
    if mode == "auto":
        with _mode_lock:
            mode = _mode_cache.get(cache_key, "auto")
    if mode == "composite":
        return _CompositeEngine(gcs, path, executor)
    try:
        engine = gcs.retry.call(lambda: _XmlMultipartEngine(gcs, path), f"start of the multipart upload of {path}")
    except media_exceptions.InvalidResponse as exc:
        status = getattr(exc.response, "status_code", None)
        if mode == "xml" or status not in XML_UNSUPPORTED_STATUS:
            raise
        log.info("gs://%s does not serve XML multipart uploads (HTTP %s); using composite uploads",
                 path.bucket, status)
        with _mode_lock:
            _mode_cache[cache_key] = "composite"
        return _CompositeEngine(gcs, path, executor)
    with _mode_lock:
        _mode_cache[cache_key] = "xml"
    return engine


class _ChunkingWriter(io.RawIOBase):
    """A write-only file-like that cuts what is written into ``chunk_size`` buffers and hands each
    full one to :meth:`_submit_buffer`, with at most ``buffers`` buffers alive at once.

    ``close()`` (or leaving the ``with`` block normally) publishes the object; leaving it with an
    exception, or :meth:`abort`, discards the upload and leaves any previous object intact.
    """

    def __init__(self, gcs: Gcs, path: GcsPath, *, chunk_size: int, buffers: int) -> None:
        if chunk_size <= 0 or buffers <= 1:
            raise ValueError(f"chunk_size ({chunk_size}) and the number of workers must be positive")
        super().__init__()
        self._gcs, self.path = gcs, path
        self._chunk_size, self._buffers = chunk_size, buffers
        self._buffer: bytearray | None = None
        self._fill = 0
        self._size = 0
        self._crc = 0
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        self._allocated = 0
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future[Any]] = []
        self._done = False

    # io.RawIOBase ----------------------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: BytesLike) -> int:  # type: ignore[override]
        if self.closed or self._done:
            raise ValueError(f"write to a closed writer for {self.path}")
        view = memoryview(data).cast("B")
        offset, total = 0, view.nbytes
        while offset < total:
            # A full buffer is handed on only once more bytes follow, so that an object of exactly
            # one chunk still goes up in a single request.
            if self._fill == self._chunk_size:
                self._submit_buffer()
            if self._buffer is None:
                self._buffer = self._acquire_buffer()
            take = min(self._chunk_size - self._fill, total - offset)
            self._buffer[self._fill : self._fill + take] = view[offset : offset + take]
            self._fill += take
            offset += take
        self._size += total
        return total

    def close(self) -> None:
        """Finish the upload and publish the object (no-op when already closed)."""
        if self.closed:
            return
        try:
            if not self._done:
                self._finish()
                self._done = True
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

    # Buffers ---------------------------------------------------------------------------------
    def _acquire_buffer(self) -> bytearray:
        """A free buffer; when all exist and are in flight, this waits for an upload to finish."""
        while True:
            self._raise_if_failed()
            try:
                return self._free.get_nowait()
            except queue.Empty:
                pass
            if self._allocated < self._buffers:
                self._allocated += 1
                return bytearray(self._chunk_size)
            try:
                return self._free.get(timeout=BUFFER_WAIT_S)
            except queue.Empty:
                continue

    def _raise_if_failed(self) -> None:
        for future in self._futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _cut_part(self) -> tuple[bytearray, memoryview, int]:
        """Take the current buffer; returns it, a view of its filled bytes, and their crc32c."""
        buffer = self._buffer if self._buffer is not None else bytearray()
        data = memoryview(buffer)[: self._fill]
        crc = crc32c_extend(0, data)
        self._crc = crc32c_combine(self._crc, crc, data.nbytes)
        self._buffer, self._fill = None, 0
        return buffer, data, crc

    def _submit(self, fn: Any, *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._buffers - 1, thread_name_prefix="dataflux-upload")
        self._futures.append(self._executor.submit(fn, *args))

    def _wait_all(self) -> list[Any]:
        return [future.result() for future in self._futures]

    def _stop_parts(self) -> None:
        for future in self._futures:
            future.cancel()
        for future in self._futures:
            if not future.cancelled():
                future.exception()  # wait; the failure itself was reported to the writer

    def _check_stored_crc(self, stored: str) -> None:
        expected = crc32c_b64(self._crc)
        if stored != expected:
            log.error("%s: stored crc32c %s != written %s; deleting it", self.path, stored, expected)
            self._gcs.delete(*self.path)
            raise DataCorruptionError(f"{self.path}: stored crc32c {stored} != written {expected}")

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._buffer = None

    # Engine-specific -------------------------------------------------------------------------
    def _submit_buffer(self) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Discard the upload; nothing is published."""
        raise NotImplementedError


class ObjectWriter(_ChunkingWriter):
    """Uploads ``path`` in ``chunk_size`` parts, ``max_workers`` at a time, while it is written."""

    def __init__(self, gcs: Gcs, path: GcsPath, *, chunk_size: int, max_workers: int, mode: str = "auto") -> None:
        if mode not in UPLOAD_MODES:
            raise ValueError(f"upload mode must be one of {UPLOAD_MODES}, not {mode!r}")
        super().__init__(gcs, path, chunk_size=chunk_size, buffers=max_workers + 1)
        self._mode = mode
        self._engine: _PartEngine | None = None

    def _submit_buffer(self) -> None:
        if self._engine is None:
            self._executor = ThreadPoolExecutor(self._buffers - 1, thread_name_prefix="dataflux-upload")
            self._engine = _start_engine(self._gcs, self.path, self._mode, self._executor)
            log.debug("uploading %s in parts with the %s engine", self.path, self._engine.mode)
        buffer, data, crc = self._cut_part()
        self._submit(self._upload_part, len(self._futures) + 1, buffer, data, crc)

    def _upload_part(self, number: int, buffer: bytearray, data: memoryview, crc: int) -> str:
        what = f"upload of part {number} of {self.path.uri} (bucket {self.path.bucket}, key {self.path.key})"
        assert self._engine is not None
        engine = self._engine
        try:
            return self._gcs.retry.call(lambda: engine.upload_part(number, data, crc), what)
        except Exception as exc:
            raise TransferError(f"{what} failed: {exc}") from exc
        finally:
            self._free.put(buffer)

    def _finish(self) -> None:
        if self._engine is None:
            # Everything fits in one part: a single upload straight to the final name.
            _, data, crc = self._cut_part()
            self._gcs.upload_object(self.path.bucket, self.path.key, data, crc)
            return
        if self._fill:
            self._submit_buffer()
        tokens = self._wait_all()
        self._check_stored_crc(self._engine.complete(tokens))
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
                self._engine.abort()
            except Exception:
                log.exception("cleanup after the failed upload of %s failed", self.path)
        self._shutdown()


class StreamingWriter(_ChunkingWriter):
    """One streaming resumable upload (``blob.open("wb")``): the transfer-manager-disabled path.

    A single background thread feeds the upload while the caller fills the next buffer, so
    serialization and upload overlap; requests stay strictly sequential.
    """

    def __init__(self, gcs: Gcs, path: GcsPath, *, chunk_size: int) -> None:
        super().__init__(gcs, path, chunk_size=chunk_size, buffers=2)
        blob = gcs.client.bucket(path.bucket).blob(path.key)
        # The resumable upload finalizes the object only on close(); terminate() abandons it.
        self._inner = blob.open("wb", chunk_size=chunk_size, content_type=OCTET_STREAM,
                                checksum="crc32c", ignore_flush=True)

    def _submit_buffer(self) -> None:
        buffer, data, _ = self._cut_part()
        self._submit(self._send, buffer, data)

    def _send(self, buffer: bytearray, data: memoryview) -> None:
        try:
            self._inner.write(data)
        except Exception as exc:
            raise TransferError(f"streaming upload of {self.path} failed: {exc}") from exc
        finally:
            self._free.put(buffer)

    def _finish(self) -> None:
        if self._fill:
            self._submit_buffer()
        self._wait_all()
        self._inner.close()
        self._check_stored_crc(self._gcs.stat(self.path).crc32c)

    def abort(self) -> None:
        """Abandon the resumable upload; nothing is published."""
        if self._done:
            return
        self._done = True
        self._stop_parts()
        try:
            self._inner.terminate()
        except Exception as exc:
            log.debug("terminating the resumable upload of %s: %s", self.path, exc)
        self._shutdown()
