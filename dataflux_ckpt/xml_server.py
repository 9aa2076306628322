"""GCS's XML API multipart uploads, served locally in front of fake-gcs-server.

fake-gcs-server speaks the JSON API but not XML API multipart uploads, the upload path real GCS
offers for parallel parts. :class:`XmlMultipartServer` runs a small threaded HTTP server (in a child
process) that serves them itself and forwards every other request, streamed, to fake-gcs-server:

    with FakeGcsServer() as gcs, XmlMultipartServer(gcs) as front, front.activated():
        front.create_bucket("ckpts")
        ...  # clients pointed at ``front.url`` see both APIs

Served, as GCS serves them (path-style URLs, ``/{bucket}/{object}``):

* ``POST /{bucket}/{object}?uploads``: initiate; answers ``InitiateMultipartUploadResult``;
* ``PUT /{bucket}/{object}?partNumber=N&uploadId=U``: upload part N (1..10000); answers the part's
  ``ETag`` (its MD5) and ``x-goog-hash`` (crc32c and MD5); a part whose bytes do not match the
  ``x-goog-hash`` or ``Content-MD5`` the client sent is refused with ``400 BadDigest``;
* ``GET /{bucket}/{object}?uploadId=U``: list parts (``max-parts``, ``part-number-marker``);
* ``POST /{bucket}/{object}?uploadId=U``: complete with the listed ``PartNumber``/``ETag`` pairs, in
  ascending order; a part missing or named with another ETag is refused with ``400 InvalidPart``;
  parts other than the last smaller than ``min_part_bytes`` with ``400 EntityTooSmall``. The object
  is then written to fake-gcs-server in one streamed request and its crc32c checked against the
  parts'; the answer carries ``x-goog-generation`` and ``x-goog-hash`` of the new object;
* ``DELETE /{bucket}/{object}?uploadId=U``: abort; ``GET /{bucket}?uploads``: list uploads in progress.

An unknown upload id gets ``404 NoSuchUpload``, a missing bucket ``404 NoSuchBucket``, an object
name GCS could not store (a ``.``/``..`` segment, a control character) ``400 InvalidArgument``. Parts
are kept in memory until the upload completes or is aborted; a part grows as its bytes arrive,
whatever ``Content-Length`` claims, up to ``max_part_bytes`` (``400 EntityTooLarge`` beyond).
A malformed ``Content-Length`` or chunk-size line gets ``400`` and the connection is closed.
The server has no authentication: it listens on loopback unless started with ``allow_remote``. Redirects of resumable uploads
(``Location``) are rewritten to point here, so whole sessions pass through this server.

It also enforces the JSON API's ``ifGenerationMatch`` precondition, which fake-gcs-server v1.52.2
applies to ``uploadType=multipart`` uploads only and ignores everywhere else: on every object write
(media, multipart and resumable uploads, compose, copy and rewrite destinations, delete), a request
whose precondition does not hold gets ``412``, as from GCS (a resumable upload's is checked at its
last request; a delete that finds no object gets ``404``, whatever it required). Every write to an
object, conditional or not, holds that object's lock from the check until the write is done, so
concurrent writers see GCS's compare-and-swap behaviour. A compose onto an existing object gets a new
generation, as on GCS (fake-gcs-server would keep the old one).

The same server, with ``serve_multipart=False``, is the front that
:class:`~dataflux_ckpt.testing.FakeGcsServer` puts before fake-gcs-server: preconditions enforced,
XML multipart requests passed on. In front of such an upstream, ``enforce_preconditions=False``
passes JSON API requests on unchecked, since the upstream checks them, and ``read_upstream`` sends
reads straight to the fake-gcs-server behind it.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import email.message
import hashlib
import http.client
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from dataflux_ckpt import paths
from dataflux_ckpt.checksums import crc32c_b64, crc32c_combine, crc32c_extend
from dataflux_ckpt.emulator import LocalGcsService, check_bind
from dataflux_ckpt.errors import InvalidObjectNameError
from lightning_storage_plugins.services import ManagedProcess, free_port, is_loopback

log = logging.getLogger(__name__)

__all__ = ["XmlMultipartServer", "serve"]

S3_NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
GCS_MIN_PART_BYTES = 5 * 2**20
MAX_PART_NUMBER = 10_000
MAX_LISTED_PARTS = 1000
BLOCK_BYTES = 1 << 20
# GCS's largest XML multipart part.
GCS_MAX_PART_BYTES = 5 * 2**30
# The largest body other than a part (a completion list, a compose request) this server receives.
MAX_REQUEST_BODY_BYTES = 16 * 2**20
_DIGITS_RE = re.compile(r"^[0-9]{1,19}\Z")
_HEX_RE = re.compile(rb"^[0-9A-Fa-f]{1,15}\Z")
UPSTREAM_TIMEOUT_S = 120.0
# Hop-by-hop headers, and those http.client sets itself for the upstream request.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                         "upgrade", "host", "content-length", "expect"})
JSON_API_PREFIXES = ("/storage/", "/upload/", "/download/", "/batch/", "/_internal/")


class _Reply(Exception):
    """An answer ready to send (an XML error, typically) raised out of a handler."""

    def __init__(self, status: int, code: str, message: str, details: str = "") -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details

    def body(self) -> bytes:
        root = ElementTree.Element("Error")
        for tag, text in (("Code", self.code), ("Message", self.message), ("Details", self.details)):
            ElementTree.SubElement(root, tag).text = _xml_text(text)
        return ElementTree.tostring(root, encoding="utf-8", xml_declaration=True)


@dataclass
class _Part:
    number: int
    data: bytearray
    crc: int
    md5: bytes
    modified: float

    @property
    def etag(self) -> str:
        return f'"{self.md5.hex()}"'


@dataclass
class _Upload:
    upload_id: str
    bucket: str
    key: str
    content_type: str
    initiated: float
    parts: dict[int, _Part] = field(default_factory=dict)


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(timestamp)) + f".{int(timestamp % 1 * 1000):03d}Z"


def _xml(tag: str, children: Sequence[tuple[str, Any]]) -> bytes:
    root = ElementTree.Element(tag, xmlns=S3_NAMESPACE)
    _fill(root, children)
    return ElementTree.tostring(root, encoding="utf-8", xml_declaration=True)


def _fill(parent: ElementTree.Element, children: Sequence[tuple[str, Any]]) -> None:
    for tag, value in children:
        child = ElementTree.SubElement(parent, tag)
        if isinstance(value, list):
            _fill(child, value)
        else:
            child.text = _xml_text(str(value))


# Characters XML 1.0 cannot carry, even escaped.
_NOT_XML_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(text: str) -> str:
    """``text`` with what XML cannot carry written as ``\\xNN``, so that every answer is well-formed XML."""
    return _NOT_XML_RE.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


def _normalize_etag(etag: str) -> str:
    return etag.strip().strip('"')


def _declared_hashes(headers: Any) -> dict[str, str]:
    """``{"crc32c": b64, "md5": b64}`` from ``x-goog-hash`` (repeated or comma-separated) and ``Content-MD5``."""
    declared: dict[str, str] = {}
    for value in headers.get_all("x-goog-hash") or []:
        for item in value.split(","):
            name, _, digest = item.strip().partition("=")
            if digest:
                declared[name.lower()] = digest
    if headers.get("Content-MD5"):
        declared.setdefault("md5", headers["Content-MD5"].strip())
    return declared


class _Upstream:
    """Keep-alive connections to fake-gcs-server, one per server thread."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, not {url!r}")
        self.url = url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self._timeout_s = timeout_s
        self._local = threading.local()

    def connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self._timeout_s)
        return conn

    def discard(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def start(self, method: str, path: str, headers: dict[str, str], length: int | None) -> http.client.HTTPConnection:
        """Send the request line and headers; the caller sends ``length`` body bytes, then reads the response."""
        for attempt in (1, 2):
            conn = self.connection()
            try:
                conn.putrequest(method, path, skip_accept_encoding=True)
                for name, value in headers.items():
                    conn.putheader(name, value)
                if length is not None:
                    conn.putheader("Content-Length", str(length))
                conn.endheaders()
                return conn
            except (OSError, http.client.HTTPException):
                # A kept-alive connection the server closed meanwhile: one fresh try.
                self.discard()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def call(self, method: str, path: str, headers: dict[str, str] | None = None,
             body: bytes = b"") -> tuple[int, bytes]:
        """A small request with a small answer (metadata, bucket look-ups)."""
        conn = self.start(method, path, headers or {}, len(body) if body or method in ("POST", "PUT") else None)
        try:
            if body:
                conn.send(body)
            response = conn.getresponse()
            return response.status, response.read()
        except BaseException:
            self.discard()
            raise


class _ObjectLocks:
    """One lock per object name, held from a precondition check until the write it guards is done."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], list[Any]] = {}  # name -> [lock, users]
        self._mutex = threading.Lock()

    @contextmanager
    def held(self, bucket: str, name: str) -> Iterator[None]:
        key = (bucket, name)
        with self._mutex:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._mutex:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._locks[key]


class _MultipartState:
    """Uploads in progress, resumable sessions and per-object locks, shared by the server's threads."""

    def __init__(self, upstream: _Upstream, min_part_bytes: int, max_part_bytes: int = GCS_MAX_PART_BYTES,
                 read_upstream: _Upstream | None = None) -> None:
        self.upstream = upstream
        self.read_upstream = read_upstream
        self.min_part_bytes = min_part_bytes
        self.max_part_bytes = max_part_bytes
        self.object_locks = _ObjectLocks()
        # Resumable sessions in progress: upload_id -> (bucket, name, the generation required or None).
        self.sessions: dict[str, tuple[str, str, int | None]] = {}
        self._uploads: dict[str, _Upload] = {}
        self._lock = threading.Lock()

    def generation(self, bucket: str, name: str) -> int:
        """The generation of ``bucket/name`` upstream now; 0 when there is none."""
        status, payload = self.upstream.call(
            "GET", f"{paths.object_url_path(bucket, name)}?fields=generation")
        if status == 404:
            return 0
        if status != 200:
            raise _Reply(502, "BadGateway", f"looking up {bucket}/{name} upstream answered HTTP {status}")
        return int(json.loads(payload).get("generation") or 0)

    def create(self, bucket: str, key: str, content_type: str) -> _Upload:
        status, _ = self.upstream.call("GET", f"{paths.bucket_url_path(bucket)}?fields=name")
        if status == 404:
            raise _Reply(404, "NoSuchBucket", "The specified bucket does not exist.", bucket)
        if status != 200:
            raise _Reply(502, "BadGateway", f"looking up bucket {bucket} upstream answered HTTP {status}")
        upload = _Upload(uuid.uuid4().hex, bucket, key, content_type, time.time())
        with self._lock:
            self._uploads[upload.upload_id] = upload
        return upload

    def get(self, upload_id: str, bucket: str, key: str | None) -> _Upload:
        with self._lock:
            upload = self._uploads.get(upload_id)
        if upload is None or upload.bucket != bucket or (key is not None and upload.key != key):
            raise _Reply(404, "NoSuchUpload", "The requested upload was not found.", upload_id)
        return upload

    def take(self, upload_id: str, bucket: str, key: str) -> _Upload:
        """Remove and return the upload: a completion or abort owns it from now on."""
        with self._lock:
            upload = self._uploads.get(upload_id)
            if upload is None or upload.bucket != bucket or upload.key != key:
                raise _Reply(404, "NoSuchUpload", "The requested upload was not found.", upload_id)
            del self._uploads[upload_id]
        return upload

    def put_back(self, upload: _Upload) -> None:
        with self._lock:
            self._uploads.setdefault(upload.upload_id, upload)

    def in_bucket(self, bucket: str, prefix: str) -> list[_Upload]:
        with self._lock:
            uploads = [u for u in self._uploads.values() if u.bucket == bucket and u.key.startswith(prefix)]
        return sorted(uploads, key=lambda u: (u.key, u.initiated))


class _HandlerBase(BaseHTTPRequestHandler):
    """Request dispatch and body framing shared by the two halves of the server's handler."""

    server: _Server
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # replies go out in several writes: no 40 ms wait for an ACK between them
    server_version = "dataflux-xml-multipart"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        log.debug("%s " + format, self.address_string(), *args)

    # Dispatch ----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        self._body_read = False
        self._prefetched: bytes | None = None  # a body read before forwarding (to find its object)
        try:
            self._framing()
            split = urlsplit(self.path)
            query = parse_qs(split.query, keep_blank_values=True)
            multipart = (self.server.serve_multipart and not split.path.startswith(JSON_API_PREFIXES)
                         and ("uploads" in query or "uploadId" in query))
            if multipart:
                self._multipart(split.path, query)
            else:
                self._forward()
        except InvalidObjectNameError as exc:
            self._drain()
            reply = _Reply(400, "InvalidArgument", str(exc))
            self._send(reply.status, reply.body(), {"Content-Type": "application/xml"})
        except _Reply as reply:
            self._drain()
            self._send(reply.status, reply.body(), {"Content-Type": "application/xml"})
        except (ConnectionError, TimeoutError, http.client.HTTPException) as exc:
            log.warning("%s %s failed: %s", self.command, self.path, exc)
            self._upstream.discard()
            self.close_connection = True
            try:
                self._send(502, _Reply(502, "BadGateway", str(exc)).body(), {"Content-Type": "application/xml"})
            except OSError:
                pass

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _dispatch

    # Bodies ------------------------------------------------------------------------------
    # Memory follows the bytes that arrive, never what a header claims: bodies grow block by block
    # up to a cap, and malformed framing is answered with 400 and the connection closed (what
    # follows on it can no longer be told apart from the body).
    def _framing(self) -> None:
        """Read the body's framing from the headers; 400 when it is malformed."""
        self._chunked_body = False
        self._declared: int | None = None
        encoding = self.headers.get("Transfer-Encoding")
        if encoding is not None:
            if encoding.strip().lower() != "chunked":
                raise self._bad_framing(501, "NotImplemented", f"Transfer-Encoding {encoding!r} is not supported")
            self._chunked_body = True
            return
        values = [value.strip() for value in self.headers.get_all("Content-Length") or []]
        if not values:
            return
        if len(set(values)) != 1 or not _DIGITS_RE.match(values[0]):
            raise self._bad_framing(400, "InvalidArgument", f"bad Content-Length {', '.join(values)!r}")
        self._declared = int(values[0])

    def _bad_framing(self, status: int, code: str, message: str) -> _Reply:
        self._body_read = True
        self.close_connection = True
        return _Reply(status, code, message)

    def _length(self) -> int | None:
        return self._declared

    def _chunked(self) -> bool:
        return self._chunked_body

    def _read_body(self, limit: int) -> bytearray:
        """The whole request body, grown as it arrives; 400 ``EntityTooLarge`` past ``limit`` bytes."""
        body = bytearray()
        if self._chunked():
            for block in self._chunks():
                if len(body) + len(block) > limit:
                    raise self._bad_framing(400, "EntityTooLarge", f"the body exceeds {limit} bytes")
                body += block
            return body
        length = self._length() or 0
        if length > limit:  # answered at once, without reading what would be refused
            raise self._bad_framing(400, "EntityTooLarge", f"Content-Length {length} exceeds {limit} bytes")
        block = bytearray(min(length, BLOCK_BYTES))
        view = memoryview(block)
        while len(body) < length:
            n = self.rfile.readinto(view[: min(length - len(body), len(block))])
            if not n:
                raise ConnectionError(f"client closed the connection after {len(body)} of {length} body bytes")
            body += view[:n]
        self._body_read = True
        return body

    def _chunks(self) -> Iterator[bytes]:
        """The blocks of a chunked body (none larger than ``BLOCK_BYTES``); 400 on bad framing."""
        while True:
            size_line = self.rfile.readline(1024)
            if not size_line:
                raise ConnectionError("client closed the connection inside a chunked body")
            text = size_line.split(b";")[0].strip()
            if not size_line.endswith(b"\n") or not _HEX_RE.match(text):
                raise self._bad_framing(400, "InvalidArgument", f"bad chunk-size line {size_line[:80]!r}")
            size = int(text, 16)
            if size == 0:
                while (line := self.rfile.readline(1024)) not in (b"\r\n", b"\n"):
                    if not line:
                        raise ConnectionError("client closed the connection inside a chunked body's trailer")
                self._body_read = True
                return
            while size:
                block = self.rfile.read(min(size, BLOCK_BYTES))
                if not block:
                    raise ConnectionError("client closed the connection inside a chunk")
                size -= len(block)
                yield block
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise self._bad_framing(400, "InvalidArgument", "a chunk does not end with CRLF")

    def _drain(self) -> None:
        """Consume an unread request body, so that the connection can carry the next request."""
        if getattr(self, "_body_read", True):
            return
        self._body_read = True
        try:
            if self._chunked():
                for _ in self._chunks():
                    pass
                return
            remaining = self._length() or 0
            if remaining > 64 * BLOCK_BYTES:
                self.close_connection = True  # cheaper to drop than to read
                return
            while remaining:
                chunk = self.rfile.read(min(remaining, BLOCK_BYTES))
                if not chunk:
                    self.close_connection = True
                    return
                remaining -= len(chunk)
        except (_Reply, OSError):
            self.close_connection = True

    def _send(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    @property
    def _state(self) -> _MultipartState:
        return self.server.state

    @property
    def _upstream(self) -> _Upstream:
        """Where this request goes: reads to the read upstream, where there is one."""
        state = self.server.state
        if state.read_upstream is not None and self.command in ("GET", "HEAD"):
            return state.read_upstream
        return state.upstream

    def _forward(self) -> None:
        raise NotImplementedError

    def _multipart(self, path: str, query: dict[str, list[str]]) -> None:
        raise NotImplementedError


class _ProxyHandler(_HandlerBase):
    """The JSON API half: requests forwarded to fake-gcs-server, streamed, with the generation
    preconditions it ignores checked here."""

    def _forward(self) -> None:
        written = self._written_object() if self.server.enforce_preconditions else None
        if written is None:
            self._forward_now()
            return
        bucket, name, required = written
        compose = self.command == "POST" and urlsplit(self.path).path.endswith("/compose")
        with self._state.object_locks.held(bucket, name):
            current = self._state.generation(bucket, name) if required is not None or compose else 0
            # A delete that finds no object is answered 404 by GCS, whatever it required (upstream does too).
            if required is not None and current != required and not (self.command == "DELETE" and not current):
                self._drain()
                return self._precondition_failed(bucket, name, required, current)
            if compose and current:
                return self._compose_over(bucket, name)
            status = self._forward_now()
        session = parse_qs(urlsplit(self.path).query).get("upload_id")
        if session and 200 <= status < 300:  # the session is over: its object is written
            with self._state._lock:
                self._state.sessions.pop(session[0], None)

    def _written_object(self) -> tuple[str, str, int | None] | None:
        """The object this JSON API request writes or deletes, and the generation it requires.

        fake-gcs-server checks ``ifGenerationMatch`` on multipart uploads only; every write is
        checked here, under a lock per object, against what is upstream. Every write to an object
        takes its lock, conditional or not, so that a check and the write it guards are one step.
        """
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        required = _int_or_none(query.get("ifGenerationMatch", [None])[0])
        segments = [unquote(p) for p in split.path.split("/")]
        method = self.command
        if split.path.startswith("/upload/storage/v1/b/") and len(segments) >= 7:
            bucket = segments[5]
            upload_type = query.get("uploadType", [""])[0]
            if method == "POST" and upload_type == "media" and query.get("name"):
                return bucket, query["name"][0], required
            if method == "POST" and upload_type == "multipart":
                name = query["name"][0] if query.get("name") else self._multipart_name()
                return (bucket, name, required) if name else None
            if method == "PUT" and query.get("upload_id") and self._finishes_session():
                with self._state._lock:
                    return self._state.sessions.get(query["upload_id"][0])
            if method == "DELETE" and query.get("upload_id"):  # a cancelled session
                with self._state._lock:
                    self._state.sessions.pop(query["upload_id"][0], None)
            return None
        if split.path.startswith("/storage/v1/b/") and len(segments) >= 7 and segments[5] == "o":
            bucket, rest = segments[4], segments[6:]
            if method == "POST" and len(rest) >= 2 and rest[-1] == "compose":
                return bucket, "/".join(rest[:-1]), required
            if method == "POST":
                for i in range(1, len(rest) - 4):  # {source}/copyTo|rewriteTo/b/{bucket}/o/{destination}
                    if rest[i] in ("copyTo", "rewriteTo") and rest[i + 1] == "b" and rest[i + 3] == "o":
                        return rest[i + 2], "/".join(rest[i + 4:]), required
            if method == "DELETE":
                return bucket, "/".join(rest), required
        return None

    def _multipart_name(self) -> str | None:
        """The object name in a multipart upload's metadata part; the body is read (and kept for
        forwarding) to find it."""
        self._prefetched = bytes(self._read_body(self._state.max_part_bytes))
        message = email.message.Message()
        message["Content-Type"] = self.headers.get("Content-Type", "")
        boundary = message.get_param("boundary")
        if not isinstance(boundary, str) or not boundary:
            return None
        delimiter = b"--" + boundary.encode()
        body = self._prefetched
        start = body.find(delimiter)
        end = body.find(delimiter, start + len(delimiter)) if start >= 0 else -1
        if end < 0:
            return None
        part = body[start + len(delimiter) : end]
        for separator in (b"\r\n\r\n", b"\n\n"):
            if separator in part:
                part = part.split(separator, 1)[1]
                break
        try:
            name = json.loads(part).get("name")
        except (ValueError, AttributeError):
            return None
        return name if isinstance(name, str) and name else None

    def _compose_over(self, bucket: str, name: str) -> None:
        """Compose onto an existing object with a new generation, as GCS does.

        fake-gcs-server's compose keeps the generation of the object it replaces, so that
        generations no longer tell writes apart; compose into a temporary object and copy that
        (a copy gets a new generation) instead.
        """
        body = bytes(self._read_body(MAX_REQUEST_BODY_BYTES))
        temporary = paths.object_url_path(bucket, f"{name}.compose-{uuid.uuid4().hex}")
        status, payload = self._upstream.call("POST", f"{temporary}/compose", {"Content-Type": "application/json"}, body)
        try:
            if status == 200:
                status, payload = self._upstream.call(
                    "POST", f"{temporary}/copyTo{paths.object_url_path(bucket, name)[len('/storage/v1'):]}",
                    {"Content-Type": "application/json"}, b"{}")
        finally:
            self._upstream.call("DELETE", temporary)
        self._send(status, payload, {"Content-Type": "application/json; charset=UTF-8"})

    def _finishes_session(self) -> bool:
        """Whether a resumable upload request carries the total size (its last request)."""
        content_range = self.headers.get("Content-Range", "")
        return "/" in content_range and not content_range.rstrip().endswith("/*")

    def _precondition_failed(self, bucket: str, name: str, required: int, current: int) -> None:
        message = "At least one of the pre-conditions you specified did not hold."
        body = json.dumps({"error": {"code": 412, "message": message, "errors": [{
            "domain": "global", "reason": "conditionNotMet", "locationType": "header",
            "location": "If-Match", "message": f"{message} ({bucket}/{name}: generation {current}, "
                                               f"required {required})"}]}}).encode()
        self._send(412, body, {"Content-Type": "application/json; charset=UTF-8"})

    def _forward_now(self) -> int:
        """Forward the request, its body streamed (or sent from what was read already), and relay
        the answer; its status."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        prefetched = self._prefetched
        length = len(prefetched) if prefetched is not None else self._length()
        if prefetched is None and self._chunked():
            headers["Transfer-Encoding"] = "chunked"  # relayed block by block, as it arrives
        elif length is None and self.command in ("POST", "PUT", "PATCH"):
            length = 0
        conn = self._upstream.start(self.command, self.path, headers, length)
        try:
            if prefetched is not None:
                conn.send(prefetched)
            elif self._chunked():
                for block in self._chunks():
                    conn.send(b"%x\r\n" % len(block))
                    conn.send(block)
                    conn.send(b"\r\n")
                conn.send(b"0\r\n\r\n")
            elif length:
                self._pump_request(conn, length)
            self._body_read = True
            response = conn.getresponse()
            self._relay(response)
        except BaseException:
            self._upstream.discard()
            raise
        if response.will_close:
            self._upstream.discard()
        return response.status

    def _pump_request(self, conn: http.client.HTTPConnection, length: int) -> None:
        block = bytearray(min(length, BLOCK_BYTES))
        view, remaining = memoryview(block), length
        while remaining:
            n = self.rfile.readinto(view[: min(remaining, len(block))])
            if not n:
                raise ConnectionError(f"client closed the connection with {remaining} body bytes unsent")
            conn.send(view[:n])
            remaining -= n

    def _remember_session(self, location: str) -> None:
        """Keep the object and the generation precondition of a resumable upload this request
        started, for its last request (which writes the object)."""
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        if (not self.server.enforce_preconditions or self.command != "POST"
                or query.get("uploadType", [""])[0] != "resumable" or not split.path.startswith("/upload/")):
            return
        required = _int_or_none(query.get("ifGenerationMatch", [None])[0])
        session = parse_qs(urlsplit(location).query)
        if session.get("upload_id") and session.get("name"):
            bucket = unquote(split.path.split("/")[5])
            with self._state._lock:
                self._state.sessions[session["upload_id"][0]] = (bucket, session["name"][0], required)

    def _relay(self, response: http.client.HTTPResponse) -> None:
        self.send_response_only(response.status, response.reason)
        self.send_header("Date", self.date_time_string())
        length = response.getheader("Content-Length")
        for name, value in response.getheaders():
            lowered = name.lower()
            if lowered in HOP_HEADERS or lowered == "date":
                continue
            if lowered in ("location", "x-goog-upload-url"):
                if value.startswith(self._upstream.url):
                    value = self.server.public_url + value[len(self._upstream.url):]
                if lowered == "location":
                    self._remember_session(value)
            self.send_header(name, value)
        no_body = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        if no_body:
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            response.read()
            return
        if length is not None:
            self.send_header("Content-Length", length)
            self.end_headers()
            remaining = int(length)
            block = bytearray(min(remaining, BLOCK_BYTES) or 1)
            view = memoryview(block)
            while remaining:
                n = response.readinto(view[: min(remaining, len(block))])
                if not n:
                    raise ConnectionError(f"upstream closed the connection with {remaining} bytes unsent")
                self.wfile.write(view[:n])
                remaining -= n
            return
        # No length upstream: relay as it arrives, in chunks.
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = response.read1(BLOCK_BYTES) if hasattr(response, "read1") else response.read(BLOCK_BYTES)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


class _MultipartHandler(_HandlerBase):
    """The XML API half: multipart uploads, served from this process' memory."""

    def _multipart(self, path: str, query: dict[str, list[str]]) -> None:
        bucket, _, key = path.lstrip("/").partition("/")
        bucket, key = unquote(bucket), unquote(key)
        upload_id = query.get("uploadId", [""])[0]
        method = self.command
        if not bucket:
            raise _Reply(400, "InvalidBucketName", "no bucket in the request path")
        if method == "GET" and "uploads" in query and not key:
            return self._list_uploads(bucket, query)
        if not key:
            raise _Reply(400, "InvalidArgument", "no object name in the request path")
        paths.check_bucket_name(bucket)
        paths.check_object_name(bucket, key)
        if method == "POST" and "uploads" in query:
            return self._initiate(bucket, key)
        if not upload_id:
            raise _Reply(400, "InvalidArgument", "uploadId is empty")
        if method == "PUT":
            return self._upload_part(bucket, key, upload_id, query)
        if method == "GET":
            return self._list_parts(bucket, key, upload_id, query)
        if method == "POST":
            return self._complete(bucket, key, upload_id)
        if method == "DELETE":
            self._state.take(upload_id, bucket, key)
            self._drain()
            return self._send(204, b"", {})
        raise _Reply(405, "MethodNotAllowed", f"{method} is not allowed on a multipart upload")

    def _ok_xml(self, payload: bytes, extra: dict[str, str] | None = None) -> None:
        self._drain()
        self._send(200, payload, {"Content-Type": "application/xml", **(extra or {})})

    def _initiate(self, bucket: str, key: str) -> None:
        content_type = self.headers.get("Content-Type") or "application/octet-stream"
        upload = self._state.create(bucket, key, content_type)
        self._ok_xml(_xml("InitiateMultipartUploadResult",
                          [("Bucket", bucket), ("Key", key), ("UploadId", upload.upload_id)]))

    def _upload_part(self, bucket: str, key: str, upload_id: str, query: dict[str, list[str]]) -> None:
        try:
            number = int(query.get("partNumber", [""])[0])
        except ValueError:
            number = 0
        if not 1 <= number <= MAX_PART_NUMBER:
            raise _Reply(400, "InvalidArgument", f"partNumber must be an integer from 1 to {MAX_PART_NUMBER}")
        upload = self._state.get(upload_id, bucket, key)
        if not self._chunked() and self._length() is None:
            raise _Reply(411, "MissingContentLength", "a part needs a Content-Length")
        data = self._read_body(self._state.max_part_bytes)
        crc = crc32c_extend(0, data)
        md5 = hashlib.md5(data).digest()
        actual = {"crc32c": crc32c_b64(crc), "md5": base64.b64encode(md5).decode()}
        for name, digest in _declared_hashes(self.headers).items():
            if name in actual and not _same_digest(digest, actual[name]):
                raise _Reply(400, "BadDigest",
                             f"the {name} you specified did not match what was received",
                             f"declared {name}={digest}, received {name}={actual[name]} "
                             f"(part {number} of upload {upload_id})")
        part = _Part(number, data, crc, md5, time.time())
        upload.parts[number] = part  # a part sent again replaces the earlier one
        self._send(200, b"", {"ETag": part.etag,
                              "x-goog-hash": f"crc32c={actual['crc32c']},md5={actual['md5']}"})

    def _list_parts(self, bucket: str, key: str, upload_id: str, query: dict[str, list[str]]) -> None:
        upload = self._state.get(upload_id, bucket, key)
        marker = _int_param(query, "part-number-marker", 0)
        limit = min(_int_param(query, "max-parts", MAX_LISTED_PARTS), MAX_LISTED_PARTS)
        numbers = sorted(n for n in list(upload.parts) if n > marker)
        shown, truncated = numbers[:limit], len(numbers) > limit
        parts: list[tuple[str, Any]] = [
            ("Part", [("PartNumber", p.number), ("LastModified", _iso(p.modified)), ("ETag", p.etag),
                      ("Size", len(p.data))])
            for p in (upload.parts[n] for n in shown)
        ]
        self._ok_xml(_xml("ListPartsResult", [
            ("Bucket", bucket), ("Key", key), ("UploadId", upload_id), ("PartNumberMarker", marker),
            ("NextPartNumberMarker", shown[-1] if shown else marker), ("MaxParts", limit),
            ("IsTruncated", "true" if truncated else "false"), *parts,
        ]))

    def _list_uploads(self, bucket: str, query: dict[str, list[str]]) -> None:
        prefix = query.get("prefix", [""])[0]
        uploads: list[tuple[str, Any]] = [
            ("Upload", [("Key", u.key), ("UploadId", u.upload_id), ("Initiated", _iso(u.initiated))])
            for u in self._state.in_bucket(bucket, prefix)
        ]
        self._ok_xml(_xml("ListMultipartUploadsResult", [
            ("Bucket", bucket), ("Prefix", prefix), ("IsTruncated", "false"), *uploads,
        ]))

    def _complete(self, bucket: str, key: str, upload_id: str) -> None:
        body = bytes(self._read_body(MAX_REQUEST_BODY_BYTES))
        self._state.get(upload_id, bucket, key)  # NoSuchUpload before MalformedXML, as GCS
        listed = _parse_completion(body)
        upload = self._state.take(upload_id, bucket, key)
        try:
            chosen = _chosen_parts(upload, listed, self._state.min_part_bytes)
        except _Reply:
            self._state.put_back(upload)  # the client may correct the list and complete again
            raise
        crc, size = 0, 0
        for part in chosen:
            crc = crc32c_combine(crc, part.crc, len(part.data))
            size += len(part.data)
        meta = self._publish(upload, chosen, size)
        stored = meta.get("crc32c", "")
        if stored != crc32c_b64(crc):
            raise _Reply(500, "InternalError",
                         f"stored crc32c {stored} != crc32c of the parts {crc32c_b64(crc)}", key)
        etag = hashlib.md5(b"".join(p.md5 for p in chosen)).hexdigest() + f"-{len(chosen)}"
        location = self.server.public_url + paths.xml_url_path(bucket, key)
        self._ok_xml(
            _xml("CompleteMultipartUploadResult",
                 [("Location", location), ("Bucket", bucket), ("Key", key), ("ETag", f'"{etag}"')]),
            {"x-goog-generation": str(meta.get("generation", "")), "x-goog-metageneration": "1",
             "x-goog-hash": f"crc32c={stored}", "x-goog-stored-content-length": str(size),
             "ETag": f'"{etag}"'},
        )

    def _publish(self, upload: _Upload, parts: list[_Part], size: int) -> dict[str, Any]:
        """Write the parts as one object upstream (one streamed request); its metadata."""
        path = paths.upload_url_path(upload.bucket, upload.key, "media")
        with self._state.object_locks.held(upload.bucket, upload.key):
            conn = self._upstream.start("POST", path, {"Content-Type": upload.content_type}, size)
            try:
                for part in parts:
                    conn.send(memoryview(part.data))
                response = conn.getresponse()
                payload = response.read()
            except BaseException:
                self._upstream.discard()
                raise
        if response.status == 404:
            raise _Reply(404, "NoSuchBucket", "The specified bucket does not exist.", upload.bucket)
        if response.status != 200:
            raise _Reply(response.status, "InternalError", f"writing {upload.key} upstream answered "
                         f"HTTP {response.status}", payload.decode(errors="replace")[:300])
        return json.loads(payload)


class _Handler(_ProxyHandler, _MultipartHandler):
    """Every request: XML multipart uploads served, everything else forwarded."""


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise _Reply(400, "InvalidArgument", f"ifGenerationMatch must be an integer, not {text!r}") from None


def _same_digest(declared: str, actual: str) -> bool:
    try:
        return base64.b64decode(declared, validate=True) == base64.b64decode(actual)
    except (binascii.Error, ValueError):
        return False


def _int_param(query: dict[str, list[str]], name: str, default: int) -> int:
    try:
        return int(query.get(name, [str(default)])[0])
    except ValueError:
        raise _Reply(400, "InvalidArgument", f"{name} must be an integer") from None


def _parse_completion(body: bytes) -> list[tuple[int, str]]:
    """The ``(PartNumber, ETag)`` pairs of a ``CompleteMultipartUpload`` body (namespaced or not)."""
    try:
        root = ElementTree.fromstring(body)
        listed = []
        for element in root:
            if element.tag.rpartition("}")[2] != "Part":
                continue
            fields = {child.tag.rpartition("}")[2]: (child.text or "") for child in element}
            listed.append((int(fields["PartNumber"]), _normalize_etag(fields["ETag"])))
    except (ElementTree.ParseError, KeyError, ValueError) as exc:
        raise _Reply(400, "MalformedXML", f"the completion request is not a valid part list: {exc}") from None
    if not listed:
        raise _Reply(400, "MalformedXML", "the completion request lists no parts")
    return listed


def _chosen_parts(upload: _Upload, listed: list[tuple[int, str]], min_part_bytes: int) -> list[_Part]:
    numbers = [number for number, _ in listed]
    if numbers != sorted(numbers) or len(set(numbers)) != len(numbers):
        raise _Reply(400, "InvalidPartOrder", "the parts must be listed in ascending order, each once")
    chosen = []
    for number, etag in listed:
        part = upload.parts.get(number)
        if part is None or _normalize_etag(part.etag) != etag:
            raise _Reply(400, "InvalidPart", "one or more of the specified parts could not be found or its "
                         "ETag did not match", f"part {number}, ETag {etag}")
        chosen.append(part)
    for part in chosen[:-1]:
        if len(part.data) < min_part_bytes:
            raise _Reply(400, "EntityTooSmall", f"part {part.number} has {len(part.data)} bytes; every part "
                         f"but the last needs at least {min_part_bytes}")
    return chosen


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], state: _MultipartState, public_url: str | None, *,
                 serve_multipart: bool, enforce_preconditions: bool) -> None:
        super().__init__(address, _Handler)
        self.state = state
        self.public_url = (public_url or f"http://{address[0]}:{self.server_address[1]}").rstrip("/")
        self.serve_multipart = serve_multipart
        self.enforce_preconditions = enforce_preconditions


