"""``release``: a replaced or removed local file is freed after the call returns, and only a regular
file is ever held (never through a link, never blocking on a FIFO)."""

from __future__ import annotations

import os
import threading
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


def _remove_at_once(barrier: threading.Barrier, path: Path, results: list[bool], errors: list[BaseException]) -> None:
    barrier.wait()
    try:
        results.append(remove_local(str(path)))
    except BaseException as exc:  # noqa: BLE001 - the test reports every racer's failure
        errors.append(exc)


@pytest.mark.parametrize("kind", ["file", "link", "directory"])
def test_removals_racing_on_one_path_all_succeed_and_leave_nothing(tmp_path: Path, kind: str) -> None:
    """Behind ``AsyncCheckpointIO`` the training thread's removal and the save thread's removal of a
    save it overtook can meet on one path: neither may fail because the other got there first."""
    racers = 4
    barrier = threading.Barrier(racers)
    for round_ in range(150):
        path = tmp_path / f"ckpt-{round_}"
        if kind == "file":
            path.write_bytes(b"x" * 4096)
        elif kind == "link":
            path.symlink_to(tmp_path / "elsewhere")
        else:
            for sub in range(8):
                (path / f"shard-{sub}").mkdir(parents=True)
                (path / f"shard-{sub}" / "data").write_bytes(b"x")
        results: list[bool] = []
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_remove_at_once, args=(barrier, path, results, errors))
                   for _ in range(racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, f"round {round_}: {errors!r}"
        assert not os.path.lexists(path)
        assert any(results)
        if kind != "directory":
            assert results.count(True) == 1, results  # one removal found it; the others found nothing
