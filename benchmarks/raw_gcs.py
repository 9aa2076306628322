"""GCS transfers with no client library in the way: the ceilings of ``benchmarks.lightning_ckpt``.

:class:`RawGcs` speaks plain HTTP/1.1 to a local GCS endpoint (fake-gcs-server, the XML multipart server
in front of it, or a network model in front of both) over keep-alive connections, one per worker thread,
the way a client library's connection pool does, and does only what each protocol needs:

* :meth:`RawGcs.single_upload`: one media upload request;
* :meth:`RawGcs.xml_multipart_upload`: XML API multipart upload, parts on parallel connections;
* :meth:`RawGcs.composite_upload`: part objects on parallel connections, then one compose;
* :meth:`RawGcs.download` / :meth:`RawGcs.download_into`: parallel ranged GETs straight into one buffer
  (optionally checking their crc32c).
"""

from __future__ import annotations

import http.client
import json
import mmap
import threading
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlencode, urlsplit

from dataflux_ckpt.checksums import crc32c_combine, crc32c_extend
from lightning_storage_plugins.memoryfile import MemoryFile

HTTP_TIMEOUT_S = 300.0
MAX_COMPOSE_SOURCES = 32
READ_BLOCK_BYTES = 4 * 2**20
OCTET_STREAM = "application/octet-stream"

#: A seekable read-only file over a download buffer (``torch.load`` reads the ceiling's bytes through it).
MemoryReader = MemoryFile


class RawGcsError(RuntimeError):
    """A request was answered with an unexpected status; the message names it and the target."""


def _object_path(bucket: str, name: str) -> str:
    return f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}"


def _xml_path(bucket: str, name: str) -> str:
    return f"/{quote(bucket, safe='')}/{quote(name, safe='/')}"


