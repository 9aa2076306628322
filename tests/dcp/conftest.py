"""Fixtures for the DCP storage tests: checkpoint locations on the emulator and on an O_DIRECT filesystem."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest


@pytest.fixture
def gs_root(gcs_bucket: str) -> str:
    """A fresh ``gs://`` prefix on the session's fake-gcs-server."""
    return f"gs://{gcs_bucket}/run-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def nvme_root(tmp_path: Path) -> Path:
    """A fresh directory on a filesystem that accepts O_DIRECT."""
    probe = tmp_path / ".odirect"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    finally:
        probe.unlink(missing_ok=True)
    return tmp_path / "ckpt"
