"""``benchmarks.network``: the model's parameters, and toxiproxy really shaping each connection."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.network import DEFAULT_CLOUD_MBPS, DEFAULT_CLOUD_RTT_MS, Toxiproxy, parse_network

PAYLOAD_BYTES = 1_000_000
RATE_MBPS = 2.0  # slow enough that the machine's load cannot be what limits a transfer


class _Payload(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (BaseHTTPRequestHandler's name)
        body = b"x" * (PAYLOAD_BYTES if self.path == "/big" else 1)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Payload)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _get(url: str, path: str) -> float:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        start = time.perf_counter()
        conn.request("GET", path)
        conn.getresponse().read()
        return time.perf_counter() - start
    finally:
        conn.close()


def test_defaults_and_explicit_parameters() -> None:
    assert parse_network("loopback").is_loopback
    default = parse_network("cloud")
    assert (default.mbps, default.rtt_ms) == (DEFAULT_CLOUD_MBPS, DEFAULT_CLOUD_RTT_MS)
    model = parse_network("cloud:250,6")
    assert (model.mbps, model.rtt_ms, model.latency_ms_per_direction) == (250.0, 6.0, 3)
    assert "250 MB/s per connection" in model.describe() and "6 ms round trip" in model.describe()


@given(mbps=st.floats(min_value=0.001, max_value=1e5, allow_nan=False), rtt=st.integers(0, 10_000))
def test_any_positive_bandwidth_and_round_trip_parse(mbps: float, rtt: int) -> None:
    model = parse_network(f"cloud:{mbps!r},{rtt}")
    assert model.mbps == pytest.approx(mbps) and model.rtt_ms == rtt
    assert abs(2 * model.latency_ms_per_direction - rtt) <= 1


@pytest.mark.parametrize("text", ["", "lan", "cloud:", "cloud:100", "cloud:0,4", "cloud:-1,4", "cloud:1e-4,4",
                                  "cloud:100,4,5", "loopback:1,1", "cloud:abc,4"])
def test_bad_models_are_refused_with_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="network model"):
        parse_network(text)


def test_every_connection_gets_its_own_bandwidth_and_the_round_trip(upstream: str) -> None:
    model = parse_network(f"cloud:{RATE_MBPS},40")
    with Toxiproxy() as toxiproxy:
        url = toxiproxy.proxy("model", upstream, model)
        assert {t["type"] for t in toxiproxy.toxics_of("model")} == {"bandwidth", "latency"}
        one = _get(url, "/big")
        times: list[float] = []
        threads = [threading.Thread(target=lambda: times.append(_get(url, "/big"))) for _ in range(3)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        three = time.perf_counter() - start
        small = min(_get(url, "/small") for _ in range(3))
    ideal = PAYLOAD_BYTES / (RATE_MBPS * 1e6)
    assert one >= 0.9 * ideal  # one connection is held to the rate
    assert three < 2 * one  # three connections side by side each get the whole rate
    assert small >= 0.04  # a request pays the round trip


def test_loopback_has_no_toxics(upstream: str) -> None:
    with Toxiproxy() as toxiproxy:
        toxiproxy.proxy("plain", upstream, parse_network("loopback"))
        assert toxiproxy.toxics_of("plain") == []
