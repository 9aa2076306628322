"""Pointing GCS clients at a local emulator, and what the local GCS services share.

    from dataflux_ckpt.testing import FakeGcsServer

    with FakeGcsServer() as gcs, gcs.activated():
        gcs.create_bucket("ckpts")
        trainer = Trainer(plugins=[DatafluxCheckpointIO()], default_root_dir="gs://ckpts/run1")

The services themselves, :class:`dataflux_ckpt.testing.FakeGcsServer` (fake-gcs-server) and
:class:`dataflux_ckpt.testing.XmlMultipartServer` (GCS's XML API multipart uploads, served in front
of it), are :class:`LocalGcsService` s; :func:`activated` and :func:`emulator_environ` point this
process' or a child's clients (google-cloud-storage, gcsfs/fsspec) at any emulator's URL, and
:func:`configure_gcsfs_for_emulator` keeps gcsfs from probing it.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from lightning_storage_plugins.services import ManagedProcess, is_loopback

log = logging.getLogger(__name__)

__all__ = [
    "EMULATOR_PROJECT",
    "LocalGcsService",
    "activated",
    "configure_gcsfs_for_emulator",
    "create_bucket",
    "emulator_environ",
]

EMULATOR_PROJECT = "test-project"
EMULATOR_HOST_ENV = "STORAGE_EMULATOR_HOST"
GCSFS_PROBE_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
HTTP_TIMEOUT_S = 10.0

_Service = TypeVar("_Service", bound="LocalGcsService")


class LocalGcsService:
    """What :class:`~dataflux_ckpt.testing.FakeGcsServer` and :class:`~dataflux_ckpt.testing.XmlMultipartServer`
    share: processes on loopback ports that serve the GCS JSON API at :attr:`url`, started and stopped with it.

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
        return json_api_answers(self.host, self.port)

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


def json_api_answers(host: str, port: int) -> bool:
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
