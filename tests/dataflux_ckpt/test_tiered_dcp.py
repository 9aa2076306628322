"""DCP saves with ``local_dir`` in one process, on fake-gcs-server (behind a fault proxy where GCS must
fail) and real local files: a save returns once the local tier holds it and is published in GCS
later, through a GCS outage (logged, retried); a shard that does not fit is refused before anything is
written; the local tier keeps the newest ``keep_local`` saves; removal removes both copies; and
what GCS's plain reader loads is every tensor bit for bit, with every crc32c block checked, whatever
the items' sizes and the crc block size (hypothesis)."""

from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflux_ckpt import (
    DatafluxStorageReader,
    DatafluxStorageWriter,
    LocalTierFullError,
    ShardedLocalTier,
    TransferOptions,
)
from tests.support.direct_io import o_direct_dir
from tests.support.gcs import FAST_RETRY, FaultProxy

OPTIONS = TransferOptions(chunk_size=64 * 1024, max_workers=2, block_size=4096, upload_mode="composite",
                          retry=FAST_RETRY, deadline_s=60.0)


@pytest.fixture
def nvme(tmp_path: Path) -> Path:
    return o_direct_dir(tmp_path)


def _state(seed: int, rows: int = 300) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 64, generator=generator), "step": seed,
            "ids": torch.arange(seed, seed + 17, dtype=torch.int64)}


def _load(path: str, local_dir: Any = None, client: Any = None) -> tuple[dict[str, Any], DatafluxStorageReader]:
    reader = DatafluxStorageReader(path, options=OPTIONS, local_dir=local_dir, storage_client=client)
    state = {"w": torch.zeros(300, 64), "step": 0, "ids": torch.zeros(17, dtype=torch.int64)}
    dcp.load(state, storage_reader=reader)
    return state, reader


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["ids"], b["ids"])


def _names(bucket: str, prefix: str) -> list[str]:
    from google.cloud import storage

    return sorted(blob.name[len(prefix) + 1 :] for blob in storage.Client().list_blobs(bucket, prefix=prefix + "/"))


