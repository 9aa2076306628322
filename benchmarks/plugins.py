"""The Lightning checkpoint plugins the runners measure, and the services they run against.

One table, :data:`PLUGINS`, serves every runner (``benchmarks.lightning_ckpt``, ``benchmarks.storage au``).
Each entry makes its ``CheckpointIO`` from a :class:`Services`, which starts what the plugin needs on
first use and stops everything on exit:

* ``local``: a directory (a temporary one unless given);
* ``gcs``: ``gs://bucket/prefix``, on real GCS when given, else on fake-gcs-server with the XML multipart
  server in front of it (GCS's parallel-upload API, which the emulator lacks), optionally behind a
  :mod:`benchmarks.network` model; every client of this process is pointed at the front;
* ``redis``: a key prefix on an embedded redis-server.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.network import NetworkModel, Toxiproxy
from lightning_storage_plugins.services import free_port

log = logging.getLogger(__name__)

STORAGES = ("local", "gcs", "redis")
UPLOAD_MODES = ("xml", "composite")
EMULATOR_BACKENDS = ("filesystem", "memory")
LOOPBACK = NetworkModel("loopback")


def is_gcs(path: str) -> bool:
    """Whether ``path`` is a ``gs://`` (or ``gcs://``) URL."""
    return path.startswith(("gs://", "gcs://"))


@dataclass
class ServiceOptions:
    """Where checkpoints go and how the local services are set up.

    ``ckpt_dir``: ``gs://bucket/prefix`` (real GCS, with the environment's credentials) or a local
    directory; default: a bucket on a local emulator and a temporary directory. ``network``: the model
    every GCS client connection goes through (the emulator only).
    """

    ckpt_dir: str | None = None
    local_dir: str | None = None
    project: str | None = None
    emulator_backend: str = "filesystem"
    network: NetworkModel = LOOPBACK


@dataclass
class GcsEndpoint:
    """The local GCS stack: the URL every client talks to, and the process id of each service."""

    url: str
    pids: dict[str, int] = field(default_factory=dict)


class Services:
    """Services and locations shared by every plugin of one run, started on first use.

    A context manager: leaving it stops every service and removes the temporary directories.
    """

    def __init__(self, options: ServiceOptions | None = None) -> None:
        self.options = options or ServiceOptions()
        self.stack = ExitStack()
        self.endpoint: GcsEndpoint | None = None
        self.redis_prefix = f"ckpts-{uuid.uuid4().hex[:8]}"
        self._local_dir: str | None = None
        self._gcs_dir: str | None = None
        self._redis_address: str | None = None

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def local_dir(self) -> str:
        """The directory of local rows (and scratch files)."""
        if self._local_dir is None:
            if self.options.local_dir:
                Path(self.options.local_dir).mkdir(parents=True, exist_ok=True)
                self._local_dir = self.options.local_dir
            else:
                self._local_dir = self.stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-bench-"))
        return self._local_dir

    def gcs_dir(self) -> str:
        """``gs://bucket/prefix`` of GCS rows; starts the local GCS stack unless ``ckpt_dir`` is on GCS."""
        if self._gcs_dir is None:
            ckpt_dir = self.options.ckpt_dir
            if ckpt_dir and is_gcs(ckpt_dir):
                self._gcs_dir = ckpt_dir.rstrip("/")
                if self.options.project:
                    import fsspec.config

                    fsspec.config.conf.setdefault("gcs", {})["project"] = self.options.project
            else:
                bucket = f"bench-{uuid.uuid4().hex[:8]}"
                self.endpoint = self._start_gcs(bucket)
                self._gcs_dir = f"gs://{bucket}/ckpts"
        return self._gcs_dir

    def _start_gcs(self, bucket: str) -> GcsEndpoint:
        from dataflux_ckpt.emulator import activated, create_bucket
        from dataflux_ckpt.testing import FakeGcsServer

        options = self.options
        root = None
        if options.emulator_backend == "filesystem":
            root = self.stack.enter_context(tempfile.TemporaryDirectory(prefix="fake-gcs-"))
        emulator = self.stack.enter_context(FakeGcsServer(root=root))
        proxy = self.stack.enter_context(Toxiproxy()) if not options.network.is_loopback else None
        # Behind a network model, the URLs the XML server hands out (resumable-upload sessions) must
        # name the proxy, so that those requests cross the model too: its port is chosen first.
        public_port = free_port() if proxy is not None else None
        public_url = f"http://127.0.0.1:{public_port}" if public_port else None
        xml = self.stack.enter_context(_xml_server(emulator, public_url))
        pids = {"fake-gcs-server": emulator.emulator_pid, "fake-gcs-server-front": emulator.pid,
                "xml-multipart-server": xml.pid}
        front = xml.url
        if proxy is not None:
            pids["toxiproxy-server"] = proxy.pid
            front = proxy.proxy("gcs", front, options.network, listen_port=public_port)
        create_bucket(front, bucket)
        self.stack.enter_context(activated(front))
        log.info("GCS emulator (%s backend) at %s, clients use %s (%s), bucket %s",
                 options.emulator_backend, emulator.url, front, options.network.describe(), bucket)
        return GcsEndpoint(front, pids)

    def redis_address(self) -> str:
        """``host:port`` of the embedded redis-server (started on first use)."""
        if self._redis_address is None:
            from smartredis_io import RedisServer

            self._redis_address = self.stack.enter_context(RedisServer()).address
        return self._redis_address

    def directory(self, storage: str) -> str:
        """Where checkpoints of ``storage`` go (starting its service).

        Raises:
            ValueError: ``storage`` is not one of :data:`STORAGES`.
        """
        if storage == "local":
            ckpt_dir = self.options.ckpt_dir
            return ckpt_dir if ckpt_dir and not is_gcs(ckpt_dir) else self.local_dir()
        if storage == "gcs":
            return self.gcs_dir()
        if storage == "redis":
            self.redis_address()
            return self.redis_prefix
        raise ValueError(f"unknown storage {storage!r}; choose from {', '.join(STORAGES)}")


