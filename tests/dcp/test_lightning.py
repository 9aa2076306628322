"""Real Lightning Trainer runs on 2 processes (gloo) with FSDP (sharded state dicts) and ModelParallel
(FSDP2) strategies whose checkpoints go through the gs:// and NVMe DCP storage: ModelCheckpoint keeps
the top 2 (the others are deleted whole), and a new Trainer resumes from the best with the same model
and optimizer state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.dcp_ranks import run


def _listing(storage: str, root: str) -> list[str]:
    """The checkpoints (directories / prefixes) under ``root/checkpoints``."""
    if storage == "nvme":
        return sorted(p.name for p in Path(root, "checkpoints").iterdir())
    from google.cloud import storage as gcs

    from dataflux_ckpt import parse_gcs_path

    bucket, key = parse_gcs_path(f"{root}/checkpoints")
    return sorted({blob.name[len(key) + 1 :].split("/")[0] for blob in gcs.Client().list_blobs(bucket, prefix=key + "/")})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_trainer_sharded_checkpoints(kind: str, gs_root: str, nvme_root: Path, tmp_path: Path) -> None:
    if kind == "model_parallel" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7):
        pytest.skip("FSDP2 (fully_shard) cannot train on CPU before torch 2.7 (CPU streams lack record_event)")
    roots = {"gs": f"{gs_root}/{kind}", "nvme": str(nvme_root / kind)}
    steps = [{"op": "lightning", "kind": kind, "storage": storage, "root": root} for storage, root in roots.items()]
    reports = run(steps, 2, tmp_path, timeout_s=240)
    for (storage, root), outcome in zip(roots.items(), reports[0]["steps"], strict=True):
        assert outcome["kept"] == ["global_step=2.ckpt", "global_step=3.ckpt"], storage
        assert _listing(storage, root) == ["global_step=2.ckpt", "global_step=3.ckpt"], storage
        assert outcome["best"] == "global_step=3.ckpt"
        assert (outcome["resumed_at"], outcome["ended_at"]) == (4, 6)
        assert outcome["same_model"] and outcome["same_optimizer"], storage
    assert reports[1]["steps"] == reports[0]["steps"]
