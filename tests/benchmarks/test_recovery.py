"""`python -m benchmarks.recovery`: goodput under kills and preemptions.

The accounting is checked on event logs made to measure (hypothesis: every category adds up to the
wall time, and each one holds what the timeline put in it), and on the logs of a real run on tiny
arguments: the runner runs, its JSON has the fields, its chart and tables exist, and its numbers
come from the event logs it kept.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.recovery import goodput
from benchmarks.recovery.accounting import (
    BADPUT_TYPES,
    CHECKPOINT_RESTORE,
    CHECKPOINT_SAVE,
    GOODPUT,
    INFRASTRUCTURE_RECOVERY,
    OTHER,
    PROGRAM_STARTUP,
    TRAINING_PREP,
    WASTED_PROGRESS,
    account,
)
from benchmarks.recovery.events import read_events

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# What Lightning, DeepSpeed and the plugins would print on the console if the runner let them.
NOISE = ("INFO", "Setting accelerator", "LeafSpec", "GPU available", "weights_only", "litlogger", "Traceback")


# The accounting, on timelines made to measure ------------------------------------------------------
class Timeline:
    """A run's event log written as the job and the runner write it, with what each category must hold."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.t = 1_000.0
        self.expected = dict.fromkeys((GOODPUT, *BADPUT_TYPES), 0.0)

    def emit(self, event: str, pid: int, **fields) -> None:
        self.events.append({"event": event, "time": self.t, "pid": pid, "rank": 0, **fields})

    def spend(self, seconds: float, category: str) -> None:
        self.t += seconds
        self.expected[category] += seconds


@st.composite
def timelines(draw):
    """Starts of a job that checkpoints every ``every`` steps, each stopped by a SIGKILL (between steps or
    inside a save) or its own exit; every step takes the same time, so none counts as start-up."""
    every = draw(st.integers(1, 4))
    step_s = draw(st.floats(0.01, 1.0))
    seconds = st.floats(0.0, 2.0)
    line = Timeline()
    whole = 0  # the step of the newest whole checkpoint
    attempts = draw(st.integers(1, 5))
    made: list[tuple[int, int]] = []  # per start: (resumed step, last step)
    for index in range(attempts):
        pid = 100 + index
        launched = line.t
        if index:
            line.spend(draw(seconds), INFRASTRUCTURE_RECOVERY)
            launched = line.t
        line.events.append({"event": "launch", "source": "injector", "target": pid, "time": launched})
        line.spend(draw(seconds), PROGRAM_STARTUP)
        line.emit("start", pid, attempt=index)
        line.spend(draw(seconds), PROGRAM_STARTUP)
        resumed = whole
        if whole:
            line.emit("load_start", pid, path="last.ckpt")
            line.spend(draw(seconds), CHECKPOINT_RESTORE)
            line.emit("load_end", pid, path="last.ckpt", step=whole)
            line.spend(draw(seconds), TRAINING_PREP)
        line.emit("train_start", pid, step=resumed)
        last = index == attempts - 1
        steps = draw(st.integers(0, 9))
        ending = "exit" if last else draw(st.sampled_from(["kill", "kill-in-save", "exit"]))
        step = resumed
        redone: list[float] = []
        for number in range(steps):
            line.t += step_s
            step += 1
            redone.append(step_s)
            line.events.append({"event": "step", "time": line.t, "pid": pid, "rank": 0, "step": step})
            if step % every == 0:
                line.emit("save_start", pid, path="last.ckpt", step=step, blocking=True)
                save_s = draw(seconds)
                if ending == "kill-in-save" and number == steps - 1:
                    line.spend(save_s, CHECKPOINT_SAVE)
                    break
                line.spend(save_s, CHECKPOINT_SAVE)
                line.emit("save_end", pid, path="last.ckpt", step=step, seconds=save_s)
                whole = step
        made.append((resumed, step, len(redone)))
        in_save = ending == "kill-in-save" and bool(steps) and step % every == 0
        tail = 0.0 if in_save else draw(seconds)  # a kill inside a save ends it: no time after it
        if ending == "exit":
            line.spend(tail, OTHER)
            line.emit("exit", pid, reason="completed" if last else "SIGTERMException")
        else:
            line.spend(tail, WASTED_PROGRESS)
            line.events.append({"event": "inject", "source": "injector", "action": "SIGKILL", "target": pid,
                                "time": line.t + 0.5, "sent": line.t})
    # Steps past the checkpoint the next start resumed from were done again: wasted; the rest are goodput.
    for index, (resumed, _, count) in enumerate(made):
        later = made[index + 1][0] if index + 1 < len(made) else math.inf
        kept = sum(1 for s in range(resumed + 1, resumed + count + 1) if s <= later)
        line.expected[GOODPUT] += kept * step_s
        line.expected[WASTED_PROGRESS] += (count - kept) * step_s
    return line, made


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timelines())
def test_goodput_and_every_badput_category_add_up_to_the_wall_time(made):
    line, starts = made
    result = account(line.events)
    assert result.total_s == pytest.approx(line.t - line.events[0]["time"], abs=1e-9)
    assert sum(result.fractions.values()) == pytest.approx(1.0, abs=1e-9) if result.total_s else True
    for name, seconds in line.expected.items():
        assert result.seconds[name] == pytest.approx(seconds, abs=1e-6), name
    assert all(value >= 0 for value in result.seconds.values())
    assert len(result.attempts) == len(starts) and len(result.restarts) == len(starts) - 1
    for restart, (previous, current) in zip(result.restarts, zip(starts, starts[1:], strict=False), strict=True):
        assert restart.resumed_step == current[0]
        assert restart.lost_steps == previous[1] - current[0]
    assert result.steps_done == starts[-1][1]


