"""Sharded checkpoints across real processes (gloo): every world size loads what any other saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dcp_ranks import run


@pytest.mark.slow
def test_gs_reshard_4_2_1_2(gs_root: str, tmp_path: Path) -> None:
    four, two, one = f"{gs_root}/four", f"{gs_root}/two", f"{gs_root}/one"
    run([{"op": "save", "storage": "gs", "path": four, "seed": 4}], 4, tmp_path)
    reports = run([{"op": "load", "storage": "gs", "path": four, "seed": 4},
                   {"op": "async_save", "storage": "gs", "path": two, "seed": 2}], 2, tmp_path)
    assert [r["steps"][0]["mismatches"] for r in reports] == [[], []]
    reports = run([{"op": "load", "storage": "gs", "path": two, "seed": 2},
                   {"op": "save", "storage": "gs", "path": one, "seed": 1}], 1, tmp_path)
    assert reports[0]["steps"][0]["mismatches"] == []
    reports = run([{"op": "load", "storage": "gs", "path": one, "seed": 1}], 2, tmp_path)
    assert [r["steps"][0]["mismatches"] for r in reports] == [[], []]


@pytest.mark.slow
def test_gs_rank_killed_mid_save(gs_root: str, tmp_path: Path) -> None:
    from google.cloud import storage

    from dataflux_ckpt import DatafluxStorageReader
    from dataflux_ckpt.paths import parse_gcs_path
    from tests.support.dcp_ranks import Ranks, load_whole

    good, failed = f"{gs_root}/step-100", f"{gs_root}/step-200"
    marker = tmp_path / "victim-stalled"
    steps = [{"op": "save", "storage": "gs", "path": good, "seed": 100},
             {"op": "save_killed", "storage": "gs", "path": failed, "seed": 200, "victim": 1,
              "marker": str(marker)}]
    with Ranks(steps, 2, tmp_path, timeout_s=90) as ranks:
        ranks.wait_for(marker)
        ranks.kill(1)
        survivor = ranks.join()[0]
    assert survivor is not None and survivor["steps"][-1]["error"] is not None
    assert survivor["steps"][-1]["seconds"] < 30

    bucket, key = parse_gcs_path(failed)
    assert [blob.name for blob in storage.Client().list_blobs(bucket, prefix=key)] == []
    assert load_whole(DatafluxStorageReader(good), 100) == []
