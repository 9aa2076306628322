"""The DCP storage layers in one process: bit-exact round trips of every kind of item, interoperability
with torch's own writers and readers, integrity (crc32c), safety of loading, failed and repeated saves,
bad input, and the memory a gs:// save may take."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)

from dataflux_ckpt import DataCorruptionError, DatafluxStorageReader, DatafluxStorageWriter, parse_gcs_path
from fastpersist import FastPersistContext, FastPersistStorageReader, FastPersistStorageWriter
from lightning_storage_plugins.dcp import load_metadata
from tests.support.gcs import FaultProxy, client_for, ranged_read_ports

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group exists

GS = {"chunk_size": 64 * 1024, "block_size": 4096, "max_workers": 3}
GS_READ = {"chunk_size": 64 * 1024, "max_workers": 3, "coalesce_gap": 1024}


@contextlib.contextmanager
def load_refused(caplog: pytest.LogCaptureFixture, match: str) -> Iterator[None]:
    """``dcp.load`` fails and the caller learns why: in the error torch raises, or, where torch drops a
    storage reader's error for "metadata is None" (2.11), in the reader's warning."""
    with caplog.at_level(logging.WARNING, logger="lightning_storage_plugins.dcp"):
        with pytest.raises(CheckpointException) as failure:
            yield
    said = [str(failure.value)] + [record.getMessage() for record in caplog.records]
    assert any(re.search(match, text) for text in said), said


def sample_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(64, 40, generator=generator)
    return {
        "big": torch.randn(300, 333, generator=generator),
        "bf16": torch.randn(17, 5, generator=generator).to(torch.bfloat16),
        "int64": torch.randint(-(2**62), 2**62, (9,), generator=generator),
        "bool": torch.rand(13, generator=generator) > 0.5,
        "transposed": base.t(),  # not contiguous
        "view": base[3:7],  # a view of a larger storage
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "nested": {"step": 12, "name": "x", "lrs": [0.1, 0.2]},
    }


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        out[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else {"step": 0, "name": "", "lrs": []}
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key].contiguous().reshape(-1).view(torch.uint8),
                               value.contiguous().reshape(-1).view(torch.uint8)), key
        else:
            assert got[key] == value, key


def gs_objects(path: str) -> list[str]:
    from google.cloud import storage

    bucket, key = parse_gcs_path(path)
    return sorted(blob.name[len(key) + 1 :] for blob in storage.Client().list_blobs(bucket, prefix=key + "/"))


# Round trips and interoperability --------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["gs", "nvme"])
def test_round_trip_is_bit_exact(storage: str, gs_root: str, nvme_root: Path) -> None:
    state = sample_state()
    if storage == "gs":
        writer, reader = DatafluxStorageWriter(f"{gs_root}/a", **GS), DatafluxStorageReader(f"{gs_root}/a", **GS_READ)
    else:
        writer, reader = FastPersistStorageWriter(nvme_root, io_buffer_mb=1), FastPersistStorageReader(nvme_root)
    dcp.save(state, storage_writer=writer)
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=reader)
    assert_same(loaded, state)


def test_torch_reads_fastpersist_and_fastpersist_reads_torch(nvme_root: Path) -> None:
    state = sample_state()
    dcp.save(state, storage_writer=FastPersistStorageWriter(nvme_root / "ours", io_buffer_mb=1))
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=FileSystemReader(nvme_root / "ours"))
    assert_same(loaded, state)

    dcp.save(state, storage_writer=FileSystemWriter(nvme_root / "torch"))
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=FastPersistStorageReader(nvme_root / "torch"))
    assert_same(loaded, state)


def test_many_small_tensors_take_no_more_room_than_torchs_writer_gives_them(nvme_root: Path) -> None:
    # Each tensor item is its own archive at its own offset: its bytes are aligned as torch.save
    # aligns them, not padded out to a page.
    state = {f"layer{i}.bias": torch.randn(64) for i in range(500)}
    dcp.save(state, storage_writer=FastPersistStorageWriter(nvme_root / "ours", io_buffer_mb=1))
    dcp.save(state, storage_writer=FileSystemWriter(nvme_root / "torch"))

    def data_bytes(directory: Path) -> int:
        return sum(path.stat().st_size for path in directory.glob("*.distcp"))

    assert data_bytes(nvme_root / "ours") <= data_bytes(nvme_root / "torch")
    loaded = {key: torch.zeros(64) for key in state}
    dcp.load(loaded, storage_reader=FileSystemReader(nvme_root / "ours"))
    assert all(torch.equal(loaded[key], state[key]) for key in state)


@pytest.mark.parametrize("windows", [(64 * 1024, 64 * 1024), (4 * 1024, 256 * 1024)], ids=["even", "growing"])
@pytest.mark.parametrize("context", ["kept by the caller", "tiny staging buffer", "none"])
def test_loads_read_window_after_window_into_two_buffers_and_keep_nothing_of_them(
    nvme_root: Path, monkeypatch: pytest.MonkeyPatch, context: str, windows: tuple[int, int]
) -> None:
    import fastpersist.dcp

    # Many windows from a small checkpoint: all of one size, or doubling from the first to the largest.
    monkeypatch.setattr(fastpersist.dcp, "FIRST_READ_WINDOW_BYTES", windows[0])
    monkeypatch.setattr(fastpersist.dcp, "READ_WINDOW_BYTES", windows[1])
    first, second = sample_state(), {key: value * 2 if isinstance(value, torch.Tensor) and value.dtype != torch.bool
                                     else value for key, value in sample_state().items()}
    dcp.save(first, storage_writer=FastPersistStorageWriter(nvme_root / "first", io_buffer_mb=1))
    dcp.save(second, storage_writer=FastPersistStorageWriter(nvme_root / "second", io_buffer_mb=1))
    kept = FastPersistContext(io_buffer_mb={"kept by the caller": 1, "tiny staging buffer": 0.05}.get(context, 1))
    try:
        reader_context = None if context == "none" else kept
        loaded_first = zeros_like_state(first)
        dcp.load(loaded_first, storage_reader=FastPersistStorageReader(nvme_root / "first", context=reader_context))
        loaded_second = zeros_like_state(second)
        dcp.load(loaded_second, storage_reader=FastPersistStorageReader(nvme_root / "second", context=reader_context))
    finally:
        kept.close()
    assert_same(loaded_first, first)  # nothing of the first load was left in a buffer the second reused
    assert_same(loaded_second, second)


def test_dataflux_reads_fsspec_checkpoints(gs_root: str) -> None:
    try:
        from torch.distributed.checkpoint import FsspecWriter
    except ImportError:  # torch < 2.7 keeps it in a private module
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    state = sample_state()
    dcp.save(state, storage_writer=FsspecWriter(f"{gs_root}/fsspec", sync_files=False))
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=DatafluxStorageReader(f"{gs_root}/fsspec", **GS_READ))
    assert_same(loaded, state)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=6), chunk=st.integers(1024, 40_000),
       block=st.sampled_from([4, 512, 4096, 65536]), gap=st.integers(0, 50_000), workers=st.integers(1, 4))
def test_gs_chunk_block_and_gap_boundaries(gs_root: str, sizes: list[int], chunk: int, block: int, gap: int,
                                           workers: int) -> None:
    """Any tensor sizes with any part size, crc block, coalescing gap and parallelism load bit-exactly."""
    state = {f"t{i}": torch.randint(0, 255, (size,), dtype=torch.uint8) for i, size in enumerate(sizes)}
    path = f"{gs_root}/{uuid.uuid4().hex[:8]}"
    dcp.save(state, storage_writer=DatafluxStorageWriter(path, chunk_size=chunk, block_size=block, max_workers=workers))
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(loaded, storage_reader=DatafluxStorageReader(path, chunk_size=chunk, coalesce_gap=gap, max_workers=workers))
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def test_gs_ranged_reads_hand_their_connections_back(gcs_emulator: Any, gs_root: str) -> None:
    # On GCS a connection per range would cost a TLS handshake per range.
    state = {f"t{i}": torch.randn(50_000) for i in range(4)}  # 800 KB: a dozen 64 KiB ranges
    dcp.save(state, storage_writer=DatafluxStorageWriter(gs_root, **GS))
    loaded = zeros_like_state(state)
    with FaultProxy(gcs_emulator.url) as proxy:
        reader = DatafluxStorageReader(gs_root, storage_client=client_for(proxy.url),
                                       **{**GS_READ, "max_workers": 1})
        dcp.load(loaded, storage_reader=reader)
    assert_same(loaded, state)
    ports = ranged_read_ports(proxy.requests)
    assert len(ports) >= 10
    assert len(set(ports)) == 1, "a ranged read did not reuse the connection"


# Integrity and safety -----------------------------------------------------------------------------------
def _rewrite_object(path: str, name: str, change: Any) -> None:
    from google.cloud import storage

    bucket, key = parse_gcs_path(path)
    blob = storage.Client().bucket(bucket).blob(f"{key}/{name}")
    blob.upload_from_string(change(blob.download_as_bytes()))


def test_gs_load_detects_a_changed_byte(gs_root: str) -> None:
    path = f"{gs_root}/c"
    state = {"w": torch.randn(5000)}
    dcp.save(state, storage_writer=DatafluxStorageWriter(path, **GS))
    shard = next(name for name in gs_objects(path) if name.endswith(".distcp"))
    _rewrite_object(path, shard, lambda data: data[:7000] + bytes([data[7000] ^ 1]) + data[7001:])
    # DCP wraps a rank's error in a CheckpointException (a BaseException) that carries its text.
    with pytest.raises(CheckpointException, match=rf"{DataCorruptionError.__name__}: .*{re.escape(shard)}.*crc32c"):
        dcp.load({"w": torch.zeros(5000)}, storage_reader=DatafluxStorageReader(path, **GS_READ))


def test_gs_load_names_a_missing_shard(gs_root: str) -> None:
    from google.cloud import storage

    path = f"{gs_root}/m"
    dcp.save({"w": torch.randn(10)}, storage_writer=DatafluxStorageWriter(path, **GS))
    bucket, key = parse_gcs_path(path)
    shard = next(name for name in gs_objects(path) if name.endswith(".distcp"))
    storage.Client().bucket(bucket).blob(f"{key}/{shard}").delete()
    with pytest.raises(CheckpointException, match=shard):
        dcp.load({"w": torch.zeros(10)}, storage_reader=DatafluxStorageReader(path, **GS_READ))


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("storage", ["gs", "nvme"])
def test_stored_pickles_never_run_code_unless_asked(storage: str, gs_root: str, nvme_root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    if storage == "gs":
        path: Any = f"{gs_root}/evil"
        writer, reader = DatafluxStorageWriter(path, **GS), lambda **kw: DatafluxStorageReader(path, **GS_READ, **kw)
    else:
        path = nvme_root
        writer, reader = FastPersistStorageWriter(path, io_buffer_mb=1), lambda **kw: FastPersistStorageReader(path, **kw)
    dcp.save({"w": torch.randn(4), "obj": _RunsCode(str(marker))}, storage_writer=writer)
    with pytest.raises(CheckpointException, match=r"UnpicklingError: .*obj.*weights_only"):
        dcp.load({"w": torch.zeros(4), "obj": None}, storage_reader=reader())
    assert not marker.exists()
    dcp.load({"w": torch.zeros(4), "obj": None}, storage_reader=reader(weights_only=False))
    assert marker.exists()  # the caller asked for it


def test_metadata_with_a_foreign_global_is_refused(nvme_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "code-ran"
    dcp.save({"w": torch.randn(4)}, storage_writer=FastPersistStorageWriter(nvme_root, io_buffer_mb=1))
    (nvme_root / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with load_refused(caplog, r"refusing to load global \w+\.open"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=FastPersistStorageReader(nvme_root))
    assert not marker.exists()


def test_torch_metadata_loads_through_the_restricted_unpickler(nvme_root: Path) -> None:
    """Every class torch's own FileSystemWriter puts in ``.metadata`` is one the restricted loader knows
    (fails loudly when a torch release adds one)."""
    state = {**sample_state(), "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)}
    dcp.save(state, storage_writer=FileSystemWriter(nvme_root))
    metadata = load_metadata((nvme_root / ".metadata").read_bytes(), "torch's metadata")
    assert set(metadata.state_dict_metadata) >= {"big", "nested.step", "channels_last"}


def test_torch_dcp_internals_the_storage_layers_use() -> None:
    """The private DCP names the shared module relies on (fails loudly when torch changes them)."""
    import dataclasses

    from torch.distributed.checkpoint import filesystem

    fields = [field.name for field in dataclasses.fields(filesystem._StorageInfo)]
    assert fields[:3] == ["relative_path", "offset", "length"]
    assert all(field.default is None for field in dataclasses.fields(filesystem._StorageInfo)[3:])
    assert getattr(filesystem, "CURRENT_DCP_VERSION", "1.0.0").count(".") == 2


# Failed and repeated saves -------------------------------------------------------------------------------
class _FailingPlanner(DefaultSavePlanner):
    """Fails while the shard is being written, after its first tensor."""

    calls = 0

    def resolve_data(self, write_item: Any) -> Any:
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("injected failure mid-write")
        return super().resolve_data(write_item)


@pytest.mark.parametrize("storage", ["gs", "nvme"])
def test_failed_save_leaves_previous_checkpoint_and_no_leftovers(storage: str, gs_root: str, nvme_root: Path) -> None:
    state = sample_state()
    if storage == "gs":
        path: Any = f"{gs_root}/f"
        make_writer = lambda: DatafluxStorageWriter(path, **GS)  # noqa: E731
        make_reader = lambda: DatafluxStorageReader(path, **GS_READ)  # noqa: E731
        listing = lambda: gs_objects(path)  # noqa: E731
    else:
        path = nvme_root
        make_writer = lambda: FastPersistStorageWriter(path, io_buffer_mb=1)  # noqa: E731
        make_reader = lambda: FastPersistStorageReader(path)  # noqa: E731
        listing = lambda: sorted(os.listdir(path))  # noqa: E731
    dcp.save(state, storage_writer=make_writer())
    before = listing()
    writer = make_writer()
    with pytest.raises(CheckpointException, match="injected failure"):
        dcp.save({k: v * 2 if isinstance(v, torch.Tensor) and v.dtype != torch.bool else v for k, v in state.items()},
                 storage_writer=writer, planner=_FailingPlanner())
    writer.abort()
    assert listing() == before
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=make_reader())
    assert_same(loaded, state)


@pytest.mark.parametrize("storage", ["gs", "nvme"])
def test_saving_again_replaces_the_checkpoint_and_removes_old_files(storage: str, gs_root: str, nvme_root: Path) -> None:
    if storage == "gs":
        path: Any = f"{gs_root}/again"
        writer, reader, listing = (lambda: DatafluxStorageWriter(path, **GS)), DatafluxStorageReader(path, **GS_READ), \
            (lambda: gs_objects(path))
    else:
        path = nvme_root
        writer, reader, listing = (lambda: FastPersistStorageWriter(path, io_buffer_mb=1)), \
            FastPersistStorageReader(path), (lambda: sorted(os.listdir(path)))
    dcp.save({"w": torch.ones(100)}, storage_writer=writer())
    first = listing()
    dcp.save({"w": torch.full((100,), 2.0)}, storage_writer=writer())
    second = listing()
    assert len(second) == 2 and set(first) & set(second) == {".metadata"}
    loaded = {"w": torch.zeros(100)}
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["w"], torch.full((100,), 2.0))
    with pytest.raises(CheckpointException, match=r"CheckpointExistsError: Checkpoint already exists at .*overwrite=False"):
        kind = DatafluxStorageWriter if storage == "gs" else FastPersistStorageWriter
        options = GS if storage == "gs" else {"io_buffer_mb": 1}
        dcp.save({"w": torch.ones(100)}, storage_writer=kind(path, overwrite=False, **options))


# Bad input --------------------------------------------------------------------------------------------
def test_bad_paths_are_refused_with_the_path_named(gs_root: str, nvme_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="/not/a/bucket"):
        DatafluxStorageWriter("/not/a/bucket")
    with pytest.raises(ValueError, match="gs://bkt/x"):
        FastPersistStorageWriter("gs://bkt/x")
    assert DatafluxStorageWriter.validate_checkpoint_id("gs://bkt/x") and not DatafluxStorageReader.validate_checkpoint_id("/x")
    assert FastPersistStorageReader.validate_checkpoint_id("/x") and not FastPersistStorageWriter.validate_checkpoint_id("gs://bkt/x")
    with load_refused(caplog, r"no checkpoint at .*nothing-here"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=DatafluxStorageReader(f"{gs_root}/nothing-here"))
    caplog.clear()
    with load_refused(caplog, r"no checkpoint at .*nothing-here"):
        dcp.load({"w": torch.zeros(1)}, storage_reader=FastPersistStorageReader(nvme_root / "nothing-here"))


def test_a_missing_bucket_is_named_by_saves_and_loads(gs_root: str, caplog: pytest.LogCaptureFixture) -> None:
    root = "gs://no-such-bucket-for-dcp/run"
    with pytest.raises(CheckpointException, match="bucket 'no-such-bucket-for-dcp' of .* does not exist"):
        dcp.save({"w": torch.ones(3)}, storage_writer=DatafluxStorageWriter(root, **GS))
    with load_refused(caplog, "bucket 'no-such-bucket-for-dcp' of .* does not exist"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=DatafluxStorageReader(root, **GS_READ))


# Memory -------------------------------------------------------------------------------------------------
def test_gs_save_memory_is_bounded_by_the_part_buffers(gs_root: str) -> None:
    """A 192 MiB shard with 4 MiB parts on 2 workers adds far less than the shard to resident memory."""
    from benchmarks.report import PeakRSS

    chunk, workers = 4 * 2**20, 2
    state = {f"t{i}": torch.randn(16 * 2**20 // 4 * 4) for i in range(3)}  # 3 x 64 MiB, already resident
    with PeakRSS() as rss:
        dcp.save(state, storage_writer=DatafluxStorageWriter(f"{gs_root}/mem", chunk_size=chunk, max_workers=workers))
    extra_mib = (rss.peak_mb - rss.start_mb) * 1e6 / 2**20
    assert extra_mib < (workers + 1) * chunk / 2**20 + 64, f"{extra_mib:.0f} MiB"


def test_gs_save_uploads_contiguous_cpu_tensors_from_their_own_memory(gs_root: str) -> None:
    """Whole parts of contiguous CPU tensors need no part buffers: the save adds less than two."""
    from benchmarks.report import PeakRSS

    chunk, workers = 16 * 2**20, 4
    state = {f"t{i}": torch.randn(32 * 2**20 // 4) for i in range(3)}  # 3 x 32 MiB, 2 parts each
    with PeakRSS() as rss:
        dcp.save(state, storage_writer=DatafluxStorageWriter(f"{gs_root}/own", chunk_size=chunk, max_workers=workers))
    extra_mib = (rss.peak_mb - rss.start_mb) * 1e6 / 2**20
    assert extra_mib < 2 * chunk / 2**20, f"{extra_mib:.0f} MiB (staging every part would take {workers + 1} x 16 MiB)"
    loaded = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    dcp.load(loaded, storage_reader=DatafluxStorageReader(f"{gs_root}/own"))
    assert all(torch.equal(loaded[name], state[name]) for name in state)


def test_writers_and_readers_pickle_without_their_clients(gs_root: str, nvme_root: Path) -> None:
    """``dcp.async_save`` may hand writers to another process: they pickle, clients stay behind."""
    for obj in (DatafluxStorageWriter(f"{gs_root}/p", **GS), DatafluxStorageReader(f"{gs_root}/p"),
                FastPersistStorageWriter(nvme_root), FastPersistStorageReader(nvme_root)):
        copy = pickle.loads(pickle.dumps(obj))
        assert copy.checkpoint_id == obj.checkpoint_id
