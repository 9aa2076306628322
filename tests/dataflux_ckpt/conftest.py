"""Fixtures for dataflux_ckpt: small-chunk plugins, and fault-injecting proxies in front of the
session's emulator and XML multipart server."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest
from google.cloud import storage

from dataflux_ckpt import DatafluxCheckpointIO
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES
from dataflux_ckpt.testing import FakeGcsServer, XmlMultipartServer
from tests.support.gcs import FAST_RETRY, FaultProxy


@pytest.fixture
def gcs_proxy(gcs_emulator: FakeGcsServer) -> Iterator[FaultProxy]:
    """A proxy in front of the session emulator (no XML multipart: it probes as composite)."""
    with FaultProxy(gcs_emulator.url) as proxy:
        yield proxy


@pytest.fixture
def xml_proxy(gcs_xml_server: XmlMultipartServer) -> Iterator[FaultProxy]:
    """A proxy in front of the session's XML multipart server (XML multipart uploads served)."""
    with FaultProxy(gcs_xml_server.url) as proxy:
        yield proxy


@pytest.fixture
def make_plugin(gcs_emulator: FakeGcsServer) -> Iterator[Callable[..., DatafluxCheckpointIO]]:
    """Plugins with small parts and quick retries; ``client=None`` talks to the session emulator."""

    made: list[DatafluxCheckpointIO] = []

    def make(client: storage.Client | None = None, **kwargs: object) -> DatafluxCheckpointIO:
        options = {"chunk_size": RESUMABLE_CHUNK_MULTIPLE_BYTES, "stream_chunk_size": RESUMABLE_CHUNK_MULTIPLE_BYTES,
                   "max_workers": 3, "retry": FAST_RETRY, **kwargs}
        made.append(DatafluxCheckpointIO(storage_client=client, **options))
        return made[-1]

    yield make
    for plugin in made:
        plugin.teardown()  # background deletions end within the test that started them


@pytest.fixture
def ckpt_io(make_plugin: Callable[..., DatafluxCheckpointIO]) -> DatafluxCheckpointIO:
    """The plugin with small parts, talking to the session emulator."""
    return make_plugin()


_names = itertools.count()


@pytest.fixture
def ckpt_path(gcs_bucket: str) -> str:
    return f"gs://{gcs_bucket}/run/obj-{next(_names)}.ckpt"
