"""Removing a sharded checkpoint reached through a link removes the link, never its target: a real
Lightning run with ``ModelCheckpoint(save_last="link")`` and a last name that changes every step (so
that each step removes the previous ``last`` link) keeps exactly what Lightning's own strategy keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.dcp_ranks import run


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_rotating_last_links_keeps_the_checkpoints_they_point_to(kind: str, nvme_root: Path, tmp_path: Path) -> None:
    if kind == "model_parallel" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7):
        pytest.skip("FSDP2 (fully_shard) cannot train on CPU before torch 2.7 (CPU streams lack record_event)")
    steps = [{"op": "lightning_links", "kind": kind, "storage": storage, "root": str(nvme_root)}
             for storage in ("stock", "nvme")]
    stock, ours = run(steps, 1, tmp_path, timeout_s=240)[0]["steps"]
    assert stock["checkpoints"] == {
        "global_step=2.ckpt": {"whole": True},
        "global_step=3.ckpt": {"whole": True},
        "last-step=4.ckpt": {"link": "global_step=3.ckpt"},
    }
    assert ours["checkpoints"] == stock["checkpoints"]
