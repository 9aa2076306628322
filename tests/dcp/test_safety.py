"""What the DCP storage layers refuse, with typed errors and at once: saving over a checkpoint with
``overwrite=False`` (the error torch's own writer raises), and checkpoints whose metadata sends a
reader outside the checkpoint, onto a FIFO or a device, or divides by a crc32c block size of 0."""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from dataflux_ckpt import DatafluxStorageReader, DatafluxStorageWriter, parse_gcs_path
from fastpersist import FastPersistStorageReader, FastPersistStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group exists

GS = {"chunk_size": 64 * 1024, "block_size": 4096, "max_workers": 3}
STATE = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(7)}
BLOCK_S = 20.0  # a load still running after this long is blocked (it refuses within milliseconds)


def _failure(err: CheckpointException) -> BaseException:
    """The one rank's error inside DCP's CheckpointException."""
    (failure,) = err.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure


def _writer(storage: str, path: str, **options: Any) -> Any:
    if storage == "gs":
        return DatafluxStorageWriter(path, **GS, **options)
    return FastPersistStorageWriter(path, io_buffer_mb=1, **options)


def _reader(storage: str, path: str) -> Any:
    return DatafluxStorageReader(path) if storage == "gs" else FastPersistStorageReader(path)


def _blob(path: str, name: str) -> Any:
    from google.cloud import storage as gcs

    bucket, key = parse_gcs_path(path)
    return gcs.Client().bucket(bucket).blob(f"{key}/{name}")


def _rewrite_metadata(storage: str, path: str, change: Any) -> None:
    """Replace every item's storage info in the checkpoint's ``.metadata`` by ``change(info)``."""
    data = _blob(path, ".metadata").download_as_bytes() if storage == "gs" else Path(path, ".metadata").read_bytes()
    metadata = pickle.loads(data)
    metadata.storage_data = {index: change(info) for index, info in metadata.storage_data.items()}
    data = pickle.dumps(metadata)
    if storage == "gs":
        _blob(path, ".metadata").upload_from_string(data)
    else:
        Path(path, ".metadata").write_bytes(data)


def _load_error(storage: str, path: str) -> BaseException:
    with pytest.raises(CheckpointException) as caught:
        dcp.load({key: torch.zeros_like(value) for key, value in STATE.items()}, storage_reader=_reader(storage, path))
    return _failure(caught.value)


# Overwrite ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["gs", "nvme"])
def test_overwrite_false_raises_what_torchs_writer_raises(storage: str, gs_root: str, nvme_root: Path) -> None:
    path = f"{gs_root}/ckpt" if storage == "gs" else str(nvme_root)
    dcp.save(STATE, storage_writer=_writer(storage, path))
    with pytest.raises(CheckpointException) as ours:
        dcp.save(STATE, storage_writer=_writer(storage, path, overwrite=False))
    error = _failure(ours.value)
    assert isinstance(error, RuntimeError) and isinstance(error, FileExistsError), repr(error)
    from lightning_storage_plugins.errors import CheckpointExistsError

    assert isinstance(error, CheckpointExistsError) and path in str(error)
    if storage == "nvme":  # the same clause catches torch's own writer's refusal
        with pytest.raises(CheckpointException) as torchs:
            dcp.save(STATE, storage_writer=FileSystemWriter(path, overwrite=False))
        assert isinstance(_failure(torchs.value), RuntimeError)
        assert "Checkpoint already exists" in str(_failure(torchs.value)) and "Checkpoint already exists" in str(error)


# Paths outside the checkpoint -------------------------------------------------------------------------------
def _metadata(storage: str, path: str) -> Any:
    data = _blob(path, ".metadata").download_as_bytes() if storage == "gs" else Path(path, ".metadata").read_bytes()
    return pickle.loads(data)


@pytest.mark.parametrize("storage", ["gs", "nvme"])
@pytest.mark.parametrize("escape", ["parent", "absolute"])
def test_metadata_naming_files_outside_the_checkpoint_is_refused(storage: str, escape: str, gs_root: str,
                                                                  nvme_root: Path) -> None:
    root = gs_root if storage == "gs" else str(nvme_root)
    path, other = f"{root}/victim", f"{root}/other"
    for target in (path, other):  # the same state: the other checkpoint's file has the same layout
        dcp.save(STATE, storage_writer=_writer(storage, target))
    (own,) = {info.relative_path for info in _metadata(storage, path).storage_data.values()}
    (theirs,) = {info.relative_path for info in _metadata(storage, other).storage_data.values()}
    outside = f"../other/{theirs}" if escape == "parent" else f"/{other.split('://')[-1].lstrip('/')}/{theirs}"
    _rewrite_metadata(storage, path, lambda info: dataclasses.replace(info, relative_path=outside))
    if storage == "nvme":  # only the other checkpoint's file is left to read
        Path(path, own).unlink()
    error = _load_error(storage, path)
    assert "not a file name inside the checkpoint" in str(error) and outside in str(error), repr(error)
    from lightning_storage_plugins.errors import CheckpointMetadataError

    assert isinstance(error, CheckpointMetadataError), repr(error)


# Files that are not regular files ---------------------------------------------------------------------------
def _blocked_load(path: str) -> BaseException | None:
    """Load in a thread; the error it ends with, or ``None`` when it was still blocked after
    ``BLOCK_S`` (every FIFO in the checkpoint is then opened for writing and closed, which ends it)."""
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            dcp.load({key: torch.zeros_like(value) for key, value in STATE.items()},
                     storage_reader=FastPersistStorageReader(path))
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            outcome.append(err)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(BLOCK_S)
    if thread.is_alive():
        for fifo in Path(path).iterdir():
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(BLOCK_S)
        return None
    error = outcome[0]
    return _failure(error) if isinstance(error, CheckpointException) else error


@pytest.mark.parametrize("replaced", ["shard", ".metadata"])
@pytest.mark.parametrize("kind", ["fifo", "link to a device"])
def test_fifos_and_devices_in_a_checkpoint_are_refused_at_once(replaced: str, kind: str, nvme_root: Path) -> None:
    dcp.save(STATE, storage_writer=_writer("nvme", str(nvme_root)))
    victim = next(nvme_root.glob("*.distcp")) if replaced == "shard" else nvme_root / ".metadata"
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.symlink_to("/dev/zero")
    error = _blocked_load(str(nvme_root))
    assert error is not None, f"the load blocked on a {kind} in place of {replaced}"
    assert f"{victim} is a {'FIFO' if kind == 'fifo' else 'symbolic link'}, not a regular file" in str(error), \
        repr(error)
    from lightning_storage_plugins.errors import CheckpointMetadataError

    # Newer torch turns any failure to read .metadata into an AssertionError carrying its text.
    assert isinstance(error, CheckpointMetadataError) or (replaced == ".metadata" and isinstance(error, AssertionError))


# Impossible values --------------------------------------------------------------------------------------------
def test_a_crc_block_size_of_zero_is_refused(gs_root: str) -> None:
    from dataflux_ckpt.dcp import GcsItemInfo

    path = f"{gs_root}/crc"
    dcp.save(STATE, storage_writer=_writer("gs", path))
    _rewrite_metadata("gs", path, lambda info: dataclasses.replace(info, block_size=0)
                      if isinstance(info, GcsItemInfo) else info)
    error = _load_error("gs", path)
    assert "block size 0" in str(error), repr(error)
    from lightning_storage_plugins.errors import CheckpointMetadataError

    assert isinstance(error, CheckpointMetadataError), repr(error)
