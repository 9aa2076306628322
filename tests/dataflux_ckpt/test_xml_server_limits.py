"""The XML multipart server against hostile requests from a raw socket: memory follows the bytes that
arrive, malformed framing gets 400, and every answer is well-formed XML."""

from __future__ import annotations

import socket
import threading
import tracemalloc
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import requests

from dataflux_ckpt.xml_server import serve
from tests.support.gcs import S3_NAMESPACE

CLAIMED = 1536 * 2**20


def _exchange(url: str, raw: bytes, *, end_write: bool = False) -> tuple[int, bytes]:
    """Send ``raw`` on a fresh connection; the answer's status and body (``(0, b"")``: none came)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(raw)
        if end_write:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                return 0, b""
            received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(lines[0].split()[1]), body


def _initiate(url: str, bucket: str, key: str) -> str:
    answer = requests.post(f"{url}/{bucket}/{key}?uploads", timeout=30)
    assert answer.status_code == 200, answer.text
    return ElementTree.fromstring(answer.content).findtext(f"{{{S3_NAMESPACE}}}UploadId")


def _error_code(body: bytes) -> str | None:
    return ElementTree.fromstring(body).findtext("Code")  # raises on malformed XML


@pytest.fixture
def in_process_server(gcs_emulator) -> Iterator[str]:
    """An XML multipart server in this process (so that tracemalloc sees its allocations), 1 MiB parts."""
    server = serve(gcs_emulator.url, min_part_bytes=0, max_part_bytes=2**20)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_memory_follows_the_bytes_received_not_content_length(gcs_emulator, gcs_bucket):
    server = serve(gcs_emulator.url, min_part_bytes=0)  # GCS's 5 GiB part cap: the claim is allowed
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        upload_id = _initiate(url, gcs_bucket, "big.bin")
        tracemalloc.start()
        try:
            request = (f"PUT /{gcs_bucket}/big.bin?partNumber=1&uploadId={upload_id} HTTP/1.1\r\n"
                       f"Host: x\r\nContent-Length: {CLAIMED}\r\n\r\n").encode() + b"0123456789"
            _exchange(url, request, end_write=True)  # the server sees the body end after 10 bytes
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * 2**20, f"the server took {peak} bytes for a 10-byte body claiming {CLAIMED}"
        parts = requests.get(f"{url}/{gcs_bucket}/big.bin?uploadId={upload_id}", timeout=30)
        assert ElementTree.fromstring(parts.content).find(f"{{{S3_NAMESPACE}}}Part") is None
    finally:
        server.shutdown()
        server.server_close()


def test_a_part_past_the_cap_is_refused(in_process_server, gcs_bucket):
    upload_id = _initiate(in_process_server, gcs_bucket, "capped.bin")
    target = f"/{gcs_bucket}/capped.bin?partNumber=1&uploadId={upload_id}"
    status, body = _exchange(in_process_server, f"PUT {target} HTTP/1.1\r\nHost: x\r\n"
                                                f"Content-Length: {2**20 + 1}\r\n\r\n".encode())
    assert (status, _error_code(body)) == (400, "EntityTooLarge")
    chunk = b"x" * 2**19
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    status, body = _exchange(in_process_server, f"PUT {target} HTTP/1.1\r\nHost: x\r\n"
                                                f"Transfer-Encoding: chunked\r\n\r\n".encode() + chunked)
    assert (status, _error_code(body)) == (400, "EntityTooLarge")
    ok = requests.put(f"{in_process_server}{target}", data=b"y" * 2**20, timeout=30)
    assert ok.status_code == 200


BAD_FRAMING = {
    "negative length": b"Content-Length: -5\r\n\r\nhello",
    "non-numeric length": b"Content-Length: abc\r\n\r\nhello",
    "length with underscore": b"Content-Length: 1_0\r\n\r\n0123456789",
    "signed length": b"Content-Length: +5\r\n\r\nhello",
    "two lengths": b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "bad chunk size": b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    "negative chunk size": b"Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
    "chunk without CRLF": b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello!!0\r\n\r\n",
}


@pytest.mark.parametrize("framing", list(BAD_FRAMING))
@pytest.mark.parametrize("target", ["part", "json upload"])
def test_malformed_framing_gets_400(gcs_xml_server, gcs_bucket, framing, target):
    if target == "part":
        upload_id = _initiate(gcs_xml_server.url, gcs_bucket, "framed.bin")
        line = f"PUT /{gcs_bucket}/framed.bin?partNumber=1&uploadId={upload_id} HTTP/1.1\r\n"
    else:
        line = f"POST /upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=framed.bin HTTP/1.1\r\n"
    status, body = _exchange(gcs_xml_server.url, f"{line}Host: x\r\n".encode() + BAD_FRAMING[framing])
    assert status == 400
    assert _error_code(body) == "InvalidArgument"
    assert requests.get(f"{gcs_xml_server.url}/storage/v1/b/{gcs_bucket}/o/framed.bin", timeout=30).status_code == 404


@pytest.mark.parametrize("name", ["nul%00name", "cr%0Dlf%0Aname", "unit%1Fsep", "del%7F", "%2E%2E", "a/%2E/b",
                                  "run/../../victim/x"])
def test_invalid_object_names_get_400_and_well_formed_xml(gcs_xml_server, gcs_bucket, name):
    status, body = _exchange(gcs_xml_server.url, f"POST /{gcs_bucket}/{name}?uploads HTTP/1.1\r\n"
                                                 f"Host: x\r\nContent-Length: 0\r\n\r\n".encode())
    assert status == 400
    assert _error_code(body) == "InvalidArgument"
    listed = requests.get(f"{gcs_xml_server.url}/{gcs_bucket}?uploads", timeout=30)
    assert ElementTree.fromstring(listed.content).find(f"{{{S3_NAMESPACE}}}Upload") is None
