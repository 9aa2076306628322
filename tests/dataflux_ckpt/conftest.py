"""Fixtures for dataflux_ckpt: small-chunk plugins, and an HTTP proxy in front of the emulator.

The proxy forwards every request to fake-gcs-server, and can inject faults (a status, a dropped
connection, a corrupted body) and serve GCS's XML multipart upload protocol, which the emulator lacks.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import itertools
import socket
import threading
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

import google_crc32c
import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from dataflux_ckpt import DatafluxCheckpointIO, FakeGcsServer, RetryPolicy
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES
from dataflux_ckpt.gcs import EMULATOR_PROJECT

FAST_RETRY = RetryPolicy(attempts=3, initial_backoff_s=0.02, max_backoff_s=0.1)
S3_NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


@dataclass
class Request:
    method: str
    path: str
    body_size: int


# A fault rule sees each request (and how often that method+path was seen) and answers
# None (forward), an int (answer that status), "reset" (drop the connection) or "corrupt".
FaultRule = Callable[[Request, int], "int | str | None"]


@dataclass
class _Upload:
    bucket: str
    key: str
    parts: dict[int, bytes] = field(default_factory=dict)


class GcsProxy:
    """A threaded HTTP proxy to ``upstream`` with fault injection and optional XML multipart."""

    def __init__(self, upstream: str, *, xml_multipart: bool = False) -> None:
        self.upstream = urlsplit(upstream)
        self.xml_multipart = xml_multipart
        self.fault: FaultRule | None = None
        self.requests: list[Request] = []
        self.uploads: dict[str, _Upload] = {}
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> GcsProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def client(self) -> storage.Client:
        """A storage client whose every request goes through this proxy."""
        return storage.Client(project=EMULATOR_PROJECT, credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.url})

    def count(self, method: str, contains: str) -> int:
        return sum(1 for r in self.requests if r.method == method and contains in r.path)

    # Server side -----------------------------------------------------------------------------
    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = Request(self.command, self.path, len(body))
                with proxy._lock:
                    proxy.requests.append(request)
                    key = (self.command, self.path)
                    proxy._seen[key] = seen = proxy._seen.get(key, 0) + 1
                action = proxy.fault(request, seen) if proxy.fault else None
                if action == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.close_connection = True
                    self.connection.close()
                    return
                if isinstance(action, int):
                    self._reply(action, b"injected fault", {})
                    return
                if proxy.xml_multipart and self._is_xml_path():
                    self._reply(*proxy._xml(self.command, self.path, body))
                    return
                status, headers, payload = proxy._forward(self.command, self.path, dict(self.headers), body)
                if action == "corrupt" and payload:
                    payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
                self._reply(status, payload, headers)

            def _is_xml_path(self) -> bool:
                return not self.path.startswith(("/storage/", "/upload/", "/download/"))

            def _reply(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        return Handler

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=30)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
            conn.request(method, path, body=body, headers=sent)
            response = conn.getresponse()
            payload = response.read()
            kept = {k: v for k, v in response.getheaders() if k.lower() not in HOP_HEADERS}
            return response.status, kept, payload
        finally:
            conn.close()

    def _xml(self, method: str, path: str, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        """GCS XML multipart: initiate (POST ?uploads), part (PUT), complete (POST), abort (DELETE)."""
        split = urlsplit(path)
        bucket, _, key = split.path.lstrip("/").partition("/")
        key = unquote(key)
        query = parse_qs(split.query, keep_blank_values=True)
        upload_id = query.get("uploadId", [""])[0]
        if method == "POST" and "uploads" in query:
            upload_id = uuid.uuid4().hex
            self.uploads[upload_id] = _Upload(bucket, key)
            root = ElementTree.Element("InitiateMultipartUploadResult", xmlns=S3_NAMESPACE)
            for tag, text in (("Bucket", bucket), ("Key", key), ("UploadId", upload_id)):
                ElementTree.SubElement(root, tag).text = text
            return 200, ElementTree.tostring(root), {"Content-Type": "application/xml"}
        upload = self.uploads.get(upload_id)
        if upload is None:
            return 404, b"<Error><Code>NoSuchUpload</Code></Error>", {}
        if method == "PUT":
            upload.parts[int(query["partNumber"][0])] = body
            crc = base64.b64encode(google_crc32c.Checksum(body).digest()).decode()
            return 200, b"", {"ETag": f'"{hashlib.md5(body).hexdigest()}"', "x-goog-hash": f"crc32c={crc}"}
        if method == "DELETE":
            del self.uploads[upload_id]
            return 204, b"", {}
        listed = [(int(p.findtext("PartNumber")), p.findtext("ETag")) for p in ElementTree.fromstring(body)]
        for number, etag in listed:
            if etag != f'"{hashlib.md5(upload.parts[number]).hexdigest()}"':
                return 400, b"<Error><Code>InvalidPart</Code></Error>", {}
        data = b"".join(upload.parts[number] for number, _ in sorted(listed))
        status, _, payload = self._forward(
            "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}",
            {"Content-Type": "application/octet-stream"}, data)
        del self.uploads[upload_id]
        return status, b"<CompleteMultipartUploadResult/>" if status == 200 else payload, {}


@pytest.fixture
def gcs_proxy(gcs_emulator: FakeGcsServer) -> Iterator[GcsProxy]:
    """A proxy in front of the session emulator (no XML multipart: it probes as composite)."""
    with GcsProxy(gcs_emulator.url) as proxy:
        yield proxy


@pytest.fixture
def xml_proxy(gcs_emulator: FakeGcsServer) -> Iterator[GcsProxy]:
    """A proxy in front of the session emulator that serves XML multipart uploads itself."""
    with GcsProxy(gcs_emulator.url, xml_multipart=True) as proxy:
        yield proxy


@pytest.fixture
def make_plugin(gcs_emulator: FakeGcsServer) -> Iterator[Callable[..., DatafluxCheckpointIO]]:
    """Plugins with small parts and quick retries; ``client=None`` talks to the session emulator."""

    made: list[DatafluxCheckpointIO] = []

    def make(client: storage.Client | None = None, **kwargs: object) -> DatafluxCheckpointIO:
        options = {"chunk_size": RESUMABLE_CHUNK_MULTIPLE_BYTES, "stream_chunk_size": RESUMABLE_CHUNK_MULTIPLE_BYTES,
                   "max_workers": 3, "retry": FAST_RETRY, **kwargs}
        made.append(DatafluxCheckpointIO(storage_client=client, **options))
        return made[-1]

    yield make
    for plugin in made:
        plugin.teardown()  # background deletions end within the test that started them


@pytest.fixture
def ckpt_io(make_plugin: Callable[..., DatafluxCheckpointIO]) -> DatafluxCheckpointIO:
    """The plugin with small parts, talking to the session emulator."""
    return make_plugin()


_names = itertools.count()


@pytest.fixture
def ckpt_path(gcs_bucket: str) -> str:
    return f"gs://{gcs_bucket}/run/obj-{next(_names)}.ckpt"
