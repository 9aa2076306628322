"""Fixtures for the DCP storage tests: checkpoint locations on the emulator and on an O_DIRECT filesystem."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support.direct_io import o_direct_dir


@pytest.fixture
def gs_root(gcs_bucket: str) -> str:
    """A fresh ``gs://`` prefix on the session's fake-gcs-server."""
    return f"gs://{gcs_bucket}/run-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def nvme_root(tmp_path: Path) -> Path:
    """A fresh directory on a filesystem that accepts O_DIRECT."""
    return o_direct_dir(tmp_path) / "ckpt"
