"""TieredCheckpointIO under real SIGKILLs at random points of the save, the upload and the publish,
with restarts on the same local_dir and on an empty one (see tests/support/tiered_crash.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.tiered_crash import NEW_NODE_EVERY, PHASES, crash_rounds

# Each round forks a writer, kills it and checks both tiers (about 2 s a round on a busy 2-core VM).
ROUNDS = int(os.environ.get("TIERED_CRASH_ROUNDS", "30"))
# With remote_every=2 half of the saves stay on the node: fewer rounds, the same checks.
ROUNDS_EVERY_2 = int(os.environ.get("TIERED_CRASH_ROUNDS_EVERY_2", "10"))


@pytest.mark.slow
@pytest.mark.parametrize("remote_every", [1, 2], ids=["remote_every=1", "remote_every=2"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_writer_killed_at_any_point_resumes_at_the_newest_whole_checkpoint_of_the_tier_it_reads(
        phase, remote_every, gcs_bucket, gcs_proxy, tmp_path):
    rounds = ROUNDS if remote_every == 1 else ROUNDS_EVERY_2
    crashes = crash_rounds(phase, rounds, bucket=gcs_bucket, proxy=gcs_proxy, work_dir=tmp_path, seed=rounds,
                           remote_every=remote_every)
    assert crashes.problems == []
    assert len(crashes.rounds) == rounds
    assert sum(round_.new_node for round_ in crashes.rounds) == rounds // NEW_NODE_EVERY
    assert crashes.final_local > 0
    # The last writer finished what was left pending: GCS holds the newest checkpoint meant for it.
    assert crashes.final_gcs == crashes.final_owed
    if remote_every == 1:
        assert crashes.final_gcs == crashes.final_local
    if phase == "save":
        assert any(round_.inside for round_ in crashes.rounds)  # some kills landed inside a local write
