"""The local GCS services have no authentication: they listen on loopback unless the caller opts in."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import requests

from dataflux_ckpt.testing import FakeGcsServer, XmlMultipartServer
from dataflux_ckpt.xml_server import serve
from lightning_storage_plugins.services import free_port

NOT_LOOPBACK = ["0.0.0.0", "::", "", "10.1.2.3", "example.org"]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("host", NOT_LOOPBACK)
def test_services_refuse_a_non_loopback_address_without_opt_in(gcs_emulator, host):
    port = free_port()
    for start in (lambda: FakeGcsServer(host, port), lambda: XmlMultipartServer(gcs_emulator, host, port),
                  lambda: serve(gcs_emulator.url, host, port)):
        with pytest.raises(ValueError, match=f"refusing to start .* on {host!r}.*allow_remote=True"):
            start()
    assert not _listening(port)


def test_the_command_line_refuses_a_non_loopback_address_without_opt_in(gcs_emulator):
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "dataflux_ckpt.xml_server", "--upstream", gcs_emulator.url,
                             "--host", "0.0.0.0", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "refusing to listen on '0.0.0.0' without --allow-remote" in result.stderr
    assert not _listening(port)


def test_services_bind_loopback_by_default(gcs_emulator, gcs_xml_server):
    assert gcs_emulator.host == gcs_xml_server.host == "127.0.0.1"
    server = serve(gcs_emulator.url)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()


def test_services_listen_everywhere_when_the_caller_opts_in(gcs_emulator, gcs_bucket):
    with XmlMultipartServer(gcs_emulator, "0.0.0.0", allow_remote=True, min_part_bytes=0) as xml:
        answer = requests.get(f"http://127.0.0.1:{xml.port}/storage/v1/b/{gcs_bucket}", timeout=10)
        assert answer.status_code == 200
    with FakeGcsServer("0.0.0.0", allow_remote=True) as fake:
        assert requests.get(f"http://127.0.0.1:{fake.port}/storage/v1/b", timeout=10).status_code == 200
