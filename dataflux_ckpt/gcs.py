"""One helper through which the plugin talks to GCS: client creation, URLs, and the JSON API calls.

Requests go through the storage client's own authorized ``requests`` session, so credentials,
token refresh and the endpoint (``STORAGE_EMULATOR_HOST`` included) are the client's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple
from urllib.parse import quote

import requests
from google.cloud import storage
from google.cloud.storage.blob import _get_host_name

from dataflux_ckpt.checksums import crc32c_b64
from dataflux_ckpt.errors import DataCorruptionError, HttpStatusError
from dataflux_ckpt.paths import GcsPath
from dataflux_ckpt.retry import RetryPolicy

log = logging.getLogger(__name__)

EMULATOR_HOST_ENV = "STORAGE_EMULATOR_HOST"
EMULATOR_PROJECT = "test-project"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
SPARE_CONNECTIONS = 4
BACKGROUND_THREADS = 2
OCTET_STREAM = "application/octet-stream"


def make_client(project: str | None = None) -> storage.Client:
    """A storage client from the environment: anonymous against an emulator, ADC otherwise."""
    if os.environ.get(EMULATOR_HOST_ENV):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or EMULATOR_PROJECT, credentials=AnonymousCredentials())
    return storage.Client(project=project)


class ObjectInfo(NamedTuple):
    """What a load needs to know about an object before reading it."""

    size: int
    crc32c: str
    generation: str


def _q(name: str) -> str:
    return quote(name, safe="")


class Gcs:
    """GCS operations on behalf of one plugin (one client, one connection pool)."""

    def __init__(self, client: storage.Client, retry: RetryPolicy, connections: int) -> None:
        self.client = client
        self.retry = retry
        self.session: requests.Session = client._http
        self.host = _get_host_name(client._connection).rstrip("/")
        self._ensure_pool(connections + SPARE_CONNECTIONS + BACKGROUND_THREADS)
        self._background: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()
        self._pending_lock = threading.Lock()

    def _ensure_pool(self, size: int) -> None:
        for prefix in ("https://", "http://"):
            adapter = self.session.get_adapter(prefix)
            if getattr(adapter, "_pool_maxsize", size) < size:
                self.session.mount(prefix, requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=size))

    # Background housekeeping -----------------------------------------------------------------
    def in_background(self, fn: Callable[[], Any], what: str) -> None:
        """Run ``fn`` (housekeeping no caller needs to wait for, such as deleting the part objects
        of a completed upload) on a background thread; a failure is logged as a warning.
        :meth:`wait_background` waits for everything submitted so far."""
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

    def wait_background(self) -> None:
        """Wait for the background housekeeping submitted so far."""
        with self._pending_lock:
            pending = list(self._pending)
        wait(pending)

    # URLs ------------------------------------------------------------------------------------
    def object_url(self, bucket: str, name: str) -> str:
        return f"{self.host}/storage/v1/b/{_q(bucket)}/o/{_q(name)}"

    def media_url(self, bucket: str, name: str) -> str:
        return f"{self.host}/download/storage/v1/b/{_q(bucket)}/o/{_q(name)}?alt=media"

    def xml_url(self, bucket: str, name: str) -> str:
        return f"{self.host}/{_q(bucket)}/{quote(name, safe='/')}"

    # Requests --------------------------------------------------------------------------------
    def request(self, method: str, url: str, what: str, ok: tuple[int, ...] = (200,), **kwargs: Any) -> requests.Response:
        """One HTTP request; an unexpected status raises :class:`HttpStatusError`."""
        kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
        response = self.session.request(method, url, **kwargs)
        if response.status_code not in ok:
            body = response.text if not kwargs.get("stream") else ""
            response.close()
            raise HttpStatusError(response.status_code, what, body)
        return response

    def stat(self, path: GcsPath) -> ObjectInfo:
        """Size, crc32c and generation of ``path``; a missing object raises ``FileNotFoundError``."""

        def get() -> requests.Response:
            return self.request("GET", self.object_url(*path), f"stat {path}", ok=(200, 404))

        response = self.retry.call(get, f"stat {path}")
        if response.status_code == 404:
            raise FileNotFoundError(f"no GCS object at {path.uri}")
        meta = response.json()
        return ObjectInfo(int(meta["size"]), meta.get("crc32c", ""), str(meta.get("generation", "")))

    def upload_object(self, bucket: str, name: str, data: memoryview, crc: int, *, retried: bool = True) -> dict[str, Any]:
        """Upload ``data`` as one object (one request) and check the crc32c the server computed.

        ``retried=False`` makes one attempt, for callers that retry around it.
        """
        what = f"upload of gs://{bucket}/{name}"
        expected = crc32c_b64(crc)

        def put() -> dict[str, Any]:
            response = self.request(
                "POST",
                f"{self.host}/upload/storage/v1/b/{_q(bucket)}/o?uploadType=media&name={_q(name)}",
                what,
                data=data,
                headers={"Content-Type": OCTET_STREAM, "X-Goog-Hash": f"crc32c={expected}"},
            )
            meta = response.json()
            if meta.get("crc32c") != expected:
                raise DataCorruptionError(
                    f"{what}: server crc32c {meta.get('crc32c')} != sent {expected}"
                )
            return meta

        return self.retry.call(put, what) if retried else put()

    def compose(self, bucket: str, sources: list[str], destination: str) -> dict[str, Any]:
        """Compose up to 32 ``sources`` (in order) into ``destination``; returns its metadata."""
        what = f"compose of {len(sources)} parts into gs://{bucket}/{destination}"
        body = {
            "sourceObjects": [{"name": name} for name in sources],
            "destination": {"contentType": OCTET_STREAM},
        }
        url = f"{self.object_url(bucket, destination)}/compose"
        return self.retry.call(lambda: self.request("POST", url, what, json=body).json(), what)

    def delete(self, bucket: str, name: str) -> None:
        """Delete an object; one that is already gone is fine."""
        what = f"delete of gs://{bucket}/{name}"
        self.retry.call(
            lambda: self.request("DELETE", self.object_url(bucket, name), what, ok=(200, 204, 404)), what
        )

    def list_names(self, bucket: str, prefix: str) -> list[str]:
        """Names of all objects under ``prefix``."""
        names: list[str] = []
        params: dict[str, str] = {"prefix": prefix, "fields": "items(name),nextPageToken"}
        url = f"{self.host}/storage/v1/b/{_q(bucket)}/o"
        what = f"listing of gs://{bucket}/{prefix}"
        while True:
            page = self.retry.call(lambda: self.request("GET", url, what, params=params).json(), what)
            names.extend(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken")
            if not token:
                return names
            params["pageToken"] = token