def test_a_first_step_beyond_the_ideal_step_is_start_up():
    events = [{"event": "launch", "source": "injector", "target": 1, "time": 0.0},
              {"event": "start", "time": 1.0, "pid": 1},
              {"event": "train_start", "time": 2.0, "pid": 1, "step": 0}]
    events += [{"event": "step", "time": t, "pid": 1, "step": n} for n, t in enumerate([5.0, 6.0, 7.0, 8.0], 1)]
    events.append({"event": "exit", "time": 8.5, "pid": 1, "reason": "completed"})
    result = account(events)
    assert result.ideal_step_s == pytest.approx(1.0)
    # 2 s of start-up, then a first step of 3 s (1 s a step, 2 s more); three steps of 1 s; 0.5 s of exit.
    assert result.seconds[PROGRAM_STARTUP] == pytest.approx(4.0)
    assert result.seconds[GOODPUT] == pytest.approx(4.0)
    assert result.seconds[OTHER] == pytest.approx(0.5)
    assert result.goodput == pytest.approx(4.0 / 8.5)


def test_a_preemption_the_grace_period_cannot_hold_ends_when_it_is_killed():
    events = [{"event": "start", "time": 0.0, "pid": 1}, {"event": "train_start", "time": 1.0, "pid": 1, "step": 0},
              {"event": "step", "time": 2.0, "pid": 1, "step": 1},
              {"event": "save_start", "time": 2.0, "pid": 1, "path": "on_exception.ckpt", "step": 1},
              {"event": "inject", "source": "injector", "action": "SIGTERM", "target": 1, "killed": True,
               "time": 9.0},
              {"event": "start", "time": 9.5, "pid": 2}, {"event": "train_start", "time": 10.0, "pid": 2, "step": 0},
              {"event": "exit", "time": 10.0, "pid": 2, "reason": "completed"}]
    result = account(events)
    assert result.attempts[0].ended_by == "SIGKILL" and result.attempts[0].end == 9.0
    assert result.seconds[CHECKPOINT_SAVE] == pytest.approx(7.0)
    assert result.seconds[WASTED_PROGRESS] == pytest.approx(1.0)  # the step the restart did not keep


def test_what_a_start_does_after_its_training_is_no_part_of_the_run():
    events = [{"event": "start", "time": 0.0, "pid": 1}, {"event": "train_start", "time": 1.0, "pid": 1, "step": 0},
              {"event": "step", "time": 2.0, "pid": 1, "step": 1},
              {"event": "save_start", "time": 2.0, "pid": 1, "path": "last.ckpt", "step": 1},
              {"event": "save_end", "time": 2.5, "pid": 1, "path": "last.ckpt", "step": 1, "seconds": 0.5},
              {"event": "train_end", "time": 3.0, "pid": 1, "step": 1},
              {"event": "save_start", "time": 3.0, "pid": 1, "path": "last.ckpt", "step": 1},
              {"event": "save_end", "time": 9.0, "pid": 1, "path": "last.ckpt", "step": 1, "seconds": 6.0},
              {"event": "exit", "time": 9.5, "pid": 1, "reason": "completed"}]
    result = account(events)
    assert result.total_s == 3.0 and result.attempts[0].ended_by == "exit:completed"
    assert result.save_stalls_s == (0.5,) == result.first_save_stalls_s and result.steady_save_stalls_s == ()
    assert result.seconds[CHECKPOINT_SAVE] == 0.5 and result.seconds[OTHER] == 0.5


