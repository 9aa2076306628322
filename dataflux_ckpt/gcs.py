"""One helper through which the plugin talks to GCS: client creation, URLs, and every HTTP call.

Requests go through the storage client's own authorized ``requests`` session, so credentials,
token refresh and the endpoint (``STORAGE_EMULATOR_HOST`` included) are the client's. Every call
takes the :class:`~dataflux_ckpt.retry.Deadline` of the operation it serves: its timeout never
runs past it, and its retries stop there.

Wire formats live here and only here: the JSON API (metadata, media and resumable uploads, compose,
delete, list), GCS's XML API multipart uploads, and ranged media downloads.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple

import requests
from google.cloud import storage

from dataflux_ckpt import _gcs_compat, paths
from dataflux_ckpt.checksums import crc32c_b64
from dataflux_ckpt.emulator import EMULATOR_HOST_ENV, EMULATOR_PROJECT
from dataflux_ckpt.errors import (
    BucketNotFoundError,
    ConcurrentWriteError,
    DataCorruptionError,
    HttpStatusError,
)
from dataflux_ckpt.paths import GcsPath
from dataflux_ckpt.retry import Deadline, RetryPolicy

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 60.0
SPARE_CONNECTIONS = 4
BACKGROUND_THREADS = 2
OCTET_STREAM = "application/octet-stream"
S3_NAMESPACE = "{http://s3.amazonaws.com/doc/2006-03-01/}"
# Error codes with which GCS's XML API says a part's bytes did not match their checksum.
XML_DIGEST_ERRORS = frozenset({"BadDigest", "InvalidDigest", "CrcMismatch"})


def make_client(project: str | None = None) -> storage.Client:
    """A storage client from the environment: anonymous against an emulator, ADC otherwise."""
    if os.environ.get(EMULATOR_HOST_ENV):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or EMULATOR_PROJECT, credentials=AnonymousCredentials())
    return storage.Client(project=project)


class ObjectInfo(NamedTuple):
    """One generation of an object: what a load reads and what a save published."""

    size: int
    crc32c: str
    generation: int


class ListedObject(NamedTuple):
    """An object as a listing shows it; ``created`` is the server's clock (seconds since the epoch)."""

    name: str
    generation: int
    created: float


def _info(meta: dict[str, Any]) -> ObjectInfo:
    return ObjectInfo(int(meta.get("size", 0)), meta.get("crc32c", ""), int(meta.get("generation") or 0))


_RFC3339_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:?\d\d)$")


