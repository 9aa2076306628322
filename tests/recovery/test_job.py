"""The recovery job and its event log: every plugin and baseline the goodput runner compares comes back
after a kill in a save (DCP's own writers, which rewrite a checkpoint in place, after a kill at a step and a
preemption); the log reader's answers; the job's refusals of configurations it cannot run."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.recovery.events import (
    DEFAULT_GRACE_S,
    LogFollower,
    check_resume,
    expected_resume,
    kill_at,
    preempt,
    read_events,
)
from benchmarks.recovery.job import PLUGINS, SHARDED_PLUGINS, EventLog, JobConfig, state_digest
from tests.support.recovery import Rounds, Storage, expect_no_leftovers, first_part_of, interrupted

# -- the job's configuration and its log (no process) ---------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    ({"plugin": "nope"}, "unknown plugin 'nope'"),
    ({"strategy": "fsdp"}, "plugin fastpersist-aio runs on strategy single, not fsdp"),
    ({"plugin": "fastpersist-dcp"}, "plugin fastpersist-dcp runs on strategy fsdp or model_parallel, not single"),
    ({"root": "gs://bucket/run"}, "plugin fastpersist-aio keeps checkpoints in a local directory"),
    ({"plugin": "dataflux"}, "plugin dataflux keeps checkpoints in a gs:// URL, got root '/tmp/run'"),
    ({"every_n_steps": 0}, "every_n_steps must be at least 1"),
    ({"size_mb": 0}, "size_mb (0) must be positive"),
])
def test_the_job_refuses_a_configuration_it_cannot_run(changes: dict, message: str) -> None:
    settings = {"plugin": "fastpersist-aio", "root": "/tmp/run", "event_log": "/tmp/events.jsonl", **changes}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        JobConfig(**settings)


def test_a_config_round_trips_through_json_and_names_its_checkpoint_directory() -> None:
    config = JobConfig(plugin="smartredis", root="redis://run/", event_log="e.jsonl", async_save=True)
    assert JobConfig.from_json(config.to_json()) == config
    assert config.checkpoint_dir == "redis://run/checkpoints"
    assert JobConfig(plugin="torch-local", root="/r", event_log="e", size_mb=64, width=256).layers == 85


def _write_lines(path: str, writer: int, count: int) -> None:
    log = EventLog(path)
    for index in range(count):
        log.emit("step", step=index, writer=writer, padding="x" * (index % 300))
    log.close()


def test_lines_of_several_processes_never_mix(tmp_path: Path) -> None:
    path = str(tmp_path / "events.jsonl")
    processes = [multiprocessing.get_context("fork").Process(target=_write_lines, args=(path, writer, 2000))
                 for writer in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    events = read_events(path)
    assert len(events) == 6000
    for writer in range(3):
        assert [e["step"] for e in events if e["writer"] == writer] == list(range(2000))


@settings(max_examples=50, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12))
def test_a_follower_reads_every_whole_line_whatever_the_writes_were_cut_into(cuts: list[int], tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("log") / "events.jsonl"
    text = "".join(json.dumps({"event": "step", "time": float(i), "pid": 1, "step": i}) + "\n" for i in range(60))
    data = text.encode()
    follower = LogFollower(path)
    seen = []
    with open(path, "wb") as stream:
        for cut in sorted(set(cuts)) + [len(data)]:
            stream.write(data[stream.tell():cut] if cut > stream.tell() else b"")
            stream.flush()
            seen += follower.poll()
    assert [e["step"] for e in seen] == list(range(60))


def _save(path: str, step: int, t: float, pid: int = 1, end: bool = True) -> list[dict]:
    start = {"event": "save_start", "path": path, "step": step, "digest": f"d{step}", "time": t, "pid": pid}
    return [start] + ([{**start, "event": "save_end", "time": t + 0.5}] if end else [])


@settings(max_examples=200, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["last.ckpt", "on_exception.ckpt", "epoch=0-step=2.ckpt"]),
                               st.booleans(), st.booleans()), max_size=20))
def test_the_expected_resume_is_the_newest_finished_last_checkpoint(plan: list[tuple[str, bool, bool]]) -> None:
    """Saves one after another, some cut off by a kill, some removed after: the restart must resume from
    the newest finished save of a ``last`` checkpoint (``last.ckpt``, ``on_exception.ckpt``) still there."""
    events: list[dict] = []
    whole: dict[str, int] = {}
    for step, (name, finished, removed) in enumerate(plan, start=1):
        path = f"/run/checkpoints/{name}"
        events += _save(path, step, float(step), end=finished)
        if finished:
            whole[path] = step
        if removed:
            events.append({"event": "remove", "path": path, "time": step + 0.7, "pid": 1})
            whole.pop(path, None)
    last = {path: step for path, step in whole.items() if not path.endswith("step=2.ckpt")}
    expected = expected_resume(events)
    if not last:
        assert expected is None
    else:
        assert (expected.path, expected.step) == max(last.items(), key=lambda item: item[1])


def test_a_restart_that_resumed_elsewhere_fails_the_check() -> None:
    events = _save("/r/checkpoints/last.ckpt", 2, 1.0) + _save("/r/checkpoints/last.ckpt", 4, 2.0, end=False)
    started = {"event": "train_start", "pid": 2, "time": 5.0, "step": 2, "digest": "d2", "ckpt_path": "x"}
    assert check_resume(events, started).ok
    assert check_resume(events, {**started, "step": 4, "digest": "d4"}).ok  # the save in flight was published
    assert not check_resume(events, {**started, "digest": "mixed"}).ok
    assert not check_resume(events, {**started, "step": 0, "digest": "d0", "ckpt_path": None}).ok
    assert check_resume([], {**started, "step": 0, "ckpt_path": None}).ok
    hpc = events + _save("/r/hpc_ckpt_1.ckpt", 3, 3.0)
    assert not check_resume(hpc, started, slurm=True).ok
    assert check_resume(hpc, {**started, "step": 3, "digest": "d3"}, slurm=True).ok


def _ranked(events: list[dict], rank: int) -> list[dict]:
    return [{**event, "rank": rank} for event in events]


def test_a_sharded_save_one_rank_finished_may_have_been_published_by_a_rank_that_died() -> None:
    """Rank 1 returned from the step-4 save (the coordinator had committed it) and rank 0 died before
    it recorded its end: rank 1 may resume at step 4 with its own shard, at step 2, and nowhere else.
    A step-4 save that no rank finished is allowed as before; one every rank finished is expected."""
    path = "/r/checkpoints/last.ckpt"
    both_at_2 = _ranked(_save(path, 2, 1.0, pid=10), 0) + _ranked(_save(path, 2, 1.0, pid=11), 1)
    events = both_at_2 + _ranked(_save(path, 4, 2.0, pid=10, end=False), 0) + _ranked(_save(path, 4, 2.0, pid=11), 1)
    started = {"event": "train_start", "pid": 21, "rank": 1, "time": 5.0, "step": 2, "digest": "d2", "ckpt_path": path}
    assert check_resume(events, started, ranks=2).ok
    assert check_resume(events, {**started, "step": 4, "digest": "d4"}, ranks=2).ok
    assert not check_resume(events, {**started, "step": 4, "digest": "mixed"}, ranks=2).ok
    unrelated = both_at_2 + _ranked(_save(path, 3, 2.0, pid=10, end=False), 0) + _ranked(_save(path, 4, 2.0, pid=11), 1)
    assert not check_resume(unrelated, {**started, "step": 4, "digest": "d4"}, ranks=2).ok


def test_a_state_digest_sees_one_changed_element() -> None:
    import torch

    state = {"a": torch.zeros(100), "b": torch.ones(3, 3)}
    changed = {"a": torch.zeros(100), "b": torch.ones(3, 3)}
    changed["a"][-1] = 1.0
    assert state_digest(state) == state_digest({k: v.clone() for k, v in state.items()})
    assert state_digest(state) != state_digest(changed)


# -- every plugin of the job, killed in a save and restarted ----------------------------------------

# Lightning's sharded save writes last.ckpt into the same directory each time, and DCP's own writers
# rewrite it in place: FileSystemWriter truncates the shard files, FsspecWriter replaces the objects one
# by one, .metadata last for both. A kill inside their save of last.ckpt may leave the old .metadata over
# a truncated shard (the restart's load fails) or over the new one (a mixed checkpoint); the goodput runner
# reports either. No resume to assert: they run test_the_sharded_baselines_resume_after_a_kill_and_a_preemption.
SHARDED_BASELINES = ["torch-dcp", "torch-dcp-gcsfs"]
KILLED_IN_A_SAVE = [plugin for plugin in PLUGINS if plugin not in SHARDED_BASELINES]


@pytest.mark.recovery
@pytest.mark.slow
@pytest.mark.parametrize("plugin", KILLED_IN_A_SAVE, ids=[f"{plugin}-sigkill-once" for plugin in KILLED_IN_A_SAVE])
def test_every_plugin_of_the_job_resumes_after_a_kill_in_a_save(plugin: str, storage: Storage, fork_server,
                                                                 tmp_path: Path) -> None:
    """The goodput runner's rows, the TorchCheckpointIO baselines included (on a local disk, through gcsfs
    and through fsspec's redis:// filesystem; not DCP's own writers, see ``KILLED_IN_A_SAVE``): killed in a
    save, resumed whole."""
    rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=len(plugin))
    config = storage.config(rounds.log_path, strategy="fsdp" if plugin in SHARDED_PLUGINS else "single")
    for attempt in range(3):
        current = rounds.start(config)
        rounds.assert_resumed(current)
        if attempt == 2:
            break
        pid = current.job.pid
        rounds.follower.wait_for(lambda e, pid=pid: e["event"] == "save_end" and e["path"].endswith("/last.ckpt")
                                 and e["pid"] == pid, 120, "a whole last.ckpt", job=current.job, since=0)
        current.injection = kill_at(current.job, rounds.follower, "save", rounds.rng, log=rounds.log,
                                    first_part=first_part_of(storage))
    current.job.send(9)
    current.job.wait(60)
    assert rounds.rounds[1].started["step"] > 0 and rounds.rounds[2].started["step"] > 0, rounds.summary()
    # each restart resumed right (above); then what killed saves left
    # (TorchCheckpointIO on redis:// has no sweep: the chunks of a killed save stay until their lease runs out.)
    if plugin != "torch-redis":
        expect_no_leftovers(plugin, {r.index: r.leftovers for r in rounds.rounds if r.leftovers})


@pytest.mark.recovery
@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["dataflux-dcp"], ids=["dataflux-dcp-fsdp-ckpt-path-last"])
def test_ckpt_path_last_resumes_a_sharded_checkpoint_on_gcs(plugin: str, storage: Storage, fork_server,
                                                            tmp_path: Path) -> None:
    """A sharded checkpoint on gs:// is an object prefix, which gcsfs gives no modification time: Lightning's
    choice of the last checkpoint must still find it (the job resumes with ``ckpt_path="last"``)."""
    rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=1)
    config = storage.config(rounds.log_path, strategy="fsdp")
    first = rounds.start(config)
    rounds.follower.wait_for(lambda e: e["event"] == "save_end" and e["path"].endswith("/last.ckpt"), 120,
                             "a whole last.ckpt", job=first.job, since=0)
    first.job.send(9)
    first.job.wait(60)
    second = rounds.start(config)
    second.job.send(9)
    second.job.wait(60)
    rounds.assert_resumed(second)
    assert second.started["step"] > 0 and "/last.ckpt" in second.started["ckpt_path"]


@pytest.mark.recovery
@pytest.mark.slow
@pytest.mark.parametrize("plugin", SHARDED_BASELINES,
                         ids=[f"{plugin}-sigkill-then-sigterm" for plugin in SHARDED_BASELINES])
def test_the_sharded_baselines_resume_after_a_kill_and_a_preemption(plugin: str, storage: Storage, fork_server,
                                                                   tmp_path: Path) -> None:
    """DCP's own writers, the DCP rows' baselines (``FileSystemWriter`` on the local disk, ``FsspecWriter``
    through gcsfs, whose checkpoints Lightning cannot date, object prefixes: the job resumes from the newest
    one whose ``.metadata`` is there): ``last.ckpt`` after a SIGKILL at a step, then the preemption's
    ``on_exception.ckpt``, each whole."""
    rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=7)
    config = storage.config(rounds.log_path, strategy="fsdp")
    first = rounds.start(config)
    rounds.follower.wait_for(lambda e: e["event"] == "save_end" and e["path"].endswith("/last.ckpt")
                             and e["pid"] == first.job.pid, 120, "a whole last.ckpt", job=first.job, since=0)
    first.injection = kill_at(first.job, rounds.follower, "step", rounds.rng, log=rounds.log)
    second = rounds.start(config)
    rounds.assert_resumed(second)
    assert second.started["step"] > 0 and second.started["ckpt_path"].endswith("/last.ckpt"), rounds.summary()
    second.injection = preempt(second.job, rounds.follower, grace_s=DEFAULT_GRACE_S, log=rounds.log)
    assert second.injection.exit_code == 0 and not second.injection.extra["killed"], rounds.summary()
    third = rounds.start(config)
    rounds.assert_resumed(third)
    assert third.started["ckpt_path"].endswith("/on_exception.ckpt"), rounds.summary()
    third.job.send(9)
    third.job.wait(60)


def test_interrupted_saves_are_those_without_an_end() -> None:
    from benchmarks.recovery.events import Injection

    events = _save("/a", 2, 1.0) + _save("/b", 2, 2.0, end=False) + _save("/c", 2, 3.0, pid=2, end=False)
    assert [e["path"] for e in interrupted(events, Injection("SIGKILL", 1, "save", None, 0.0, 9.0))] == ["/b"]


def test_a_sharded_checkpoint_is_whole_only_when_every_rank_finished_its_save() -> None:
    def ranked(events: list[dict], rank: int) -> list[dict]:
        return [{**e, "rank": rank, "pid": 10 + rank} for e in events]

    both = ranked(_save("/r/checkpoints/last.ckpt", 2, 1.0), 0) + ranked(_save("/r/checkpoints/last.ckpt", 2, 1.1), 1)
    # rank 1 died; rank 0's part of the on-exception save returned, but that checkpoint is not whole
    alone = ranked(_save("/r/checkpoints/on_exception.ckpt", 4, 2.0), 0)
    assert expected_resume(both + alone, ranks=2).path == "/r/checkpoints/last.ckpt"
    assert expected_resume(both + alone, ranks=2, rank=1).step == 2
    assert expected_resume(both + alone).path == "/r/checkpoints/on_exception.ckpt"  # one rank's view
