"""DeepSpeed ZeRO stages 1, 2 and 3 on 2 real processes (CPU, gloo): ``save_checkpoint`` goes through
``FastPersistCheckpointEngine``, every file loads with plain ``torch.load``, ``load_checkpoint`` restores
the weights, and state that every data-parallel rank holds in full is written by one rank only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.dcp_ranks import run

deepspeed = pytest.importorskip("deepspeed")

# DeepSpeed 0.16.4 (the oldest environment) has a race in ZeRO-3's load_checkpoint: a rank's persistent
# (small, unpartitioned) parameters can come back holding uninitialised memory (NaN, 1e10) after the
# all-gather that follows the load. It does not need FastPersist: with DeepSpeed's own torch checkpoint
# engine, an idle 4-thread pool alive in each rank was enough for 6 bad rank reports out of 20; with no
# other thread, 0 of 28. The newest DeepSpeed gave 0 of 12 with the same pool. FastPersist's engine
# keeps a small I/O thread pool, so it exposes the race there too.
_ZERO3_FLAKY = tuple(int(part) for part in deepspeed.__version__.split(".")[:2]) < (0, 17)


@pytest.mark.slow
@pytest.mark.xfail(_ZERO3_FLAKY, reason="DeepSpeed < 0.17: ZeRO-3 load_checkpoint race "
                   "(persistent parameters gathered from uninitialised memory), also without FastPersist", strict=False)
def test_zero_stages_save_through_fastpersist(nvme_root: Path, tmp_path: Path) -> None:
    stages = [1, 2, 3]
    reports = run([{"op": "deepspeed", "stages": stages, "root": str(nvme_root)}], 2, tmp_path, timeout_s=300)
    for index, stage in enumerate(stages):
        by_rank = [report["steps"][index] for report in reports]
        assert all(outcome["perturbed"] and outcome["restored"] for outcome in by_rank), stage
        written = [name for outcome in by_rank for name in outcome["written"]]
        assert len(written) == len(set(written)), f"ZeRO-{stage}: a file written by two ranks: {written}"
        if stage < 3:  # model states are replicated on every rank: rank 0 writes them, once
            assert "step1/mp_rank_00_model_states.pt" in by_rank[0]["written"]
            assert not any("model_states" in name for name in by_rank[1]["written"])
        for rank, outcome in enumerate(by_rank):
            assert any(f"zero_pp_rank_{rank}_" in name and "optim_states" in name for name in outcome["written"])
        for name in written:
            assert isinstance(torch.load(nvme_root / f"zero{stage}" / name, weights_only=False), dict)
