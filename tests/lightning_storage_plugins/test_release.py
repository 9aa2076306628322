"""``release``: a replaced or removed local file is freed after the call returns, and only a regular
file is ever held (never through a link, never blocking on a FIFO)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_storage_plugins import release
from lightning_storage_plugins.ordering import remove_local
from tests.support.descriptors import wait_until_released


def test_only_a_regular_file_is_held(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_bytes(b"x")
    (tmp_path / "link").symlink_to(regular)
    os.mkfifo(tmp_path / "fifo")  # opening its read side must not wait for a writer
    (tmp_path / "dir").mkdir()
    for name in ("missing", "link", "fifo", "dir"):
        assert release.hold(str(tmp_path / name)) is None, name
    fd = release.hold(str(regular))
    assert fd is not None
    os.close(fd)


@pytest.mark.parametrize("size", [0, 3 * 2**20])
def test_a_removed_file_is_gone_at_once_and_let_go_of_after(tmp_path: Path, size: int) -> None:
    path = tmp_path / "ckpt"
    path.write_bytes(os.urandom(size))
    identity = (path.stat().st_dev, path.stat().st_ino)
    assert remove_local(str(path))
    assert not os.path.lexists(path)
    wait_until_released(identity)
