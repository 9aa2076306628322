"""SIGTERM with a grace period, then SIGKILL, as spot VMs and Kubernetes pods preempt a job.

Lightning turns SIGTERM into ``SIGTERMException`` at the next step boundary, and ``OnExceptionCheckpoint``
saves on it. 20 times per plugin, at random points of a step, a save, an async save and an upload: the
job exits within GCE's 30 s grace with status 0, the save the signal interrupted is finished (not lost,
no deadlock), ``on_exception.ckpt`` is saved, and the restart resumes from it. And a save the grace period
cannot hold (an upload over a throttled link, a 1 s grace) leaves the previous checkpoint whole: the log
shows the save started and never finished, and the restart resumes from the checkpoint before it.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from benchmarks.network import NetworkModel, Toxiproxy
from benchmarks.recovery.events import DEFAULT_GRACE_S, of_process, preempt
from tests.support.recovery import EVENT_PLUGINS, Rounds, Storage, first_part_of, interrupted, points_for
from tests.support.recovery import in_flight as saves_in_flight

pytestmark = [pytest.mark.recovery, pytest.mark.slow]

PREEMPTION_ROUNDS = 20
PLUGINS = EVENT_PLUGINS


@pytest.mark.parametrize("plugin", PLUGINS, ids=[f"{plugin}-sigterm" for plugin in PLUGINS])
def test_sigterm_within_the_grace_period_saves_and_resumes(plugin: str, storage: Storage, fork_server,
                                                            tmp_path: Path) -> None:
    rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=zlib.crc32(plugin.encode()) + 1)
    base = storage.config(rounds.log_path)
    points = points_for(plugin)
    landed_in_save = {point: 0 for point in points}
    for index, point, current in rounds.each_point(base, PREEMPTION_ROUNDS, points):
        if index:  # it resumed from the previous start's on_exception.ckpt
            assert current.started["ckpt_path"].endswith("/on_exception.ckpt"), current.resume.describe()
        injection = preempt(current.job, rounds.follower, grace_s=DEFAULT_GRACE_S, log=rounds.log, point=point,
                            rng=rounds.rng, first_part=first_part_of(storage), skip=rounds.rng.randrange(3))
        current.injection = injection
        if index == PREEMPTION_ROUNDS:
            break
        assert not injection.extra["killed"] and injection.exit_code == 0, (
            f"round {index}: SIGTERM at {point}: exit code {injection.exit_code}, killed after the "
            f"{DEFAULT_GRACE_S:.0f} s grace: {injection.extra['killed']}{current.job.output_tail()}")
        events = [e for e in rounds.follower.events if of_process(current.job.pid)(e)]
        assert any(e["event"] == "signal" and e["name"] == "SIGTERM" for e in events)
        # the saves in flight when the signal came were finished, none failed
        in_flight = saves_in_flight(rounds.follower.events, current.job.pid, injection.time)
        landed_in_save[point] += bool(in_flight)
        finished = {e["path"] for e in events if e["event"] == "save_end" and e["time"] >= injection.time}
        assert all(save["path"] in finished for save in in_flight), (in_flight, finished)
        assert not [e for e in events if e["event"] == "save_error"]
        assert any(e["path"].endswith("/on_exception.ckpt") for e in events if e["event"] == "save_end")
        assert [e["reason"] for e in events if e["event"] == "exit"] == ["SIGTERMException"]
    print(rounds.summary())
    for point in points:
        if point != "step":
            assert landed_in_save[point] >= 1, f"no SIGTERM at {point} landed in a save: {landed_in_save}"


@pytest.mark.parametrize("plugin", ["dataflux"], ids=["dataflux-sigterm-grace-too-short"])
def test_a_save_the_grace_period_cannot_hold_leaves_the_previous_checkpoint(plugin: str, fork_server,
                                                                             gcs_emulator, gcs_bucket: str,
                                                                             tmp_path: Path) -> None:
    # Each connection to the bucket carries 0.5 MB/s: a 2 MiB checkpoint takes about 2 s over 2 parts at a time.
    with Toxiproxy() as proxy:
        slow = proxy.proxy("gcs", gcs_emulator.url, NetworkModel("cloud", mbps=0.5, rtt_ms=0.0))
        storage = Storage(plugin, f"gs://{gcs_bucket}/slow", gcs_url=slow)
        rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=7)
        config = storage.config(rounds.log_path)
        current = rounds.start(config)
        rounds.assert_sound(current)
        # Once last.ckpt is whole, SIGTERM in the middle of the next save, with a grace shorter than a save.
        rounds.follower.wait_for(lambda e: of_process(current.job.pid, "save_end")(e) and e["path"].endswith("/last.ckpt"),
                                 180, "a whole last.ckpt", job=current.job, since=0)
        current.injection = preempt(current.job, rounds.follower, grace_s=1.0, log=rounds.log, point="save",
                                    rng=rounds.rng)
        assert current.injection.extra["killed"], "the job exited within the short grace: the save was not slow"
        unfinished = interrupted(rounds.follower.events, current.injection)
        assert unfinished, "the log shows no save cut off by the end of the grace period"
        inject = rounds.follower.wait_for(lambda e: e["event"] == "inject", 10, "the injection record", since=0)
        assert inject["killed"] is True and inject["action"] == "SIGTERM"
        restarted = rounds.start(config)
        rounds.assert_sound(restarted)
        assert restarted.started["step"] < max(save["step"] for save in unfinished)
        assert restarted.started["ckpt_path"].endswith("/last.ckpt")
        restarted.job.send(9)
        restarted.job.wait(60)