class RawGcs:
    """Raw HTTP transfers against the GCS endpoint at ``url`` with ``workers`` parallel connections.

    Connections are kept alive across calls (one per worker thread, one for the calling thread);
    :meth:`close` closes them. ``part_bytes`` is the part size of parallel uploads and ranged reads.
    """

    def __init__(self, url: str, *, workers: int, part_bytes: int) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"RawGcs needs an http:// endpoint, not {url!r}")
        if workers < 1 or part_bytes < 1:
            raise ValueError(f"workers ({workers}) and part_bytes ({part_bytes}) must be positive")
        self.url = url
        self.workers = workers
        self.part_bytes = part_bytes
        self._host, self._port = parts.hostname, parts.port or 80
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._all_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="raw-gcs")

    def close(self) -> None:
        """Stop the worker threads and close every connection."""
        self._executor.shutdown(wait=True)
        with self._all_lock:
            for conn in self._all:
                conn.close()
            self._all.clear()

    def __enter__(self) -> RawGcs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # One request ------------------------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=HTTP_TIMEOUT_S)
            with self._all_lock:
                self._all.append(conn)
        return conn

    def _request(self, method: str, target: str, body: bytes | memoryview | None = None,
                 headers: dict[str, str] | None = None, ok: tuple[int, ...] = (200,)) -> http.client.HTTPResponse:
        """Send one request on this thread's connection; the caller reads the response body."""
        conn = self._connection()
        try:
            conn.request(method, target, body=body, headers=headers or {})
            response = conn.getresponse()
        except (OSError, http.client.HTTPException):
            conn.close()  # reconnects on the next request
            raise
        if response.status not in ok:
            detail = response.read()[:300]
            raise RawGcsError(f"{method} {self.url}{target} -> HTTP {response.status}: {detail!r}")
        return response

    def _call(self, method: str, target: str, body: bytes | memoryview | None = None,
              headers: dict[str, str] | None = None, ok: tuple[int, ...] = (200,)) -> tuple[bytes, http.client.HTTPResponse]:
        response = self._request(method, target, body, headers, ok)
        return response.read(), response

    def _parts(self, data: memoryview, part_bytes: int) -> list[memoryview]:
        return [data[start : start + part_bytes] for start in range(0, len(data), part_bytes)] or [data[:0]]

    # Uploads ----------------------------------------------------------------------------------
    def single_upload(self, bucket: str, name: str, data: bytes | memoryview | mmap.mmap) -> None:
        """One media upload request of the whole object."""
        target = f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?" + urlencode({"uploadType": "media", "name": name})
        # A buffer, never a file-like: http.client would send a file in 8 KiB reads.
        self._call("POST", target, memoryview(data).cast("B"), {"Content-Type": OCTET_STREAM})

    def xml_multipart_upload(self, bucket: str, name: str, data: bytes | memoryview | mmap.mmap) -> None:
        """XML API multipart upload: initiate, ``part_bytes`` parts on the parallel connections, complete."""
        path = _xml_path(bucket, name)
        body, _ = self._call("POST", f"{path}?uploads", b"", {"Content-Type": OCTET_STREAM})
        upload_id = next(e.text for e in ElementTree.fromstring(body).iter() if e.tag.endswith("UploadId"))
        parts = self._parts(memoryview(data).cast("B"), self.part_bytes)

        def put(number: int) -> str:
            target = f"{path}?" + urlencode({"partNumber": number, "uploadId": upload_id})
            _, response = self._call("PUT", target, parts[number - 1], {"Content-Type": OCTET_STREAM})
            return response.getheader("ETag", "")

        etags = list(self._executor.map(put, range(1, len(parts) + 1)))
        listing = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{etag}</ETag></Part>"
                          for n, etag in enumerate(etags, start=1))
        completion = f"<CompleteMultipartUpload>{listing}</CompleteMultipartUpload>".encode()
        self._call("POST", f"{path}?" + urlencode({"uploadId": upload_id}), completion,
                   {"Content-Type": "application/xml"})

    def composite_upload(self, bucket: str, name: str, data: bytes | memoryview | mmap.mmap) -> list[str]:
        """Part objects on the parallel connections (at most 32, so that one compose suffices), then
        one compose into ``name``. Returns the part objects, left for the caller to delete."""
        view = memoryview(data).cast("B")
        part_bytes = max(self.part_bytes, -(-len(view) // MAX_COMPOSE_SOURCES))
        parts = self._parts(view, part_bytes)
        names = [f"{name}.part{i:03d}" for i in range(len(parts))]
        list(self._executor.map(self.single_upload, [bucket] * len(parts), names, parts))
        body = json.dumps({"sourceObjects": [{"name": part} for part in names],
                           "destination": {"contentType": OCTET_STREAM}}).encode()
        self._call("POST", f"{_object_path(bucket, name)}/compose", body, {"Content-Type": "application/json"})
        return names

    # Downloads and housekeeping ---------------------------------------------------------------
    def download(self, bucket: str, name: str, size: int, crc32c: int | None = None) -> mmap.mmap:
        """The ``size`` bytes of ``name``, fetched with ``part_bytes`` ranged GETs on the parallel
        connections straight into one anonymous mapping (zeroed lazily, as the plugin's).

        With ``crc32c``, each connection also takes the crc32c of its range block by block as the
        bytes arrive (as the plugin's reader does), and the combined value must equal ``crc32c``.
        """
        buffer = mmap.mmap(-1, max(size, 1))
        view = memoryview(buffer)
        try:
            self.download_into(bucket, name, view[:size], crc32c)
        finally:
            view.release()
        return buffer

    def download_into(self, bucket: str, name: str, view: memoryview, crc32c: int | None = None) -> None:
        """The first ``len(view)`` bytes of ``name``, fetched with ``part_bytes`` ranged GETs on the
        parallel connections straight into ``view``; ``crc32c`` as for :meth:`download`."""
        view = view.cast("B")
        size = view.nbytes
        target = f"/download/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}?alt=media"

        def fetch(start: int) -> int:
            end = min(start + self.part_bytes, size)
            response = self._request("GET", target, headers={"Range": f"bytes={start}-{end - 1}",
                                                              "Accept-Encoding": "identity"}, ok=(200, 206))
            got, crc = start, 0
            while got < end:
                block = view[got : min(end, got + READ_BLOCK_BYTES)]
                n = response.readinto(block)
                if not n:
                    raise RawGcsError(f"GET {self.url}{target}: connection closed at byte {got} of {end}")
                if crc32c is not None:
                    crc = crc32c_extend(crc, block[:n])
                got += n
            response.read()  # the (empty) rest, so the connection can carry the next request
            return crc

        crcs = list(self._executor.map(fetch, range(0, size, self.part_bytes)))
        if crc32c is not None:
            whole = 0
            for start, crc in zip(range(0, size, self.part_bytes), crcs, strict=True):
                whole = crc32c_combine(whole, crc, min(self.part_bytes, size - start))
            if whole != crc32c:
                raise RawGcsError(f"GET {self.url}{target}: crc32c {whole:#010x}, expected {crc32c:#010x}")

    def delete(self, bucket: str, names: list[str] | str) -> None:
        """Delete objects (one request each); a missing one is fine."""
        for name in [names] if isinstance(names, str) else names:
            self._call("DELETE", _object_path(bucket, name), ok=(200, 204, 404))
