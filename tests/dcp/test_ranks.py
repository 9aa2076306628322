"""Sharded checkpoints across real processes (gloo, a timeout on every collective): DTensor state dicts
saved on 4, 2 and 1 ranks load bit-exactly on 2, 1 and 2 (gs:// and NVMe, sync and async saves), and a
rank SIGKILLed mid-save leaves the previous checkpoint loadable and nothing of the new one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dcp_ranks import Ranks, load_whole, run

STORAGES = ("gs", "nvme")


def _steps(op: str, roots: dict[str, str], name: str, seed: int) -> list[dict[str, object]]:
    return [{"op": op, "storage": storage, "path": f"{roots[storage]}/{name}", "seed": seed} for storage in STORAGES]


@pytest.mark.slow
def test_reshard_4_to_2_to_1_to_2(gs_root: str, nvme_root: Path, tmp_path: Path) -> None:
    roots = {"gs": gs_root, "nvme": str(nvme_root)}
    run(_steps("save", roots, "four", 4), 4, tmp_path)
    reports = run(_steps("load", roots, "four", 4) + _steps("async_save", roots, "two", 2), 2, tmp_path)
    assert [step.get("mismatches") for r in reports for step in r["steps"][:2]] == [[]] * 4
    reports = run(_steps("load", roots, "two", 2) + _steps("save", roots, "one", 1), 1, tmp_path)
    assert [step.get("mismatches") for step in reports[0]["steps"][:2]] == [[]] * 2
    reports = run(_steps("load", roots, "one", 1), 2, tmp_path)
    assert [step.get("mismatches") for r in reports for step in r["steps"]] == [[]] * 4


def _remaining(storage: str, path: str) -> list[str]:
    if storage == "nvme":
        # With what a save puts beside the checkpoint: its save lock, and the directory its ranks write
        # in until it commits (.<name>.<token>.dcp-save).
        checkpoint = Path(path)
        tops = [top for top in (checkpoint, *checkpoint.parent.glob(f".{checkpoint.name}.*")) if top.exists()]
        found = [*tops, *(inner for top in tops if top.is_dir() for inner in top.rglob("*"))]
        return sorted(str(p.relative_to(checkpoint.parent)) for p in found)
    from google.cloud import storage as gcs

    from dataflux_ckpt import parse_gcs_path

    bucket, key = parse_gcs_path(path)
    # with the commit record, an object at the checkpoint's own name
    return [blob.name for blob in gcs.Client().list_blobs(bucket, prefix=key)
            if blob.name == key or blob.name.startswith(key + "/")]


@pytest.mark.slow
@pytest.mark.parametrize("storage", STORAGES)
def test_rank_killed_mid_save(storage: str, gs_root: str, nvme_root: Path, tmp_path: Path) -> None:
    from dataflux_ckpt import DatafluxStorageReader
    from fastpersist import FastPersistStorageReader

    root = gs_root if storage == "gs" else str(nvme_root)
    good, failed = f"{root}/step-100", f"{root}/step-200"
    marker = tmp_path / "victim-stalled"
    steps = [{"op": "save", "storage": storage, "path": good, "seed": 100},
             {"op": "save_killed", "storage": storage, "path": failed, "seed": 200, "victim": 1,
              "marker": str(marker)}]
    with Ranks(steps, 2, tmp_path, timeout_s=90) as ranks:
        ranks.wait_for(marker)
        # the victim is mid-save: it has written something (not only the save lock)
        assert any("/" in name for name in _remaining(storage, failed))
        ranks.kill(1)
        survivor = ranks.join()[0]
    assert survivor is not None
    outcome = survivor["steps"][-1]
    assert outcome["error"] is not None and outcome["seconds"] < 30  # failed promptly, no hang
    assert _remaining(storage, failed) == []  # no .metadata, no shard, no part, no temporary
    reader = DatafluxStorageReader(good) if storage == "gs" else FastPersistStorageReader(good)
    assert load_whole(reader, 100) == []
