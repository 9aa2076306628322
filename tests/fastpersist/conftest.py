"""Fixtures for the fastpersist tests: O_DIRECT-capable directories, engines, staging buffers, tiny filesystems."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fastpersist import FastPersistContext
from fastpersist.aio import aio_unavailable_reason
from tests.support.direct_io import o_direct_dir

SMALL_BUFFER_MB = 1  # two 512 KiB halves: multi-megabyte tensors straddle several buffer turns
ENGINES = ["aio", "python"]


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A fresh directory on a filesystem that accepts O_DIRECT."""
    return o_direct_dir(tmp_path)


def require_engine(name: str) -> str:
    if name == "aio" and aio_unavailable_reason() is not None:
        pytest.skip(f"DeepSpeed async_io op unavailable: {aio_unavailable_reason()}")
    return name


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Each real engine in turn."""
    return require_engine(request.param)


@pytest.fixture
def aio_engine() -> str:
    """The DeepSpeed aio engine (skipped where its op is not built)."""
    return require_engine("aio")


@pytest.fixture(scope="session")
def small_context() -> Iterator[FastPersistContext]:
    """A context with a 1 MiB staging buffer (two 512 KiB halves), shared by the whole session."""
    with FastPersistContext(io_buffer_mb=SMALL_BUFFER_MB) as context:
        yield context


def _run(*cmd: str) -> bool:
    return shutil.which(cmd[0]) is not None and subprocess.run(cmd, capture_output=True).returncode == 0


@contextlib.contextmanager
def mounted(mountpoint: Path, *mount_args: str) -> Iterator[Path]:
    """Mount a small filesystem at ``mountpoint`` (root only), always unmounting it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mountpoint.mkdir()
    if not _run("mount", *mount_args, str(mountpoint)):
        pytest.skip(f"cannot mount {' '.join(mount_args)} here")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (it refuses O_DIRECT, so writes fall back to buffered I/O)."""
    with mounted(tmp_path / "tmpfs", "-t", "tmpfs", "-o", "size=8m", "tmpfs") as mountpoint:
        yield mountpoint


@pytest.fixture
def tiny_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB ext4 filesystem on a loop device (O_DIRECT works there)."""
    image = tmp_path / "ext4.img"
    with open(image, "wb") as handle:
        handle.truncate(16 * 1024**2)
    if not _run("mkfs.ext4", "-q", "-F", str(image)):
        pytest.skip("mkfs.ext4 is unavailable")
    with mounted(tmp_path / "ext4", "-o", "loop", str(image)) as mountpoint:
        yield mountpoint