# The schedule and the options ------------------------------------------------------------------------
@given(st.lists(st.tuples(st.sampled_from(goodput.DISRUPTIONS), st.floats(0.01, 50)), min_size=1, max_size=6))
def test_a_schedule_parses_only_when_it_moves_forward(entries):
    text = ",".join(f"{kind}@{at!r}" for kind, at in entries)
    forward = all(b[1] > a[1] for a, b in zip(entries, entries[1:], strict=False))
    if forward:
        assert [(d.kind, d.at) for d in goodput.parse_schedule(text)] == entries
    else:
        with pytest.raises(ValueError, match="no later than"):
            goodput.parse_schedule(text)


@given(st.floats(1e3, 2e9), st.lists(st.floats(0.001, 60), min_size=1, max_size=8), st.floats(0, 60))
def test_a_kill_aimed_at_a_save_falls_inside_any_save_as_long_as_the_shortest_before_it(began, saves, longer):
    """However long a start's first save or an on_exception save ran before, the kill lands in the
    first half of a save no shorter than the run's shortest, counted from when that save began."""
    this_save = min(saves) + longer
    due = goodput.save_kill_due(began, saves)
    assert began < due <= began + this_save * goodput.SAVE_KILL_FRACTION * (1 + 1e-9)


def test_a_kill_aimed_at_a_run_s_first_save_is_sent_when_it_begins():
    assert goodput.save_kill_due(100.0, []) == 100.0


@pytest.mark.parametrize("text", ["sigkill", "sigkill@", "sighup@1", "sigkill@-1", "sigkill@nan", "sigkill@x"])
def test_a_malformed_schedule_entry_is_named(text):
    with pytest.raises(ValueError, match=f"schedule entry {text!r}"):
        goodput.parse_schedule(text)


@pytest.mark.parametrize("argv", [["--rows", "nope"], ["--rounds", "0"], ["--max-steps", "12"],
                                  ["--schedule", "sigterm@2,sigkill@1"], ["--launcher", "ssh"], ["--grace-s", "0"],
                                  ["--plain-saves", "1"], ["--rows", "torch-local", "--aa", "fastpersist"],
                                  ["--aa", ""], ["--aa", "nope"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        goodput.parse_args(argv)
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    (["--rows", "torch-local,fastpersist,torch-local"], "--rows names torch-local more than once"),
    (["--rows", "torch-local,fastpersist", "--aa", "fastpersist,fastpersist"], "--aa names fastpersist more than once"),
])
def test_a_row_named_twice_is_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit):
        goodput.parse_args(argv)
    assert named in capsys.readouterr().err


