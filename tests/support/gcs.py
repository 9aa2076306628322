"""Helpers for the GCS tests: a fault-injecting HTTP proxy and protocol look-ups.

The proxy forwards every request to fake-gcs-server (or to the XML multipart server in front of it)
and can inject faults: a status, a dropped connection, a corrupted body.
"""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.request
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar
from urllib.parse import urlsplit

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from dataflux_ckpt.emulator import EMULATOR_PROJECT
from dataflux_ckpt.retry import RetryPolicy

FAST_RETRY = RetryPolicy(attempts=3, initial_backoff_s=0.02, max_backoff_s=0.1)
S3_NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


@dataclass
class Request:
    method: str
    path: str
    body_size: int
    headers: dict[str, str] = field(default_factory=dict)
    client_port: int = 0  # the connection it came on


def ranged_read_ports(requests: list[Request]) -> list[int]:
    """The client port of each ranged GET among ``requests``, in order (one port: one connection reused)."""
    return [request.client_port for request in requests if "Range" in request.headers]


# A fault rule sees each request (and how often that method+path was seen) and answers
# None (forward), an int (answer that status), "reset" (drop the connection) or "corrupt".
FaultRule = Callable[[Request, int], "int | str | None"]


def client_for(url: str) -> storage.Client:
    """A storage client whose every request goes to ``url``."""
    return storage.Client(project=EMULATOR_PROJECT, credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": url})


_Served = TypeVar("_Served", bound="LoopbackServer")


class LoopbackServer:
    """An HTTP server on a free loopback port (:attr:`url`), serving ``handler`` from a daemon thread
    while the context is open."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self: _Served) -> _Served:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class FaultProxy(LoopbackServer):
    """A threaded HTTP proxy to ``upstream`` that injects faults chosen by :attr:`fault`."""

    def __init__(self, upstream: str) -> None:
        self.upstream_url = upstream.rstrip("/")
        self.upstream = urlsplit(upstream)
        self.fault: FaultRule | None = None
        # Requests for which this answers True reach the upstream with their first body byte flipped.
        self.corrupt_request: Callable[[Request, int], bool] | None = None
        self.requests: list[Request] = []
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        super().__init__(self._handler_class())

    def client(self) -> storage.Client:
        """A storage client whose every request goes through this proxy."""
        return client_for(self.url)

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
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if len(body) < length:
                    # The client died inside its request (a killed writer): a server drops the
                    # request; forwarding what came, with its own length, would store a cut object.
                    self.close_connection = True
                    return
                request = Request(self.command, self.path, len(body), dict(self.headers), self.client_address[1])
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
                if proxy.corrupt_request is not None and body and proxy.corrupt_request(request, seen):
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                status, headers, payload = proxy._forward(self.command, self.path, dict(self.headers), body)
                if action == "corrupt" and payload:
                    payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
                self._reply(status, payload, headers)

            def _reply(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        return Handler

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=30)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
            conn.request(method, path, body=body, headers=sent)
            response = conn.getresponse()
            payload = response.read()
            kept = {}
            for name, value in response.getheaders():
                if name.lower() in HOP_HEADERS:
                    continue
                if name.lower() == "location" and value.startswith(self.upstream_url):
                    value = self.url + value[len(self.upstream_url):]  # resumable sessions stay proxied
                kept[name] = value
            return response.status, kept, payload
        finally:
            conn.close()


def object_names(url: str, bucket: str, prefix: str = "") -> list[str]:
    """Every object name in ``bucket`` under ``prefix``, as google-cloud-storage lists them, sorted."""
    return sorted(blob.name for blob in client_for(url).list_blobs(bucket, prefix=prefix))


def uploads_in_progress(url: str, bucket: str) -> list[str]:
    """Keys of the XML multipart uploads in progress in ``bucket``, as the server lists them."""
    with urllib.request.urlopen(f"{url}/{bucket}?uploads", timeout=10) as response:
        root = ElementTree.fromstring(response.read())
    return [upload.findtext(f"{{{S3_NAMESPACE}}}Key") for upload in root.iter(f"{{{S3_NAMESPACE}}}Upload")]
