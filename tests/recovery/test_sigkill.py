"""SIGKILL at random points of a step, a save, an async save and an upload, 20 times per plugin: every
restart resumes from the newest checkpoint the event log says is whole (the same step and state), never
from a partial or mixed one, and finds no temporary of a killed start left after its sweep."""

from __future__ import annotations

import signal
import zlib
from pathlib import Path

import pytest

from benchmarks.recovery.events import kill_at
from tests.support.recovery import EVENT_PLUGINS, Rounds, Storage, first_part_of, interrupted, points_for

pytestmark = [pytest.mark.recovery, pytest.mark.slow]

KILL_ROUNDS = 20
PLUGINS = EVENT_PLUGINS


@pytest.mark.parametrize("plugin", PLUGINS, ids=[f"{plugin}-sigkill" for plugin in PLUGINS])
def test_sigkill_anywhere_resumes_from_the_newest_whole_checkpoint(plugin: str, storage: Storage, fork_server,
                                                                   tmp_path: Path) -> None:
    rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=zlib.crc32(plugin.encode()))
    base = storage.config(rounds.log_path)
    points = points_for(plugin)
    in_save = {point: 0 for point in points}
    for index, point, current in rounds.each_point(base, KILL_ROUNDS, points):
        if index == KILL_ROUNDS:  # this start checked the last kill
            current.job.send(signal.SIGKILL)
            current.job.wait(60)
            break
        current.injection = kill_at(current.job, rounds.follower, point, rounds.rng, log=rounds.log,
                                    first_part=first_part_of(storage), skip=rounds.rng.randrange(3))
        assert current.injection.exit_code == -signal.SIGKILL
        in_save[point] += bool(interrupted(rounds.follower.events, current.injection))
    print(rounds.summary())
    # The kills landed where they were meant to: inside saves (background ones too), not only between them.
    for point in points:
        if point != "step":
            assert in_save[point] >= 1, f"no kill at {point} landed inside a save: {in_save}\n{rounds.summary()}"
    assert sum(in_save.values()) >= KILL_ROUNDS // 4, f"too few kills inside saves: {in_save}\n{rounds.summary()}"
    assert max(r.started["step"] for r in rounds.rounds) > 0, rounds.summary()
