"""Fixtures for the DCP storage tests: checkpoint locations on the emulator and on an O_DIRECT filesystem."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.direct_io import o_direct_dir
from tests.support.gcs import FaultProxy


@pytest.fixture
def gs_root(gcs_bucket: str) -> str:
    """A fresh ``gs://`` prefix on the session's fake-gcs-server."""
    return f"gs://{gcs_bucket}/run-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def nvme_root(tmp_path: Path) -> Path:
    """A fresh directory on a filesystem that accepts O_DIRECT."""
    return o_direct_dir(tmp_path) / "ckpt"


@pytest.fixture
def gcs_proxy(gcs_emulator: object) -> Iterator[FaultProxy]:
    """A proxy in front of the session emulator, through which rank processes reach GCS."""
    with FaultProxy(gcs_emulator.url) as proxy:  # type: ignore[attr-defined]
        yield proxy


@pytest.fixture
def local_root(tmp_path: Path) -> Path:
    """Where the local tiers of tiered runs go: a filesystem that accepts O_DIRECT."""
    return o_direct_dir(tmp_path)
