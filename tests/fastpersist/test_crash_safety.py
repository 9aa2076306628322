"""What a crash leaves and who cleans it, with real processes: a writer frozen (SIGSTOP) and killed
(SIGKILL) mid-save; permission bits of replaced files; objects torch's skip_data cannot take."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fastpersist import FastPersistContext, fastpersist_load, fastpersist_save, remove_stale_temporaries
from fastpersist.writer import TEMP_SUFFIX
from tests.support.descriptors import wait_until_released
from tests.support.fp_compare import assert_same

DEADLINE_S = 30
WRITER = """
import sys, torch
from fastpersist import fastpersist_save
state = {f"w{i}": torch.randn(4 * 1024**2) for i in range(16)}  # 256 MiB
print("ready", flush=True)
fastpersist_save(state, sys.argv[1], engine="python")
print("saved", flush=True)
"""


def temporaries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(TEMP_SUFFIX))


@pytest.fixture
def frozen_writer(ckpt_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """A child process stopped (SIGSTOP) while its save's temporary file is being written."""
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(ckpt_dir / "big.pt")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        while (line := child.stdout.readline()) and line.strip() != "ready":
            pass
        deadline = time.monotonic() + DEADLINE_S
        while not any(p.stat().st_size > 0 for p in temporaries(ckpt_dir)):
            assert child.poll() is None, "writer finished before it could be stopped"
            assert time.monotonic() < deadline, "writer never started writing"
            time.sleep(0.002)
        child.send_signal(signal.SIGSTOP)
        yield child
    finally:
        child.kill()
        child.wait(timeout=DEADLINE_S)


def test_a_live_writers_temporary_is_kept_and_a_killed_ones_is_removed(
    ckpt_dir: Path, frozen_writer: subprocess.Popen[str]
) -> None:
    [left] = temporaries(ckpt_dir)
    fastpersist_save({"small": torch.ones(3)}, ckpt_dir / "other.pt", engine="python")
    assert temporaries(ckpt_dir) == [left], "a live (stopped) writer's temporary was removed"

    frozen_writer.kill()
    frozen_writer.wait(timeout=DEADLINE_S)
    assert temporaries(ckpt_dir) == [left] and left.stat().st_size > 0  # the crash leaves it behind
    stats = fastpersist_save({"small": torch.ones(3)}, ckpt_dir / "other.pt", engine="python")
    assert temporaries(ckpt_dir) == [] and stats.bytes > 0
    assert not (ckpt_dir / "big.pt").exists()  # the killed save never published a partial file


def test_a_writer_resumed_after_a_stop_still_completes(
    ckpt_dir: Path, frozen_writer: subprocess.Popen[str]
) -> None:
    assert remove_stale_temporaries(str(ckpt_dir)) == []
    frozen_writer.send_signal(signal.SIGCONT)
    output, _ = frozen_writer.communicate(timeout=DEADLINE_S)
    assert frozen_writer.returncode == 0 and "saved" in output.splitlines()
    assert temporaries(ckpt_dir) == []
    assert len(torch.load(ckpt_dir / "big.pt", weights_only=True)) == 16