def serve(
    upstream: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    min_part_bytes: int = GCS_MIN_PART_BYTES,
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S,
    public_url: str | None = None,
    allow_remote: bool = False,
    max_part_bytes: int = GCS_MAX_PART_BYTES,
    serve_multipart: bool = True,
    enforce_preconditions: bool = True,
    read_upstream: str | None = None,
) -> ThreadingHTTPServer:
    """An XML multipart server bound to ``host:port`` (0: any free port) in front of ``upstream``.

    The caller runs it (``serve_forever()``) and closes it (``shutdown()``, ``server_close()``).
    :class:`XmlMultipartServer` runs one in a child process.

    Args:
        upstream: base URL of fake-gcs-server (``http://host:port``).
        min_part_bytes: the smallest part (other than the last) a completion accepts; GCS's 5 MiB.
        max_part_bytes: the largest part accepted (``400 EntityTooLarge`` above); GCS's 5 GiB. A
            part is held in memory as it arrives, so this caps the memory one request can take.
        upstream_timeout_s: how long a request to ``upstream`` may wait for it.
        public_url: the base URL clients reach this server by, where that is not its own address
            (a proxy in front of it); resumable-upload session locations point there.
        allow_remote: listen on a non-loopback ``host``; the server has no authentication, so anyone
            who reaches it may read and change every object upstream.
        serve_multipart: serve XML multipart uploads; ``False`` passes them on to ``upstream``.
        enforce_preconditions: check generation preconditions on every object write; ``False``
            passes JSON API requests on unchecked, for an upstream that checks them itself.
        read_upstream: where GET and HEAD requests go instead of ``upstream`` (the fake-gcs-server
            behind an ``upstream`` that only checks preconditions: reads need no check, and skip a hop).

    Raises:
        ValueError: ``upstream`` or ``public_url`` is not an ``http://`` URL, or ``host`` is not
            loopback and ``allow_remote`` is false.
        OSError: the address cannot be bound.
    """
    check_bind(host, allow_remote, "the XML multipart server")
    if public_url is not None and not public_url.startswith("http://"):
        raise ValueError(f"public_url must be an http:// URL, not {public_url!r}")
    if not 0 < max_part_bytes <= GCS_MAX_PART_BYTES:
        raise ValueError(f"max_part_bytes must be in 1..{GCS_MAX_PART_BYTES}, not {max_part_bytes!r}")
    state = _MultipartState(_Upstream(upstream, upstream_timeout_s), min_part_bytes, max_part_bytes,
                            _Upstream(read_upstream, upstream_timeout_s) if read_upstream else None)
    return _Server((host, port), state, public_url, serve_multipart=serve_multipart,
                   enforce_preconditions=enforce_preconditions)


