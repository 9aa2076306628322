"""A cloud-like network between the benchmark's clients and its local services, made with toxiproxy.

``loopback`` is no model at all. ``cloud[:MBPS,RTT_MS]`` sends every client connection through one
toxiproxy proxy whose toxics give each TCP connection its own bandwidth of ``MBPS`` (10^6 bytes/s, in
each direction) and add half of ``RTT_MS`` of latency in each direction. toxiproxy keeps one instance
of every toxic per proxied connection, so N parallel connections get N times the bandwidth, as parallel
streams to a cloud object store do, and each request pays the round trip.

The defaults come from the Dataflux Lightning benchmark's GCS results: a single-stream gcsfs save ran at
85-95 MB/s, so one connection carries 100 MB/s (a stream also pays serialization and request round
trips), and an in-region round trip takes a few milliseconds.

toxiproxy-server is found through ``$TOXIPROXY_SERVER_BIN``, then ``PATH`` (``make setup`` builds it).
"""

from __future__ import annotations

import http.client
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from lightning_storage_plugins.services import ManagedProcess, find_binary, free_port

TOXIPROXY_VERSION = "v2.12.0"
BINARY_ENV_VAR = "TOXIPROXY_SERVER_BIN"
INSTALL_HINT = (
    f"Build it with `GOBIN=<dir> go install github.com/Shopify/toxiproxy/v2/cmd/server@{TOXIPROXY_VERSION}` "
    f"(the binary is named `server`) and set ${BINARY_ENV_VAR} to it; in a source checkout `make setup` "
    "builds .tools/bin/toxiproxy-server and `make bench` sets the variable."
)
DEFAULT_CLOUD_MBPS = 100.0
DEFAULT_CLOUD_RTT_MS = 4.0
API_TIMEOUT_S = 10.0
KB = 1000  # toxiproxy's bandwidth unit is KB/s (10^3 bytes per second)

_NETWORK_RE = re.compile(r"^(loopback|cloud)(?::([0-9.]+),([0-9.]+))?$")


@dataclass(frozen=True)
class NetworkModel:
    """How client connections reach the services: straight over loopback, or through a cloud model.

    ``mbps``: bandwidth of each connection in each direction (10^6 bytes/s); ``rtt_ms``: round-trip
    time, half of it added in each direction. Both are ``None`` for loopback.
    """

    name: str
    mbps: float | None = None
    rtt_ms: float | None = None

    @property
    def is_loopback(self) -> bool:
        return self.name == "loopback"

    @property
    def latency_ms_per_direction(self) -> int:
        """toxiproxy takes whole milliseconds; an odd round trip is split as evenly as that allows."""
        return round((self.rtt_ms or 0.0) / 2)

    def describe(self) -> str:
        if self.is_loopback:
            return "loopback (no network model)"
        return (f"cloud model: {self.mbps:g} MB/s per connection in each direction, "
                f"{2 * self.latency_ms_per_direction} ms round trip "
                f"({self.latency_ms_per_direction} ms each way), through toxiproxy")


def parse_network(text: str) -> NetworkModel:
    """``loopback``, ``cloud`` or ``cloud:MBPS,RTT_MS``.

    Raises:
        ValueError: ``text`` is none of these, or a number is not positive (a round trip of 0 is fine).
    """
    match = _NETWORK_RE.match(text.strip())
    if not match:
        raise ValueError(f"network model {text!r}: use loopback, cloud or cloud:MBPS,RTT_MS (e.g. cloud:100,4)")
    name, mbps, rtt = match.groups()
    if name == "loopback":
        if mbps is not None:
            raise ValueError(f"network model {text!r}: loopback takes no parameters")
        return NetworkModel("loopback")
    model = NetworkModel("cloud", float(mbps) if mbps else DEFAULT_CLOUD_MBPS,
                         float(rtt) if rtt else DEFAULT_CLOUD_RTT_MS)
    if model.mbps <= 0 or model.rtt_ms < 0:
        raise ValueError(f"network model {text!r}: the bandwidth must be positive and the round trip not negative")
    if model.mbps * 1e6 / KB < 1:
        raise ValueError(f"network model {text!r}: toxiproxy's smallest bandwidth is 1 KB/s")
    return model


def find_toxiproxy_server() -> str:
    """The toxiproxy-server executable: ``$TOXIPROXY_SERVER_BIN``, then ``PATH``.

    Raises:
        MissingBinaryError: not found; the message says how to build it.
    """
    return find_binary("toxiproxy-server", BINARY_ENV_VAR, install_hint=INSTALL_HINT)


class ToxiproxyError(RuntimeError):
    """toxiproxy's API refused a request; the message names the request and its answer."""


class Toxiproxy:
    """toxiproxy-server on loopback, with its API on a free port; a context manager.

    Raises:
        MissingBinaryError: no toxiproxy-server binary was found.
    """

    def __init__(self, host: str = "127.0.0.1", *, startup_timeout_s: float = 30.0) -> None:
        self.host = host
        self.api_port = free_port(host)
        self._process = ManagedProcess(
            "toxiproxy-server",
            [find_toxiproxy_server(), "-host", host, "-port", str(self.api_port)],
            ready=self._answers,
            startup_timeout_s=startup_timeout_s,
        )

    def _answers(self) -> bool:
        return self._api("GET", "/version", ok=(200,)) is not None

    def _api(self, method: str, target: str, body: object = None, ok: tuple[int, ...] = (200, 201, 204)) -> object:
        conn = http.client.HTTPConnection(self.host, self.api_port, timeout=API_TIMEOUT_S)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            conn.request(method, target, body=payload, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            if response.status not in ok:
                raise ToxiproxyError(f"toxiproxy {method} {target} -> {response.status}: {data[:300]!r}")
            return json.loads(data) if data.strip().startswith((b"{", b"[")) else data
        finally:
            conn.close()

    def __enter__(self) -> Toxiproxy:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.stop()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def proxy(self, name: str, upstream_url: str, model: NetworkModel, *, listen_port: int | None = None) -> str:
        """A proxy to ``upstream_url`` with ``model``'s toxics on every connection; returns its URL.

        ``listen_port`` fixes the port (a service that must advertise the URL can be told it first).
        """
        upstream = urlsplit(upstream_url)
        listen = f"{self.host}:{listen_port or free_port(self.host)}"
        created = self._api("POST", "/proxies", {
            "name": name, "listen": listen, "upstream": f"{upstream.hostname}:{upstream.port}", "enabled": True,
        })
        for toxic in toxics(model):
            self._api("POST", f"/proxies/{name}/toxics", toxic)
        return f"http://{created['listen']}"

    def toxics_of(self, name: str) -> list[dict[str, object]]:
        """The toxics toxiproxy reports for proxy ``name`` (what the run really used)."""
        return list(self._api("GET", f"/proxies/{name}/toxics"))


def toxics(model: NetworkModel) -> list[dict[str, object]]:
    """toxiproxy toxics for ``model``: bandwidth and latency on each direction of every connection."""
    if model.is_loopback:
        return []
    result: list[dict[str, object]] = []
    for stream in ("upstream", "downstream"):
        result.append({"name": f"bandwidth_{stream}", "type": "bandwidth", "stream": stream, "toxicity": 1.0,
                       "attributes": {"rate": round(model.mbps * 1e6 / KB)}})
        if model.latency_ms_per_direction:
            result.append({"name": f"latency_{stream}", "type": "latency", "stream": stream, "toxicity": 1.0,
                           "attributes": {"latency": model.latency_ms_per_direction, "jitter": 0}})
    return result
