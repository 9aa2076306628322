"""The private internals of google-cloud-storage, requests and urllib3 the plugin relies on, checked
against the installed versions: each test fails loudly when an upgrade takes one away."""

from __future__ import annotations

import gzip
import http.client
import http.server
import threading

import pytest
import requests
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from dataflux_ckpt import _gcs_compat
from dataflux_ckpt._gcs_compat import UnsupportedDependencyError
from tests.support.gcs import client_for


def test_authorized_session_is_the_clients_requests_session(gcs_emulator):
    client = client_for(gcs_emulator.url)
    session = _gcs_compat.authorized_session(client)
    assert isinstance(session, requests.Session)
    assert session is _gcs_compat.authorized_session(client)  # one pool per client
    assert session.get(f"{gcs_emulator.url}/storage/v1/b", timeout=10).status_code == 200


def test_api_endpoint_follows_client_options_the_emulator_variable_and_the_default(monkeypatch):
    explicit = storage.Client(project="p", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": "http://127.0.0.1:1234/"})
    assert _gcs_compat.api_endpoint(explicit) == "http://127.0.0.1:1234"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4321")
    assert _gcs_compat.api_endpoint(storage.Client(project="p", credentials=AnonymousCredentials())) == \
        "http://127.0.0.1:4321"
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    assert _gcs_compat.api_endpoint(storage.Client(project="p", credentials=AnonymousCredentials())) == \
        "https://storage.googleapis.com"


def test_pool_size_is_readable():
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=17))
    assert _gcs_compat.pool_size(session, "http://") == 17


class _Body(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps connections open between requests
    client_ports: list[int] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.client_ports.append(self.client_address[1])
        payload = b"0123456789" * 1000
        gzipped = self.path == "/gzip"
        body = gzip.compress(payload) if gzipped else payload
        self.send_response(200)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def body_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Body)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _read_all(reader: object, size: int) -> bytes:
    buffer, got = bytearray(size), 0
    while got < size:
        n = reader.readinto(memoryview(buffer)[got:])
        if not n:
            break
        got += n
    return bytes(buffer[:got])


def test_raw_body_reader_receives_plain_bodies_straight_from_http_client(body_server):
    with requests.get(f"{body_server}/plain", stream=True, timeout=10,
                      headers={"Accept-Encoding": "identity"}) as response:
        reader = _gcs_compat.raw_body_reader(response)
        assert isinstance(reader, http.client.HTTPResponse)
        assert _read_all(reader, 10_000) == b"0123456789" * 1000


def test_raw_body_reader_decodes_encoded_bodies(body_server):
    with requests.get(f"{body_server}/gzip", stream=True, timeout=10) as response:
        reader = _gcs_compat.raw_body_reader(response)
        assert not isinstance(reader, http.client.HTTPResponse)
        assert _read_all(reader, 10_000) == b"0123456789" * 1000


def test_release_read_connection_pools_only_connections_whose_body_was_read(body_server):
    session = requests.Session()
    _Body.client_ports.clear()
    for read in (10_000, 10_000, 4_000, 10_000):
        with session.get(f"{body_server}/plain", stream=True, timeout=10,
                         headers={"Accept-Encoding": "identity"}) as response:
            reader = _gcs_compat.raw_body_reader(response)
            assert len(_read_all(reader, read)) == read
            _gcs_compat.release_read_connection(response, reader)
    first, second, partial, after = _Body.client_ports
    assert first == second == partial  # read to the end: reused
    assert after != partial  # bytes left unread: that connection was closed, not reused


def test_a_dependency_without_the_internals_fails_loudly():
    class NotAClient:
        pass

    with pytest.raises(UnsupportedDependencyError, match=r"google-cloud-storage \S+ has no Client._http"):
        _gcs_compat.authorized_session(NotAClient())
    with pytest.raises(UnsupportedDependencyError, match=r"google-cloud-storage \S+ has no Client._connection"):
        _gcs_compat.api_endpoint(NotAClient())
