"""Bad input and I/O faults: a clear exception, no temporary file left, the previous checkpoint intact."""

from __future__ import annotations

import errno
import logging
import os
import pickle
import re
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fastpersist import (
    CheckpointFormatError,
    FastPersistContext,
    _deepspeed_compat,
    engines,
    fastpersist_load,
    fastpersist_save,
    get_aio_handle,
    writer,
)
from fastpersist.memory import ALIGNMENT_BYTES, aligned_empty
from fastpersist.writer import TEMP_SUFFIX

PREVIOUS = {"previous": torch.arange(1000)}
TOO_BIG = {"w": torch.zeros(20 * 1024**2 // 4)}  # 20 MiB: more than the tiny filesystems hold


def write_previous(directory: Path) -> Path:
    path = directory / "ckpt.pt"
    torch.save(PREVIOUS, path)
    return path


def assert_previous_intact(path: Path) -> None:
    assert torch.equal(torch.load(path, weights_only=True)["previous"], PREVIOUS["previous"])
    assert not [name for name in os.listdir(path.parent) if name.endswith(TEMP_SUFFIX)], "temporary file left"


def test_missing_directory(ckpt_dir: Path, engine: str, small_context: FastPersistContext) -> None:
    target = ckpt_dir / "missing" / "ckpt.pt"
    with pytest.raises(FileNotFoundError, match="directory does not exist") as caught:
        fastpersist_save(PREVIOUS, target, context=small_context, engine=engine)
    assert caught.value.filename == str(target.parent)
    assert not target.parent.exists()


def test_read_only_directory(ckpt_dir: Path, engine: str, small_context: FastPersistContext) -> None:
    # The suite runs as root, which ignores permission bits; the immutable attribute binds root too.
    path = write_previous(ckpt_dir)
    if subprocess.run(["chattr", "+i", str(ckpt_dir)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is unavailable on this filesystem")
    try:
        with pytest.raises(PermissionError, match=f"cannot create a file in {ckpt_dir}"):
            fastpersist_save({"new": torch.ones(3)}, path, context=small_context, engine=engine)
    finally:
        subprocess.run(["chattr", "-i", str(ckpt_dir)], check=True)
    assert_previous_intact(path)


def test_path_is_a_directory(ckpt_dir: Path, engine: str, small_context: FastPersistContext) -> None:
    (ckpt_dir / "sub.pt").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        fastpersist_save(PREVIOUS, ckpt_dir / "sub.pt", context=small_context, engine=engine)
    assert os.listdir(ckpt_dir) == ["sub.pt"]


@pytest.mark.parametrize("kind", ["a FIFO", "a character device", "a socket"])
def test_load_refuses_fifos_devices_and_sockets_at_once_naming_the_path(
    tmp_path: Path, engine: str, kind: str
) -> None:
    path = tmp_path / "ckpt.pt"
    holder = socket.socket(socket.AF_UNIX)
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a socket":
        holder.bind(str(path))
    else:
        path = Path(os.devnull)
    outcome: list[BaseException | object] = []

    def load() -> None:
        try:
            outcome.append(fastpersist_load(path, engine=engine))
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            outcome.append(err)

    loader = threading.Thread(target=load, daemon=True)
    try:
        loader.start()
        loader.join(timeout=30)  # a deadline for a refusal that takes no I/O at all
        if loader.is_alive() and kind == "a FIFO":
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # releases the blocked open
            loader.join(timeout=30)
            pytest.fail("fastpersist_load blocked on a FIFO")
    finally:
        holder.close()
    assert not loader.is_alive(), f"fastpersist_load did not return on {kind}"
    (error,) = outcome
    assert isinstance(error, CheckpointFormatError), error
    assert error.path == str(path) and f"it is {kind}, not a regular file" in str(error)


@pytest.mark.parametrize("nbytes", [0, 512, ALIGNMENT_BYTES])
def test_buffer_smaller_than_alignment(ckpt_dir: Path, engine: str, nbytes: int) -> None:
    path = write_previous(ckpt_dir)
    with pytest.raises(ValueError, match=f"pinned buffer of {nbytes} bytes is too small"):
        fastpersist_save({"new": torch.ones(3)}, path, pinned_buffer=aligned_empty(nbytes), engine=engine)
    assert_previous_intact(path)


def test_unpicklable_object(ckpt_dir: Path, engine: str, small_context: FastPersistContext) -> None:
    path = write_previous(ckpt_dir)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError), match="local"):
        fastpersist_save({"w": torch.ones(3), "fn": lambda: 0}, path, context=small_context, engine=engine)
    assert_previous_intact(path)


def test_disk_full_is_refused_with_enospc_naming_the_path(
    tiny_ext4: Path, engine: str, small_context: FastPersistContext
) -> None:
    path = write_previous(tiny_ext4)
    with pytest.raises(OSError, match="no space left") as caught:
        fastpersist_save(TOO_BIG, path, context=small_context, engine=engine)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    assert_previous_intact(path)


@pytest.mark.parametrize("filesystem", ["tiny_ext4", "tiny_tmpfs"])
def test_disk_full_while_writing_is_detected(
    filesystem: str,
    engine: str,
    small_context: FastPersistContext,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No block reservation, so the filesystem really fills up under the engine. (Kernels before 6.6
    # refuse O_DIRECT on tmpfs: there this also runs the buffered fallback.)
    monkeypatch.setattr(writer, "_reserve_ahead", lambda file, end: None)
    path = write_previous(request.getfixturevalue(filesystem))
    with pytest.raises(OSError, match=r"write failed at offset \d+ of .*ckpt\.pt") as caught:
        fastpersist_save(TOO_BIG, path, context=small_context, engine=engine)
    assert caught.value.errno == errno.ENOSPC
    assert_previous_intact(path)


def test_filesystem_refusing_o_direct_falls_back_to_buffered_io(
    ckpt_dir: Path,
    engine: str,
    small_context: FastPersistContext,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_open = os.open

    def refuse_o_direct(path: Any, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(engines.os, "open", refuse_o_direct)
    state = {"w": torch.randn(300_001), "b": torch.arange(7)}
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        stats = fastpersist_save(state, ckpt_dir / "buffered.pt", context=small_context, engine=engine)
        loaded = fastpersist_load(ckpt_dir / "buffered.pt", context=small_context, engine=engine)
    assert stats.engine == "python"
    assert [record.levelno for record in caplog.records].count(logging.WARNING) >= 1
    assert stats.bytes == (ckpt_dir / "buffered.pt").stat().st_size  # no alignment padding left
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(
        torch.load(ckpt_dir / "buffered.pt")["b"], state["b"]
    )


def test_python_engine_short_write_names_path_and_offset(
    ckpt_dir: Path, small_context: FastPersistContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault_offset = 512 * 1024  # the second staging half
    real_pwritev = os.pwritev

    def pwritev(fd: int, buffers: Any, offset: int) -> int:
        return 0 if offset == fault_offset else real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(engines.os, "pwritev", pwritev)
    path = write_previous(ckpt_dir)
    with pytest.raises(OSError, match=f"write failed at offset {fault_offset} of .*ckpt.pt.*short write"):
        fastpersist_save({"w": torch.randn(600_000)}, path, context=small_context, engine="python")
    assert_previous_intact(path)


class ShortWriteHandle:
    """A real aio handle that drops the last 4 KiB of the write submitted at one offset."""

    def __init__(self, handle: Any, fault_offset: int) -> None:
        self.handle, self.fault_offset = handle, fault_offset

    def async_pwrite(self, buffer: torch.Tensor, fd: int, offset: int) -> int:
        if offset == self.fault_offset:
            buffer = buffer.narrow(0, 0, buffer.numel() - ALIGNMENT_BYTES)
        return self.handle.async_pwrite(buffer, fd, offset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


def _skip_where_writes_at_offsets_bypass_the_handle(handle: Any) -> None:
    if not _deepspeed_compat.partial_file_transfers(handle):
        pytest.skip("this DeepSpeed's aio handle only gets whole-file writes; writes at an offset go out "
                    "with pwritev (tests/fastpersist/test_engines.py)")


def test_aio_short_write_is_caught_by_byte_count_check(
    ckpt_dir: Path, aio_engine: str, small_context: FastPersistContext
) -> None:
    handle = ShortWriteHandle(get_aio_handle(), fault_offset=512 * 1024)
    _skip_where_writes_at_offsets_bypass_the_handle(handle)
    path = write_previous(ckpt_dir)
    expected = rf"write failed at offset {1024 * 1024 - ALIGNMENT_BYTES} of {re.escape(str(path))} \(temporary .*\): short write"
    with (
        FastPersistContext(io_buffer_mb=1, aio_handle=handle) as context,
        pytest.raises(OSError, match=expected) as caught,
    ):
        fastpersist_save({"w": torch.randn(600_000)}, path, context=context, engine="aio")
    assert caught.value.errno == errno.EIO
    assert_previous_intact(path)


def test_aio_submit_failure_raises(ckpt_dir: Path, aio_engine: str) -> None:
    class FailingHandle(ShortWriteHandle):
        def async_pwrite(self, buffer: torch.Tensor, fd: int, offset: int) -> int:
            return -1

    path = write_previous(ckpt_dir)
    handle = FailingHandle(get_aio_handle(), 0)
    _skip_where_writes_at_offsets_bypass_the_handle(handle)
    with (
        FastPersistContext(io_buffer_mb=1, aio_handle=handle) as context,
        pytest.raises(OSError, match="aio submit returned -1"),
    ):
        fastpersist_save(PREVIOUS, path, context=context, engine="aio")
    assert_previous_intact(path)
