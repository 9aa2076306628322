"""Fixtures of the recovery tests: one fork server for the session, and each plugin's storage."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from benchmarks.recovery.events import ForkServer
from benchmarks.recovery.job import SCHEMES
from tests.support.direct_io import o_direct_dir
from tests.support.recovery import Storage


@pytest.fixture(scope="session")
def fork_server():
    """A process that has imported torch, Lightning and the plugins, forking every start of the job."""
    with ForkServer() as server:
        yield server


def make_storage(plugin: str, request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A fresh place for ``plugin``'s run: a prefix of a fresh bucket on the session's fake-gcs-server, a
    key prefix on the session's redis-server, or a directory that takes O_DIRECT."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    if SCHEMES.get(plugin) == "gs":
        bucket = request.getfixturevalue("gcs_bucket")
        return Storage(plugin, f"gs://{bucket}/{run}", gcs_url=request.getfixturevalue("gcs_emulator").url)
    if SCHEMES.get(plugin) == "redis":
        return Storage(plugin, f"redis://{run}", redis_address=request.getfixturevalue("redis_server").address)
    return Storage(plugin, str(o_direct_dir(tmp_path) / run))


@pytest.fixture
def storage(plugin: str, request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """Where the test's ``plugin`` keeps its run."""
    return make_storage(plugin, request, tmp_path)
