"""TieredCheckpointIO under real SIGKILLs at random points of the save, the upload and the publish,
with restarts on the same local_dir and on an empty one (see tests/support/tiered_crash.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.tiered_crash import PHASES, crash_rounds

# Each round forks a writer, kills it and checks both tiers (about 2 s a round on a busy 2-core VM).
ROUNDS = int(os.environ.get("TIERED_CRASH_ROUNDS", "30"))


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_a_writer_killed_at_any_point_resumes_at_the_newest_whole_checkpoint_of_the_tier_it_reads(
        phase, gcs_bucket, gcs_proxy, tmp_path):
    crashes = crash_rounds(phase, ROUNDS, bucket=gcs_bucket, proxy=gcs_proxy, work_dir=tmp_path, seed=ROUNDS)
    assert crashes.problems == []
    assert len(crashes.rounds) == ROUNDS
    assert crashes.final_gcs == crashes.final_local > 0  # the last writer's pending upload was finished
    assert sum(round_.new_node for round_ in crashes.rounds) == ROUNDS // 5
    if phase == "save":
        assert any(round_.inside for round_ in crashes.rounds)  # some kills landed inside a local write
