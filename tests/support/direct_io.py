"""Directories for the tests that need O_DIRECT: a probe, and a skip where the filesystem refuses it."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest


def o_direct_works(directory: Path) -> bool:
    """Whether a file in ``directory`` can be opened with ``O_DIRECT`` (tmpfs refuses it)."""
    probe = directory / f".odirect-{uuid.uuid4().hex[:6]}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def o_direct_dir(directory: Path) -> Path:
    """``directory``, once it is known to accept ``O_DIRECT``; the test is skipped where it does not."""
    if not o_direct_works(directory):
        pytest.skip(f"{directory} does not accept O_DIRECT")
    return directory