def _rfc3339(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time (any number of fractional digits, unlike
    ``datetime.fromisoformat`` before Python 3.11); ``inf`` when unreadable, so that nothing
    counts as old by mistake."""
    match = _RFC3339_RE.match(text.strip())
    if match is None:
        return math.inf
    offset = "+0000" if match[3] == "Z" else match[3].replace(":", "")
    moment = datetime.strptime(match[1] + offset, "%Y-%m-%dT%H:%M:%S%z")
    return moment.timestamp() + float(match[2] or 0)


class Gcs:
    """GCS operations on behalf of one plugin: one client, one connection pool.

    Also owns what is learnt per bucket (whether it serves XML multipart uploads; see
    :attr:`upload_modes`), the threads that run ranged reads (:meth:`transfer_threads`), and a small
    pool of background threads for housekeeping.

    Args:
        client: the ``google.cloud.storage.Client`` whose session, credentials and endpoint are used.
        retry: retry policy for each request.
        connections: concurrent requests to expect (the connection pool is sized for them); also the
            number of threads that run ranged reads.
        request_timeout_s: how long one request may wait for the server to accept or answer
            (per socket operation; the operation's deadline bounds the whole).
        connect_timeout_s: how long opening a connection may take.

    Raises:
        UnsupportedDependencyError: the installed google-cloud-storage lacks an internal this needs.
    """

    def __init__(
        self,
        client: storage.Client,
        *,
        retry: RetryPolicy | None = None,
        connections: int = 8,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        if not request_timeout_s > 0 or not connect_timeout_s > 0:
            raise ValueError(f"timeouts must be positive, not {request_timeout_s!r} and {connect_timeout_s!r}")
        self.client = client
        self.retry = retry or RetryPolicy()
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.connections = connections
        self.session = _gcs_compat.authorized_session(client)
        self.host = _gcs_compat.api_endpoint(client)
        #: Upload mode ("xml" or "composite") found for each bucket by ``upload_mode="auto"``.
        self.upload_modes: dict[str, str] = {}
        self._modes_lock = threading.Lock()
        self._ensure_pool(connections + SPARE_CONNECTIONS + BACKGROUND_THREADS)
        self._background: ThreadPoolExecutor | None = None
        self._transfers: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()
        self._pending_lock = threading.Lock()
        self._pid = os.getpid()

    def _ensure_pool(self, size: int) -> None:
        for prefix in ("https://", "http://"):
            current = _gcs_compat.pool_size(self.session, prefix)
            if current is not None and current < size:
                self.session.mount(prefix, requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=size))

    # What is learnt per bucket ---------------------------------------------------------------
    def upload_mode(self, bucket: str) -> str | None:
        """The upload mode found for ``bucket`` so far (``None`` before the first parallel upload)."""
        with self._modes_lock:
            return self.upload_modes.get(bucket)

    def remember_upload_mode(self, bucket: str, mode: str) -> None:
        """Record the upload mode found for ``bucket``."""
        with self._modes_lock:
            self.upload_modes[bucket] = mode

    def reset_upload_modes(self) -> None:
        """Forget what was found; the next parallel upload to each bucket probes again."""
        with self._modes_lock:
            self.upload_modes.clear()

    # Threads -------------------------------------------------------------------------------------
    def transfer_threads(self) -> ThreadPoolExecutor:
        """The ``connections`` threads that run ranged reads for every reader of this helper, started
        on first use and kept until :meth:`close`.

        Why kept: starting a thread waits until the scheduler runs it (about 7 ms each, measured on 2
        cores beside a running download), which would delay the last ranges of every load. Tasks run
        here never wait on one another, so readers sharing the threads only queue behind each other.
        """
        self._in_this_process()
        with self._pending_lock:
            if self._transfers is None:
                self._transfers = ThreadPoolExecutor(self.connections, thread_name_prefix="dataflux-transfer")
            return self._transfers

    def _in_this_process(self) -> None:
        """Start over in a forked child (``ddp_fork``, ``ddp_notebook``): the parent's threads did not
        survive the fork (work queued to them would never run, and one may have held the lock), and its
        pooled connections are still the parent's, and every other child's."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._pending_lock = threading.Lock()
        self._transfers = self._background = None
        self._pending = set()
        for adapter in self.session.adapters.values():
            adapter.close()  # this process' copies of the sockets; the next request connects anew

    # Background housekeeping -----------------------------------------------------------------
    def in_background(self, fn: Callable[[], Any], what: str) -> None:
        """Run ``fn`` (housekeeping no caller needs to wait for, such as deleting the part objects
        of a completed upload) on a background thread; a failure is logged as a warning.
        :meth:`wait_background` waits for everything submitted so far."""
        self._in_this_process()
        with self._pending_lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix="dataflux-background")
            future = self._background.submit(fn)
            self._pending.add(future)

        def done(finished: Future[None]) -> None:
            with self._pending_lock:
                self._pending.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                log.warning("%s failed: %s", what, finished.exception())

        future.add_done_callback(done)

    def wait_background(self, timeout_s: float | None = None) -> bool:
        """Wait for the background housekeeping submitted so far; ``False`` if some is still running
        after ``timeout_s``."""
        self._in_this_process()
        with self._pending_lock:
            pending = list(self._pending)
        return not wait(pending, timeout=timeout_s).not_done

    def close(self, timeout_s: float | None = None, *, close_session: bool = True) -> bool:
        """Wait (up to ``timeout_s``) for background housekeeping, stop its threads, and close the
        connections (unless ``close_session=False``: the session belongs to a caller's client).

        Returns:
            ``False`` when housekeeping was still running after ``timeout_s``.
        """
        finished = self.wait_background(timeout_s)
        with self._pending_lock:
            if self._background is not None:
                self._background.shutdown(wait=False, cancel_futures=True)
                self._background = None
            if self._transfers is not None:
                # Readers still open keep their queued ranges (each reader's close waits for its own).
                self._transfers.shutdown(wait=False)
                self._transfers = None
        if close_session:
            self.session.close()
        return finished

    # URLs ------------------------------------------------------------------------------------
    def object_url(self, bucket: str, name: str) -> str:
        """The JSON API URL of an object's metadata."""
        return self.host + paths.object_url_path(bucket, name)

    def media_url(self, bucket: str, name: str) -> str:
        """The JSON API URL of an object's bytes."""
        return self.host + paths.media_url_path(bucket, name)

    def xml_url(self, bucket: str, name: str) -> str:
        """The XML API URL of an object (multipart uploads)."""
        return self.host + paths.xml_url_path(bucket, name)

    # Requests --------------------------------------------------------------------------------
    def request(self, method: str, url: str, what: str, deadline: Deadline, ok: tuple[int, ...] = (200,),
                **kwargs: Any) -> requests.Response:
        """One HTTP request that ends by ``deadline``; an unexpected status raises :class:`HttpStatusError`."""
        kwargs["timeout"] = deadline.timeout(self.connect_timeout_s, self.request_timeout_s)
        self._in_this_process()
        response = self.session.request(method, url, **kwargs)
        if response.status_code not in ok:
            body = response.text if not kwargs.get("stream") else ""
            response.close()
            raise HttpStatusError(response.status_code, what, body)
        return response

    def _call(self, what: str, deadline: Deadline, fn: Callable[[], Any]) -> Any:
        return self.retry.call(fn, what, deadline)

    def bucket_exists(self, bucket: str, deadline: Deadline) -> bool | None:
        """Whether ``bucket`` exists; ``None`` when these credentials may not look (HTTP 403)."""
        url = f"{self.host}{paths.bucket_url_path(bucket)}?fields=name"
        what = f"look-up of bucket gs://{bucket}"
        response = self._call(what, deadline, lambda: self.request("GET", url, what, deadline, ok=(200, 403, 404)))
        return {200: True, 404: False}.get(response.status_code)

    def _not_found(self, path: GcsPath, deadline: Deadline) -> FileNotFoundError:
        """The error for a 404 on ``path``: the bucket is missing, or only the object."""
        if self.bucket_exists(path.bucket, deadline) is False:
            return BucketNotFoundError(f"bucket {path.bucket!r} of {path.uri} does not exist")
        return FileNotFoundError(f"no GCS object at {path.uri}")

    def stat(self, path: GcsPath, deadline: Deadline) -> ObjectInfo:
        """Size, crc32c and generation of ``path``.

        Raises:
            FileNotFoundError: no object at ``path``.
            BucketNotFoundError: the bucket does not exist.
        """
        what = f"stat of {path}"
        url = self.object_url(*path) + "?fields=size,crc32c,generation"
        response = self._call(what, deadline, lambda: self.request("GET", url, what, deadline, ok=(200, 404)))
        if response.status_code == 404:
            raise self._not_found(path, deadline)
        return _info(response.json())

    def current_generation(self, path: GcsPath, deadline: Deadline) -> int:
        """The generation at ``path`` now, ``0`` when there is no object (a precondition for creating it).

        Raises:
            BucketNotFoundError: the bucket does not exist.
        """
        try:
            return self.stat(path, deadline).generation
        except BucketNotFoundError:
            raise
        except FileNotFoundError:
            return 0

    def _published(self, path: GcsPath, what: str, response: requests.Response, retried: bool,
                   expected_crc: str, deadline: Deadline) -> ObjectInfo:
        """The generation a publishing request created, from its own answer.

        A 412 means another writer's generation is there now; after a retry it may also mean the
        first attempt succeeded without its answer arriving: then the object there is ours when it
        has our size and crc32c.
        """
        if response.status_code == 412:
            if retried:
                try:
                    info = self.stat(path, deadline)
                except FileNotFoundError:
                    info = None
                if info is not None and info.crc32c == expected_crc:
                    return info
            raise ConcurrentWriteError(path.uri, what)
        return _info(response.json())

    def upload_object(self, path: GcsPath, data: memoryview, crc: int, deadline: Deadline, *,
                      if_generation_match: int | None = None) -> ObjectInfo:
        """Upload ``data`` as one object in one request; the server checks its crc32c.

        Raises:
            BucketNotFoundError: the bucket does not exist.
            ConcurrentWriteError: ``if_generation_match`` did not hold.
            DataCorruptionError: the server stored other bytes than were sent.
        """
        what = f"upload of {path}"
        expected = crc32c_b64(crc)
        url = self.host + paths.upload_url_path(path.bucket, path.key, "media")
        params: dict[str, str] = {}
        if if_generation_match is not None:
            params["ifGenerationMatch"] = str(if_generation_match)
        attempts = 0

        def put() -> ObjectInfo:
            nonlocal attempts
            attempts += 1
            response = self.request(
                "POST", url, what, deadline, ok=(200, 404, 412),
                params=params, data=data,
                headers={"Content-Type": OCTET_STREAM, "X-Goog-Hash": f"crc32c={expected}"},
            )
            if response.status_code == 404:  # an upload finds no object to miss: the bucket is missing
                raise BucketNotFoundError(f"bucket {path.bucket!r} of {path.uri} does not exist")
            info = self._published(path, what, response, attempts > 1, expected, deadline)
            if info.crc32c != expected:
                raise DataCorruptionError(f"{what}: server crc32c {info.crc32c} != sent {expected}")
            return info

        return self._call(what, deadline, put)

    def upload_part_object(self, bucket: str, name: str, data: memoryview, crc: int, deadline: Deadline) -> int:
        """One attempt at uploading a temporary part object; returns its generation.

        Raises:
            DataCorruptionError: the server stored other bytes than were sent (worth a retry).
        """
        expected = crc32c_b64(crc)
        what = f"upload of gs://{bucket}/{name}"
        response = self.request(
            "POST", self.host + paths.upload_url_path(bucket, name, "media"), what, deadline, data=data,
            headers={"Content-Type": OCTET_STREAM, "X-Goog-Hash": f"crc32c={expected}"},
        )
        info = _info(response.json())
        if info.crc32c != expected:
            raise DataCorruptionError(f"{what}: server crc32c {info.crc32c} != sent {expected}")
        return info.generation

    def compose(self, bucket: str, sources: list[str], destination: str, deadline: Deadline, *,
                if_generation_match: int | None = None, expected_crc: str = "") -> ObjectInfo:
        """Compose up to 32 ``sources`` (in order) into ``destination``; the new generation.

        Raises:
            ConcurrentWriteError: ``if_generation_match`` did not hold.
        """
        path = GcsPath(bucket, destination)
        what = f"compose of {len(sources)} parts into {path}"
        body = {"sourceObjects": [{"name": name} for name in sources], "destination": {"contentType": OCTET_STREAM}}
        params = {} if if_generation_match is None else {"ifGenerationMatch": str(if_generation_match)}
        url = f"{self.object_url(bucket, destination)}/compose"
        attempts = 0

        def post() -> ObjectInfo:
            nonlocal attempts
            attempts += 1
            response = self.request("POST", url, what, deadline, ok=(200, 412), params=params, json=body)
            return self._published(path, what, response, attempts > 1, expected_crc, deadline)

        return self._call(what, deadline, post)

    def delete(self, bucket: str, name: str, deadline: Deadline, *, if_generation_match: int | None = None) -> bool:
        """Delete an object (only generation ``if_generation_match``, when given).

        Returns:
            Whether it was deleted: ``False`` when it was already gone or is another generation now.
        """
        what = f"delete of gs://{bucket}/{name}"
        params = {} if if_generation_match is None else {"ifGenerationMatch": str(if_generation_match)}
        response = self._call(what, deadline, lambda: self.request(
            "DELETE", self.object_url(bucket, name), what, deadline, ok=(200, 204, 404, 412), params=params))
        return response.status_code in (200, 204)

    def list_objects(self, bucket: str, prefix: str, deadline: Deadline) -> tuple[list[ListedObject], float | None]:
        """The objects under ``prefix``, and the server's clock when it listed them (``None`` if unknown).

        Raises:
            BucketNotFoundError: the bucket does not exist.
        """
        objects: list[ListedObject] = []
        params: dict[str, str] = {"prefix": prefix, "fields": "items(name,generation,timeCreated),nextPageToken"}
        url = f"{self.host}{paths.bucket_url_path(bucket)}/o"
        what = f"listing of gs://{bucket}/{prefix}"
        now: float | None = None
        while True:
            response = self._call(what, deadline, lambda: self.request("GET", url, what, deadline, ok=(200, 404),
                                                                       params=params))
            if response.status_code == 404:
                raise BucketNotFoundError(f"bucket {bucket!r} of gs://{bucket}/{prefix} does not exist")
            if now is None and response.headers.get("Date"):
                now = parsedate_to_datetime(response.headers["Date"]).timestamp()
            page = response.json()
            for item in page.get("items", []):
                created = _rfc3339(item["timeCreated"]) if item.get("timeCreated") else 0.0
                objects.append(ListedObject(item["name"], int(item.get("generation") or 0), created))
            token = page.get("nextPageToken")
            if not token:
                return objects, now
            params["pageToken"] = token

    def list_names(self, bucket: str, prefix: str, deadline: Deadline) -> list[str]:
        """Names of the objects under ``prefix``."""
        return [item.name for item in self.list_objects(bucket, prefix, deadline)[0]]

    # XML API multipart uploads ---------------------------------------------------------------
    def xml_initiate(self, path: GcsPath, deadline: Deadline) -> str:
        """Start an XML multipart upload to ``path``; its upload id.

        Raises:
            HttpStatusError: the server refused (400/404/405/501 where it does not serve the XML API).
        """
        what = f"start of the multipart upload of {path}"

        def post() -> str:
            response = self.request("POST", f"{self.xml_url(*path)}?uploads", what, deadline,
                                    headers={"Content-Type": OCTET_STREAM})
            upload_id = ElementTree.fromstring(response.content).findtext(f"{S3_NAMESPACE}UploadId")
            if not upload_id:
                raise HttpStatusError(response.status_code, what, "no UploadId in the answer")
            return upload_id

        return self._call(what, deadline, post)

    def xml_upload_part(self, path: GcsPath, upload_id: str, number: int, data: memoryview, crc: int,
                        deadline: Deadline) -> str:
        """One attempt at uploading part ``number``; its ETag. The server checks the part's crc32c.

        Raises:
            DataCorruptionError: the bytes the server received do not match (worth a retry).
        """
        what = f"upload of part {number} of {path}"
        expected = crc32c_b64(crc)
        response = self.request(
            "PUT", f"{self.xml_url(*path)}?partNumber={number}&uploadId={paths.encode(upload_id)}", what, deadline,
            ok=(200, 400), data=data, headers={"x-goog-hash": f"crc32c={expected}"},
        )
        if response.status_code == 400:
            code = _xml_error_code(response.content)
            if code in XML_DIGEST_ERRORS:
                raise DataCorruptionError(f"{what}: the server received other bytes than were sent ({code})")
            raise HttpStatusError(400, what, response.text)
        received = _hashes(response.headers.get("x-goog-hash", "")).get("crc32c")
        if received is not None and received != expected:
            raise DataCorruptionError(f"{what}: server crc32c {received} != sent {expected}")
        etag = response.headers.get("ETag")
        if not etag:
            raise HttpStatusError(response.status_code, what, "no ETag in the answer")
        return etag

    def xml_complete(self, path: GcsPath, upload_id: str, etags: list[str], deadline: Deadline) -> tuple[int | None, str | None]:
        """Complete the upload with parts ``1..len(etags)``.

        Returns:
            The new object's generation and crc32c as the answer carries them (``None`` where it does not).
        """
        what = f"completion of the multipart upload of {path}"
        root = ElementTree.Element("CompleteMultipartUpload")
        for number, etag in enumerate(etags, start=1):
            part = ElementTree.SubElement(root, "Part")
            ElementTree.SubElement(part, "PartNumber").text = str(number)
            ElementTree.SubElement(part, "ETag").text = etag
        body = ElementTree.tostring(root)
        url = f"{self.xml_url(*path)}?uploadId={paths.encode(upload_id)}"

        def post() -> tuple[int | None, str | None]:
            response = self.request("POST", url, what, deadline, data=body,
                                    headers={"Content-Type": "application/xml"})
            generation = response.headers.get("x-goog-generation")
            crc = _hashes(response.headers.get("x-goog-hash", "")).get("crc32c")
            return (int(generation) if generation else None), crc

        return self._call(what, deadline, post)

    def xml_abort(self, path: GcsPath, upload_id: str, deadline: Deadline) -> None:
        """Abort the upload; its parts are discarded. An upload already gone is fine."""
        what = f"abort of the multipart upload of {path}"
        url = f"{self.xml_url(*path)}?uploadId={paths.encode(upload_id)}"
        self._call(what, deadline, lambda: self.request("DELETE", url, what, deadline, ok=(200, 204, 404)))

    # Resumable uploads -----------------------------------------------------------------------
    def resumable_start(self, path: GcsPath, deadline: Deadline, *, if_generation_match: int | None = None) -> str:
        """Open a resumable upload session for ``path``; its URL.

        GCS evaluates the generation precondition when the session finishes; a server that evaluates
        it already here fails the same way.

        Raises:
            BucketNotFoundError: the bucket does not exist.
            ConcurrentWriteError: ``if_generation_match`` did not hold.
        """
        what = f"start of the resumable upload of {path}"
        url = self.host + paths.upload_url_path(path.bucket, path.key, "resumable")
        params: dict[str, str] = {}
        if if_generation_match is not None:
            params["ifGenerationMatch"] = str(if_generation_match)

        def post() -> str:
            response = self.request("POST", url, what, deadline,
                                    ok=(200, 201, 404, 412), params=params, json={"contentType": OCTET_STREAM},
                                    headers={"X-Upload-Content-Type": OCTET_STREAM})
            if response.status_code == 404:
                raise self._not_found(path, deadline)
            if response.status_code == 412:  # nothing was started, so a retry cannot have caused it
                raise ConcurrentWriteError(path.uri, what)
            location = response.headers.get("Location")
            if not location:
                raise HttpStatusError(response.status_code, what, "no session URL (Location) in the answer")
            return location

        return self._call(what, deadline, post)

    def resumable_send(self, path: GcsPath, session_url: str, data: memoryview, offset: int, total: int | None,
                       deadline: Deadline) -> ObjectInfo | None:
        """Send ``data`` (the bytes at ``offset``) to the session; ``total`` is given with the last bytes.

        After a failed attempt the server is asked how much it kept, and only the rest is sent again.

        Returns:
            The new object when the upload finished, ``None`` while more is expected.

        Raises:
            ConcurrentWriteError: the session's generation precondition did not hold at the end.
        """
        what = f"resumable upload of bytes {offset}-{offset + len(data) - 1} of {path}"
        size = "*" if total is None else str(total)
        attempts = 0

        def put() -> ObjectInfo | None:
            nonlocal attempts
            attempts += 1
            start = offset
            if attempts > 1:
                status = self.request("PUT", session_url, what, deadline, ok=(200, 201, 308, 412),
                                      headers={"Content-Range": f"bytes */{size}"}, data=b"")
                if status.status_code != 308:
                    return self._finished(path, what, status)
                start = _persisted(status.headers.get("Range"))
                if not offset <= start <= offset + len(data):
                    raise HttpStatusError(308, what, f"the session kept {start} bytes, outside this request")
            chunk = data[start - offset:]
            last = start + len(chunk) - 1
            content_range = f"bytes {start}-{last}/{size}" if len(chunk) else f"bytes */{size}"
            response = self.request("PUT", session_url, what, deadline, ok=(200, 201, 308, 412), data=chunk,
                                    headers={"Content-Range": content_range})
            if response.status_code == 308:
                kept = _persisted(response.headers.get("Range"))
                if kept != start + len(chunk):
                    raise HttpStatusError(308, what, f"the session kept {kept} of {start + len(chunk)} bytes")
                return None
            return self._finished(path, what, response)

        return self._call(what, deadline, put)

    @staticmethod
    def _finished(path: GcsPath, what: str, response: requests.Response) -> ObjectInfo:
        if response.status_code == 412:
            raise ConcurrentWriteError(path.uri, what)
        return _info(response.json())

    def resumable_cancel(self, session_url: str, deadline: Deadline) -> None:
        """Abandon a resumable upload session; nothing is published."""
        self.request("DELETE", session_url, "cancel of a resumable upload", deadline,
                     ok=(200, 204, 404, 410, 499))

    # Downloads -------------------------------------------------------------------------------
    def open_range(self, path: GcsPath, generation: int, start: int, end: int, deadline: Deadline) -> requests.Response:
        """A streamed GET of bytes ``[start, end)`` of one generation of ``path``."""
        url = self.media_url(*path) + (f"&generation={generation}" if generation else "")
        what = f"download of bytes {start}-{end - 1} of {path}"
        response = self.request("GET", url, what, deadline, ok=(200, 206, 404), stream=True,
                                headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        if response.status_code == 404:
            response.close()
            raise FileNotFoundError(f"{what}: generation {generation} of {path} is gone (the object was "
                                    f"replaced or deleted while it was being read)")
        if response.status_code == 200 and (start, end) != (0, int(response.headers.get("Content-Length", -1))):
            response.close()
            raise HttpStatusError(200, f"{what}: the server ignored the Range header")
        return response


def _persisted(range_header: str | None) -> int:
    """Bytes a resumable session has kept, from its ``Range: bytes=0-N`` answer."""
    if not range_header:
        return 0
    return int(range_header.rpartition("-")[2]) + 1


def _hashes(header: str) -> dict[str, str]:
    """``x-goog-hash: crc32c=...,md5=...`` as a dict."""
    found = {}
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if value:
            found[name.lower()] = value
    return found


def _xml_error_code(body: bytes) -> str:
    try:
        return ElementTree.fromstring(body).findtext("Code") or ""
    except ElementTree.ParseError:
        return ""
