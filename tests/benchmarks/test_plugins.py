"""The local GCS stack the benchmarks start (``benchmarks.plugins.Services``)."""

from __future__ import annotations

import psutil
import requests

from benchmarks.plugins import Services
from dataflux_ckpt.paths import media_url_path, upload_url_path
from tests.support.processes import paused

TIMEOUT_S = 10.0


def test_loads_reach_fake_gcs_server_in_one_hop_and_each_service_is_metered():
    """Reads through the XML multipart server go straight to fake-gcs-server, as a load on GCS is one
    hop: they are served while the precondition-checking front in between is stopped. The CPU meter
    watches each process under its own name."""
    with Services() as services:
        bucket = services.gcs_dir()[len("gs://"):].split("/")[0]
        endpoint = services.endpoint
        commands = {name: " ".join(psutil.Process(pid).cmdline()) for name, pid in endpoint.pids.items()}
        assert set(commands) == {"fake-gcs-server", "fake-gcs-server-front", "xml-multipart-server"}
        assert "dataflux_ckpt.xml_server" not in commands["fake-gcs-server"]
        assert all("dataflux_ckpt.xml_server" in commands[name]
                   for name in ("fake-gcs-server-front", "xml-multipart-server"))
        data = b"one hop" * 1000
        written = requests.post(endpoint.url + upload_url_path(bucket, "hop.bin", "media"), data=data,
                                headers={"Content-Type": "application/octet-stream"}, timeout=TIMEOUT_S)
        assert written.status_code == 200, written.text
        with paused(endpoint.pids["fake-gcs-server-front"]):
            read = requests.get(endpoint.url + media_url_path(bucket, "hop.bin"), timeout=TIMEOUT_S)
        assert read.status_code == 200 and read.content == data