class XmlMultipartServer(LocalGcsService):
    """The XML multipart server in a child process, in front of a fake-gcs-server at ``upstream``.

    Clients talk to :attr:`url` for both the JSON API (forwarded) and XML multipart uploads (served).
    The process is stopped by :meth:`stop`, at interpreter exit, or with its parent.

    Args:
        upstream: a running :class:`~dataflux_ckpt.testing.FakeGcsServer`, or a base URL.
        host: address to listen on; loopback unless ``allow_remote``.
        port: port to listen on; a free one by default.
        min_part_bytes: the smallest part (other than the last) a completion accepts. GCS's 5 MiB by
            default; 0 lets small test uploads through.
        upstream_timeout_s: how long a forwarded request may wait for fake-gcs-server.
        public_url: the base URL clients reach the server by, where a proxy stands in front of it;
            resumable-upload session locations point there. :attr:`url` by default.
        startup_timeout_s: how long :meth:`start` waits for the server to answer.
        allow_remote: listen on a non-loopback ``host`` (there is no authentication).
        max_part_bytes: the largest part accepted, which caps one request's memory; GCS's 5 GiB.
        serve_multipart: serve XML multipart uploads (``False``: pass them on to ``upstream``).
        enforce_preconditions: check generation preconditions here. By default they are checked
            unless ``upstream`` is a :class:`~dataflux_ckpt.testing.FakeGcsServer` that checks them
            (a URL is taken for a bare fake-gcs-server, and checked here). In front of such a
            server, reads go straight to its fake-gcs-server.

    Raises:
        ValueError: a non-loopback ``host`` without ``allow_remote=True``.
        ServiceStartError: (from :meth:`start`) the server did not come up; the message has its log.
    """

    def __init__(
        self,
        upstream: Any,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        min_part_bytes: int = GCS_MIN_PART_BYTES,
        upstream_timeout_s: float = UPSTREAM_TIMEOUT_S,
        public_url: str | None = None,
        startup_timeout_s: float = 30.0,
        allow_remote: bool = False,
        max_part_bytes: int = GCS_MAX_PART_BYTES,
        serve_multipart: bool = True,
        enforce_preconditions: bool | None = None,
    ) -> None:
        check_bind(host, allow_remote, "the XML multipart server")
        self.upstream = upstream if isinstance(upstream, str) else upstream.url
        if not self.upstream.startswith("http://"):
            raise ValueError(f"upstream must be an http:// URL, not {self.upstream!r}")
        checked_upstream = bool(getattr(upstream, "enforces_preconditions", False))
        if enforce_preconditions is None:
            enforce_preconditions = not checked_upstream
        self.enforces_preconditions = enforce_preconditions or checked_upstream
        read_upstream = getattr(upstream, "emulator_url", None) if checked_upstream else None
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        package_root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        self._processes = [ManagedProcess(
            "xml-multipart-server" if serve_multipart else "fake-gcs-server-front",
            [sys.executable, "-m", "dataflux_ckpt.xml_server", "--upstream", self.upstream, "--host", host,
             "--port", str(self.port), "--min-part-bytes", str(min_part_bytes),
             "--max-part-bytes", str(max_part_bytes),
             "--upstream-timeout", str(upstream_timeout_s), *(["--public-url", public_url] if public_url else []),
             *(["--allow-remote"] if allow_remote else []), *([] if serve_multipart else ["--no-multipart"]),
             *([] if enforce_preconditions else ["--no-preconditions"]),
             *(["--read-upstream", read_upstream] if read_upstream else [])],
            ready=self._answers,
            env=env,
            startup_timeout_s=startup_timeout_s,
        )]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dataflux_ckpt.xml_server``: serve until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m dataflux_ckpt.xml_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="fake-gcs-server base URL, http://host:port")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    parser.add_argument("--min-part-bytes", type=int, default=GCS_MIN_PART_BYTES,
                        help="smallest part but the last a completion accepts (default: %(default)s, GCS's)")
    parser.add_argument("--max-part-bytes", type=int, default=GCS_MAX_PART_BYTES,
                        help="largest part accepted, which caps one request's memory (default: %(default)s, GCS's)")
    parser.add_argument("--upstream-timeout", type=float, default=UPSTREAM_TIMEOUT_S,
                        help="seconds a forwarded request may wait for the upstream (default: %(default)s)")
    parser.add_argument("--public-url", default=None,
                        help="base URL clients reach this server by, where a proxy fronts it (default: its own)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="listen on a non-loopback --host; the server has no authentication, so anyone who "
                             "reaches it may read and change every object (default: refused)")
    parser.add_argument("--no-multipart", dest="serve_multipart", action="store_false",
                        help="pass XML multipart requests on to the upstream instead of serving them")
    parser.add_argument("--no-preconditions", dest="enforce_preconditions", action="store_false",
                        help="pass JSON API writes on without checking their generation preconditions, for an "
                             "upstream that checks them (a FakeGcsServer's front); fake-gcs-server itself does not")
    parser.add_argument("--read-upstream", default=None,
                        help="send GET and HEAD requests here instead: the fake-gcs-server behind an --upstream "
                             "that only checks preconditions (default: --upstream)")
    args = parser.parse_args(argv)
    if not args.allow_remote and not is_loopback(args.host):
        parser.error(f"refusing to listen on {args.host!r} without --allow-remote: the server has no "
                     "authentication, so anyone who reaches it could read and change every object")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = serve(args.upstream, args.host, args.port, min_part_bytes=args.min_part_bytes,
                   upstream_timeout_s=args.upstream_timeout, public_url=args.public_url,
                   allow_remote=args.allow_remote, max_part_bytes=args.max_part_bytes,
                   serve_multipart=args.serve_multipart, enforce_preconditions=args.enforce_preconditions,
                   read_upstream=args.read_upstream)
    served = [what for what, on in (("XML multipart uploads", args.serve_multipart),
                                    ("generation preconditions", args.enforce_preconditions)) if on]
    print(f"serving {' and '.join(served) or 'the JSON API'} on http://{args.host}:{server.server_address[1]} "
          f"in front of {args.upstream}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
