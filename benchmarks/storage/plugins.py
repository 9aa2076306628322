"""The checkpoint plugins ``au`` measures: one table of factories, name -> context manager.

Each factory yields ``(checkpoint_io, root)`` with any service it needs (GCS emulator, redis-server)
running; checkpoint paths are ``f"{root}/{mode}/last.ckpt"``. A plugin package that is not there yet,
or a service binary that is missing, raises one of :data:`UNAVAILABLE_ERRORS` on entry, which ``au``
reports as "unavailable" with the error's text.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from lightning.fabric.plugins import CheckpointIO

from lightning_storage_plugins.services import MissingBinaryError

MODES = ("sync", "async", "native-async")
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (ImportError, MissingBinaryError)
GCS_BUCKET_PREFIX = "storage-au"

Opened = tuple[CheckpointIO, str]


@dataclass(frozen=True)
class Plugin:
    """How to open a plugin, and its own async wrapper where it has one (None: it has none)."""

    open: Callable[[Path], AbstractContextManager[Opened]]
    native_async: Callable[[CheckpointIO], CheckpointIO] | None = None


def local_root(workdir: Path, name: str) -> str:
    """``workdir/name`` with one subdirectory per mode made (some writers refuse a missing directory)."""
    root = workdir / name
    for mode in MODES:
        (root / mode).mkdir(parents=True, exist_ok=True)
    return str(root)


@contextmanager
def open_torch(workdir: Path) -> Iterator[Opened]:
    """Lightning's ``TorchCheckpointIO`` on a local directory: the baseline."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    yield TorchCheckpointIO(), local_root(workdir, "torch")


@contextmanager
def open_fastpersist(workdir: Path) -> Iterator[Opened]:
    """``fastpersist.FastPersistCheckpointIO`` on a local directory."""
    from fastpersist import FastPersistCheckpointIO

    yield FastPersistCheckpointIO(), local_root(workdir, "fastpersist")


@contextmanager
def open_dataflux(workdir: Path) -> Iterator[Opened]:
    """``dataflux_ckpt.DatafluxCheckpointIO`` against a local GCS emulator (fake-gcs-server)."""
    from dataflux_ckpt import DatafluxCheckpointIO
    from dataflux_ckpt.emulator import FakeGcsServer

    bucket = f"{GCS_BUCKET_PREFIX}-{uuid.uuid4().hex[:8]}"
    with FakeGcsServer() as gcs, gcs.activated():
        gcs.create_bucket(bucket)
        yield DatafluxCheckpointIO(), f"gs://{bucket}/au"


@contextmanager
def open_smartredis(workdir: Path) -> Iterator[Opened]:
    """``smartredis_io.SmartRedisCheckpointIO`` against an embedded redis-server."""
    from smartredis_io import SmartRedisCheckpointIO
    from smartredis_io.server import RedisServer

    with RedisServer() as server:
        yield SmartRedisCheckpointIO(address=server.address), "au"


PLUGINS: dict[str, Plugin] = {
    "torch": Plugin(open_torch),
    "fastpersist": Plugin(open_fastpersist),
    "dataflux": Plugin(open_dataflux),
    "smartredis": Plugin(open_smartredis),
}