def test_a_save_waits_for_the_local_tier_only_and_an_outage_delays_its_publish(
        gcs_bucket: str, gcs_proxy: FaultProxy, nvme: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = f"gs://{gcs_bucket}/run/step-1"
    outage = threading.Event()
    outage.set()
    gcs_proxy.fault = lambda request, seen: 503 if outage.is_set() else None
    caplog.set_level(logging.INFO, logger="dataflux_ckpt.tiered_dcp")
    with ShardedLocalTier(nvme / "tier", options=OPTIONS, storage_client=gcs_proxy.client(),
                          io_buffer_mb=1) as tier:
        dcp.save(_state(1), storage_writer=DatafluxStorageWriter(path, options=OPTIONS, local_dir=tier,
                                                                 storage_client=gcs_proxy.client()))
        assert tier.stats().saves == 1 and tier.stats().uploads_pending == 2  # the shard, the metadata
        assert _names(gcs_bucket, "run/step-1") == []
        # Training goes on: the node loads the save, newer than anything in GCS...
        loaded, reader = _load(path, tier, gcs_proxy.client())
        assert _same(loaded, _state(1)) and (reader.chosen_tier, reader.files_read_locally) == ("local", 1)
        # ... and a new node finds none.
        assert not DatafluxStorageReader(path, options=OPTIONS, local_dir=nvme / "new-node").exists()
        assert not tier.wait(0.5)
        assert "Training goes on" in caplog.text and "not durable until it is published" in caplog.text
        outage.clear()
        assert tier.wait(60)
        stats = tier.stats()
        assert (stats.uploads_pending, stats.uploads_done, stats.last_durable) == (0, 1, path)
        assert stats.upload_failures >= 1
    assert f"{path} (save " in caplog.text and "is durable in GCS" in caplog.text
    loaded, reader = _load(path, nvme / "new-node")
    assert _same(loaded, _state(1)) and (reader.chosen_tier, reader.files_read_from_gcs) == ("gcs", 1)
    assert _same(_load(path)[0], _state(1))  # GCS's checkpoint needs no local tier to load
    names = _names(gcs_bucket, "run/step-1")
    assert names[0] == ".metadata" and len(names) == 2 and names[1].endswith(".distcp")


def test_a_shard_that_does_not_fit_is_refused_before_anything_is_written(gcs_bucket: str, nvme: Path) -> None:
    tier = ShardedLocalTier(nvme / "tier", options=OPTIONS, min_free_bytes=2**62, io_buffer_mb=1)
    with pytest.raises(dcp.CheckpointException) as caught:
        dcp.save(_state(1), storage_writer=DatafluxStorageWriter(f"gs://{gcs_bucket}/run/x", options=OPTIONS,
                                                                 local_dir=tier))
    failure = next(iter(caught.value.failures.values()))
    failure = failure[0] if isinstance(failure, tuple) else failure  # (error, its traceback) where torch wraps it
    assert isinstance(failure, LocalTierFullError) and failure.errno == errno.ENOSPC
    assert str(nvme / "tier") in str(failure) and "nothing was written" in str(failure)
    assert not [p for p in (nvme / "tier").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    tier.close()
    assert _names(gcs_bucket, "run/x") == []


def test_the_local_tier_keeps_the_newest_saves_and_removal_removes_both_copies(gcs_bucket: str, nvme: Path) -> None:
    with ShardedLocalTier(nvme / "tier", options=OPTIONS, keep_local=2, io_buffer_mb=1) as tier:
        paths = [f"gs://{gcs_bucket}/run/step-{step}" for step in range(1, 5)]
        for step, path in enumerate(paths, 1):
            dcp.save(_state(step), storage_writer=DatafluxStorageWriter(path, options=OPTIONS, local_dir=tier))
            assert tier.wait(60)
        kept = {path: _load(path, tier)[1].chosen_tier for path in paths}
        assert kept == dict(zip(paths, ["gcs", "gcs", "local", "local"], strict=True))
        assert all(_same(_load(path, tier)[0], _state(step)) for step, path in enumerate(paths, 1))
        DatafluxStorageWriter(paths[-1], options=OPTIONS, local_dir=tier).remove()
        assert _names(gcs_bucket, "run/step-4") == []
        assert not DatafluxStorageReader(paths[-1], options=OPTIONS, local_dir=tier).exists()
        assert DatafluxStorageReader(paths[-2], options=OPTIONS, local_dir=tier).exists()
    assert len(list((nvme / "tier").glob("dcp-*"))) == 1  # step-3's; step-4's directory went with it


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4), block=st.sampled_from([512, 4096, 7 * 1024]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_gcs_loads_every_item_bit_for_bit_with_every_block_checked(
        gcs_bucket: str, nvme: Path, sizes: list[int], block: int, dtype: torch.dtype) -> None:
    import uuid

    generator = torch.Generator().manual_seed(len(sizes) * 31 + sum(sizes))
    state = {f"t{i}": torch.randn(size, generator=generator).to(dtype) for i, size in enumerate(sizes)}
    state["extra"] = f"sizes {sizes}"  # a pickled item
    path = f"gs://{gcs_bucket}/prop/{uuid.uuid4().hex[:8]}"
    options = OPTIONS.replace(block_size=block)
    with ShardedLocalTier(nvme / "tier", options=options, io_buffer_mb=1, keep_local=1) as tier:
        dcp.save(state, storage_writer=DatafluxStorageWriter(path, options=options, local_dir=tier))
        assert tier.wait(60)
    loaded = {key: torch.zeros_like(value) for key, value in state.items() if isinstance(value, torch.Tensor)}
    loaded["extra"] = ""
    dcp.load(loaded, storage_reader=DatafluxStorageReader(path, options=options))
    assert loaded["extra"] == f"sizes {sizes}"
    assert all(torch.equal(loaded[key], value) for key, value in state.items() if isinstance(value, torch.Tensor))
