"""Tiered DCP checkpoints under real SIGKILLs of a two-rank job at random points of its local writes,
its uploads and its publishes, with restarts on the same local_dir and on an empty one (see
tests/support/dcp_tiered_crash.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.dcp_tiered_crash import NEW_NODE_EVERY, PHASES, crash_rounds
from tests.support.gcs import FaultProxy

# Each round starts two ranks, kills them and checks both tiers (45-65 s a round on a busy 2-core VM).
ROUNDS = int(os.environ.get("TIERED_DCP_CRASH_ROUNDS", "3"))
# With remote_every=2 every other save stays on the node while the one before it uploads; the kills
# that can lose such an upload land in the upload and the publish.
EVERY_2_PHASES = ("upload", "publish")


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "remote_every"), [*((phase, 1) for phase in PHASES),
                                                     *((phase, 2) for phase in EVERY_2_PHASES)],
                         ids=lambda value: value if isinstance(value, str) else f"remote_every={value}")
def test_a_job_killed_at_any_point_resumes_at_the_newest_whole_checkpoint_of_the_tier_it_reads(
        phase: str, remote_every: int, gs_root: str, gcs_proxy: FaultProxy, local_root: Path) -> None:
    crashes = crash_rounds(phase, ROUNDS, root=gs_root, proxy=gcs_proxy, work_dir=local_root, seed=ROUNDS,
                           remote_every=remote_every)
    print(f"{phase}: {len(crashes.rounds)} rounds, "
          f"{', '.join(f'{r.seconds:.1f}' for r in crashes.rounds)} s; final {crashes.final_seconds:.1f} s; "
          f"resumed {[r.resumed for r in crashes.rounds]}, local {[r.local for r in crashes.rounds]}, "
          f"GCS {[r.gcs for r in crashes.rounds]}, final {crashes.final_local} / {crashes.final_gcs}")
    assert crashes.problems == []
    assert len(crashes.rounds) == ROUNDS and all(round_.fired for round_ in crashes.rounds)
    assert crashes.final_local > 0
    assert crashes.final_gcs == crashes.final_owed  # the last job's pending uploads were finished
    if remote_every == 1:
        assert crashes.final_gcs == crashes.final_local
    assert sum(round_.new_node for round_ in crashes.rounds) == ROUNDS // NEW_NODE_EVERY