def test_help_lists_the_rows_the_schedule_and_the_defaults():
    out = subprocess.run([sys.executable, "-m", "benchmarks.recovery", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    out = " ".join(out.split()).replace("- ", "-")  # argparse wraps long defaults at their dashes
    for word in ("--rows", "--schedule", "--grace-s", "--launcher", "--json", "--chart", "sigkill-save",
                 goodput.DEFAULT_SCHEDULE, "(default: 64.0)", *goodput.ROWS):
        assert word in out, word


# A real run, on tiny arguments -------------------------------------------------------------------------
@pytest.mark.slow
def test_the_runner_reports_goodput_from_the_event_logs_of_its_runs(tmp_path):
    logs, out_json = tmp_path / "logs", tmp_path / "recovery.json"
    argv = ["--rows", "torch-local,fastpersist", "--aa", "torch-local", "--rounds", "2", "--size-mb", "1", "--width", "256",
            "--every-n-steps", "2",
            "--max-steps", "10", "--step-time-s", "0.02", "--schedule", "sigkill@1.5,sigterm@2.5,sigkill-save@3",
            "--plain-saves", "2", "--raw-reads", "2", "--local-dir", str(tmp_path / "local"), "--logs", str(logs),
            "--json", str(out_json)]
    (tmp_path / "local").mkdir()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.recovery", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out_json.read_text())
    assert [r["key"] for r in rows] == ["torch-local", "fastpersist", "torch-local~aa"]
    for row in rows:
        for key in ("goodput", "goodput_min", "goodput_max", "badput", "save_stall_s", "plain_save_s",
                    "stall_vs_plain_save", "to_first_step_s", "ceiling_s", "first_step_vs_ceiling", "raw_read_s",
                    "lost_steps_max", "goodput_vs_baseline", "restarts", "runs", "size_mb", "context",
                    "first_save_stall_s", "first_plain_save_s", "first_stall_vs_first_plain_save",
                    "wall_vs_baseline", "ideal_step_s"):
            assert key in row, key
        assert set(row["badput"]) == set(BADPUT_TYPES)
        assert len(row["runs"]) == 2 and row["resumes_ok"] == row["resumes"] == 6
        assert 0 < row["goodput"] < 1 and row["lost_steps_max"] <= 2
        assert len(row["restarts"]) == 6
        for restart in row["restarts"]:
            assert restart["ceiling_s"] == pytest.approx(restart["startup_s"] + restart["raw_read_s"])
            assert restart["to_first_step_s"] >= restart["startup_s"] > 0
        assert [len(r["plain_saves_s"]) for r in row["runs"]] == [2, 2]
    assert rows[0]["goodput_vs_baseline"] == 1.0 and rows[0]["bars"] is None
    assert rows[1]["wall_vs_baseline"] == pytest.approx(rows[1]["wall_s"] / rows[0]["wall_s"])
    assert set(rows[1]["bars"]) == {"save_stall", "restart", "progress_lost", "goodput"}
    # The A/A control: the baseline's job again, on paths of its own, compared with it and held to no bar.
    control = rows[2]
    assert control["type"] == "TorchCheckpointIO (local) (A/A control)" and control["plugin"] == "torch-local"
    assert control["control_of"] == control["baseline"] == "torch-local" and control["bars"] is None
    assert control["goodput_vs_baseline"] == pytest.approx(control["goodput"] / rows[0]["goodput"])
    # Every number comes from the event logs: the same accounting of each kept log gives it again.
    kept = sorted(logs.glob("*.jsonl"))
    assert len(kept) == 6
    for row in rows:
        for run in row["runs"]:
            log = next(p for p in kept if p.name.startswith(f"{row['key']}-r{run['round']}-"))
            again = account(read_events(log))
            assert again.goodput == pytest.approx(run["goodput"])
            assert sum(run["fractions"].values()) == pytest.approx(1.0, abs=1e-9)
            assert again.steps_done == run["steps_done"] == 10
            # The plain saves come after the last start's training: they are no part of the run.
            assert len(run["save_stalls_s"]) == len(again.save_stalls_s) < len(read_events(log)) // 4
            assert again.attempts[-1].end < max(e["time"] for e in read_events(log) if e["event"] == "save_end")
            assert [d[2] for d in run["disruptions"]] == ["SIGKILL", "exit:SIGTERMException", "SIGKILL"]
    # A clean console: the progress lines and the tables, nothing from Lightning, DeepSpeed or the plugins.
    for title in ("Goodput (min-max)", "Start-up", "Wasted", "Stall x plain", "x ceiling", "Steps lost (max)",
                  "Step s", "Job time x baseline"):
        assert title in proc.stdout
    assert sum("round " in line for line in proc.stderr.splitlines()) == 6
    for line in (proc.stdout + proc.stderr).splitlines():
        assert not any(noise in line for noise in NOISE), line
    chart = out_json.with_suffix(".png")
    assert chart.read_bytes().startswith(PNG_MAGIC) and chart.stat().st_size > 10_000
    assert "| Row |" in out_json.with_suffix(".md").read_text()


@pytest.mark.slow
def test_the_sharded_gcs_rows_run_and_their_ceilings_add_the_sharded_loads_own_cost(tmp_path):
    """The Dataflux DCP row (checkpoints that are a prefix and its commit record in the emulator) and its
    baseline on the same storage, DCP's own FsspecWriter through gcsfs. Each restart's ceiling is its
    start-up, the raw read and the sharded load's own cost (Lightning's strategy loading the same state
    from memory); the Dataflux row's goodput is compared with the baseline's."""
    out_json, logs = tmp_path / "recovery.json", tmp_path / "logs"
    argv = ["--rows", "torch-dcp-gcsfs,dataflux-dcp", "--rounds", "1", "--size-mb", "1", "--width", "256",
            "--every-n-steps", "2", "--max-steps", "10", "--step-time-s", "0.02", "--plain-saves", "2",
            "--raw-reads", "1", "--logs", str(logs), "--json", str(out_json)]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.recovery", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    baseline, row = json.loads(out_json.read_text())
    assert [baseline["key"], row["key"]] == ["torch-dcp-gcsfs", "dataflux-dcp"]
    for each in (baseline, row):
        assert each["resumes_ok"] == each["resumes"] == 3, each.get("notes")
        assert each["dcp_load_s"] > 0 and each["raw_read_s"] > 0
        for restart in each["restarts"]:
            assert restart["ceiling_s"] == pytest.approx(restart["startup_s"] + restart["raw_read_s"]
                                                         + restart["dcp_load_s"])
    assert row["baseline"] == "torch-dcp-gcsfs" and baseline["bars"] is None
    assert row["goodput_vs_baseline"] == pytest.approx(row["goodput"] / baseline["goodput"])
    # Every start trains with the job's one thread, as the single-file rows do: Lightning's launcher of the
    # distributed strategies would give it the machine's CPUs.
    starts = [e for log in sorted(logs.glob("*.jsonl")) for e in read_events(log) if e["event"] == "train_start"]
    assert len(starts) == 8 and {e["threads"] for e in starts} == {1}