def _xml_server(emulator: Any, public_url: str | None) -> Any:
    """The XML multipart server in front of ``emulator`` (a ``FakeGcsServer``), handing out ``public_url``
    where given. Given the server rather than its URL, it reads from fake-gcs-server directly and leaves
    the precondition checks to the server's front, so that a load is one hop, as on GCS."""
    from dataflux_ckpt.xml_server import XmlMultipartServer

    return XmlMultipartServer(emulator, public_url=public_url)


def fsspec_size(path: str, checkpoint_io: Any) -> int:
    """Bytes of the file or object at ``path``, through fsspec (local paths and ``gs://``)."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    return get_filesystem(path).size(path)


@dataclass(frozen=True)
class Plugin:
    """One Lightning ``CheckpointIO`` as the runners measure it.

    ``make(services, upload_mode)`` builds it (``upload_mode`` is ``"auto"`` or one of
    :data:`UPLOAD_MODES`; only plugins with ``follows_upload_mode`` use it). ``upload`` names the kind
    of upload its saves make, which picks its ceiling: ``"single"`` (one stream), ``"parallel"``
    (parallel parts: XML multipart or composite) or ``None`` (not GCS). ``requires`` names the modules
    (one, or a tuple) without which the plugin is unavailable. ``native_async`` wraps it in its own
    async path, where it has one. ``settle(io)`` waits for work a save leaves running in the background (untimed: it overlaps
    training in real use, and must not slow the next measurement).
    """

    key: str
    name: str
    storage: str
    make: Callable[[Services, str], Any]
    requires: str | tuple[str, ...] | None = None
    size: Callable[[str, Any], int] = fsspec_size
    upload: str | None = None
    follows_upload_mode: bool = False
    native_async: Callable[[Any], Any] | None = None
    settle: Callable[[Any], None] | None = None

    def unavailable_reason(self) -> str | None:
        """Why the plugin cannot run here (a module it requires is missing), or None."""
        for module in (self.requires,) if isinstance(self.requires, str) else self.requires or ():
            try:
                __import__(module)
            except ImportError as err:
                return f"{type(err).__name__}: {err}"
        return None


def _torch_io(services: Services, upload_mode: str) -> Any:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    return TorchCheckpointIO()


def _dataflux_io(use_transfer_manager: bool) -> Callable[[Services, str], Any]:
    def make(services: Services, upload_mode: str) -> Any:
        from dataflux_ckpt import DatafluxCheckpointIO

        return DatafluxCheckpointIO(project_name=services.options.project,
                                    use_transfer_manager=use_transfer_manager, upload_mode=upload_mode)

    return make


def _dataflux_settle(checkpoint_io: Any) -> None:
    checkpoint_io.teardown()  # waits for the background deletion of composite-upload parts


def _tiered_io(services: Services, upload_mode: str) -> Any:
    from dataflux_ckpt import TieredCheckpointIO

    # A local tier of its own on the local rows' disk: each plugin made is a node of its own.
    local_dir = tempfile.mkdtemp(prefix="tier-", dir=services.local_dir())
    services.stack.callback(shutil.rmtree, local_dir, ignore_errors=True)
    return TieredCheckpointIO(local_dir, project_name=services.options.project, upload_mode=upload_mode)


def _fastpersist_io(services: Services, upload_mode: str) -> Any:
    from fastpersist import FastPersistCheckpointIO

    return FastPersistCheckpointIO()


def _smartredis_io(services: Services, upload_mode: str) -> Any:
    from smartredis_io import SmartRedisCheckpointIO

    return SmartRedisCheckpointIO(address=services.redis_address())


def _smartredis_size(path: str, checkpoint_io: Any) -> int:
    return checkpoint_io.checkpoint_size(path)


BASELINE_KEY = "torch-gcsfs"

PLUGINS: dict[str, Plugin] = {
    p.key: p
    for p in [
        Plugin("torch-local", "TorchCheckpointIO (local)", "local", _torch_io),
        Plugin("torch-gcsfs", "TorchCheckpointIO (gcsfs)", "gcs", _torch_io, requires="gcsfs", upload="single"),
        Plugin("dataflux-no-tm", "Dataflux (Transfer Manager Disabled)", "gcs", _dataflux_io(False),
               requires="dataflux_ckpt.checkpoint_io", upload="single", settle=_dataflux_settle),
        Plugin("dataflux-tm", "Dataflux (Transfer Manager Enabled)", "gcs", _dataflux_io(True),
               requires="dataflux_ckpt.checkpoint_io", upload="parallel", follows_upload_mode=True,
               settle=_dataflux_settle),
        Plugin("tiered", "TieredCheckpointIO (NVMe, then GCS)", "gcs", _tiered_io,
               requires=("dataflux_ckpt.checkpoint_io", "fastpersist.checkpoint_io"), upload="parallel",
               follows_upload_mode=True),
        Plugin("fastpersist", "FastPersistCheckpointIO (local)", "local", _fastpersist_io,
               requires="fastpersist.checkpoint_io"),
        Plugin("smartredis", "SmartRedisCheckpointIO (redis)", "redis", _smartredis_io,
               requires="smartredis_io.lightning.checkpoint_io", size=_smartredis_size),
    ]
}