def test_a_clean_up_at_the_moment_of_publishing_leaves_the_save_alone(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another writer's clean-up (another rank saving into the same directory) runs exactly between
    # the finished write and the rename: the temporary must still be locked by its live writer.
    rename = os.replace
    removed: list[list[str]] = []

    def clean_up_then_rename(src: str, dst: str) -> None:
        removed.append(remove_stale_temporaries(str(ckpt_dir)))
        rename(src, dst)

    monkeypatch.setattr(os, "replace", clean_up_then_rename)
    fastpersist_save({"w": torch.arange(10)}, ckpt_dir / "ckpt.pt", engine="python")
    assert removed == [[]]
    assert torch.equal(torch.load(ckpt_dir / "ckpt.pt", weights_only=True)["w"], torch.arange(10))


def clean_up_at_the_first_lock(directory: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Run another writer's clean-up of ``directory`` just before the first ``flock`` of this process
    (a writer locking its new temporary); the returned list gets what it removed."""
    flock = fcntl.flock
    removed: list[list[str]] = []

    def clean_up_then_lock(fd: int, operation: int) -> None:
        if not removed:
            removed.append([])  # the clean-up's own flock calls go straight through
            removed[0] = remove_stale_temporaries(str(directory))
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", clean_up_then_lock)
    return removed


def test_a_clean_up_at_the_moment_a_temporary_is_created_leaves_it_alone(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Another rank's clean-up runs just before the writer locks its new temporary (the writer's first
    # flock): the temporary is not in the directory yet, so nothing is taken for a dead writer's.
    removed = clean_up_at_the_first_lock(ckpt_dir, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        fastpersist_save({"w": torch.arange(10)}, ckpt_dir / "ckpt.pt", engine="python")
    assert removed == [[]] and not caplog.records
    assert torch.equal(torch.load(ckpt_dir / "ckpt.pt", weights_only=True)["w"], torch.arange(10))
    assert sorted(os.listdir(ckpt_dir)) == ["ckpt.pt"]


def test_without_unnamed_files_a_temporary_taken_by_a_clean_up_is_made_again(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A filesystem without O_TMPFILE (NFS, many parallel filesystems): the temporary has its name
    # before it is locked, and a clean-up in that moment takes it for a dead writer's and removes it.
    monkeypatch.delattr(os, "O_TMPFILE")
    removed = clean_up_at_the_first_lock(ckpt_dir, monkeypatch)
    fastpersist_save({"w": torch.arange(10)}, ckpt_dir / "ckpt.pt", engine="python")
    assert len(removed[0]) == 1 and removed[0][0].endswith(TEMP_SUFFIX)
    assert torch.equal(torch.load(ckpt_dir / "ckpt.pt", weights_only=True)["w"], torch.arange(10))
    assert sorted(os.listdir(ckpt_dir)) == ["ckpt.pt"]


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o604])
def test_a_replaced_file_keeps_its_permission_bits(ckpt_dir: Path, mode: int) -> None:
    path = ckpt_dir / "ckpt.pt"
    torch.save({"old": torch.ones(1)}, path)
    os.chmod(path, mode)
    fastpersist_save({"new": torch.ones(2)}, path, engine="python")
    assert path.stat().st_mode & 0o7777 == mode


def test_a_save_over_a_checkpoint_replaces_it_and_lets_the_old_file_go(
    ckpt_dir: Path, small_context: FastPersistContext
) -> None:
    """The replaced checkpoint is held open across the rename, so freeing its blocks (0.19 s per GiB
    on ext4) happens after the save returns; it must not stay held."""
    path = ckpt_dir / "last.ckpt"
    fastpersist_save({"w": torch.zeros(300_000)}, path, context=small_context)
    old = (path.stat().st_dev, path.stat().st_ino)
    fastpersist_save({"w": torch.ones(300_000)}, path, context=small_context)
    assert (path.stat().st_dev, path.stat().st_ino) != old
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(300_000))
    wait_until_released(old)
    assert sorted(os.listdir(ckpt_dir)) == ["last.ckpt"]


def test_a_new_file_follows_the_umask(ckpt_dir: Path) -> None:
    old = os.umask(0o027)
    try:
        fastpersist_save({"new": torch.ones(2)}, ckpt_dir / "new.pt", engine="python")
    finally:
        os.umask(old)
    assert (ckpt_dir / "new.pt").stat().st_mode & 0o777 == 0o640


def test_nested_tensors_and_other_skip_data_refusals_are_saved(
    ckpt_dir: Path, small_context: FastPersistContext
) -> None:
    nested = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)])
    obj = {"nested": nested, "dense": torch.randn(7), "sparse": torch.eye(4).to_sparse()}
    path = ckpt_dir / "nested.pt"
    fastpersist_save(obj, path, context=small_context)
    loaded = torch.load(path, weights_only=False)
    for got, want in zip(loaded["nested"].unbind(), nested.unbind(), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(loaded["sparse"].to_dense(), torch.eye(4))
    again = fastpersist_load(path, weights_only=False, context=small_context)
    assert_same(again["dense"], obj["dense"])
    assert torch.equal(again["nested"].unbind()[1], torch.arange(5.0))
