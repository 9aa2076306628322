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
import statistics
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


# Pooling the results of several runs ------------------------------------------------------------------
def _record(round_: int, goodput_: float, stalls: list[float], plain: list[float], vs_ceiling: float) -> dict:
    """A run's record as the runner writes it (goodput.run_record), with the measures pooling sums up."""
    fractions = dict.fromkeys(BADPUT_TYPES, (1 - goodput_) / len(BADPUT_TYPES))
    return {
        "round": round_, "total_s": 10.0, "goodput": goodput_, "seconds": {},
        "fractions": {GOODPUT: goodput_, **fractions}, "save_stalls_s": [0.9, *stalls],
        "first_save_stalls_s": [0.9], "steady_save_stalls_s": stalls, "plain_saves_s": [0.8, *plain],
        "raw_read_s": [0.1], "dcp_load_s": [], "checkpoint_bytes": 64 << 20, "steps_done": 24,
        "ideal_step_s": 0.1, "resumes_ok": 3, "resumes": 3, "save_kills_in_save": 1, "save_kills": 1,
        "notes": [], "progress": [[0.0, 0]], "disruptions": [],
        "restarts": [{"after": "SIGKILL", "startup_s": 1.0, "load_s": 0.1, "prep_s": 0.0, "to_first_step_s": 1.2,
                      "raw_read_s": 0.1, "dcp_load_s": None, "ceiling_s": 1.2 / vs_ceiling,
                      "vs_ceiling": vs_ceiling, "resumed_step": 4, "ckpt_path": "last.ckpt", "lost_steps": 2,
                      "lost_s": 0.2}],
    }


SETTINGS = goodput.Settings().record()


def _result(rows_runs: dict, **settings) -> list[dict]:
    """A run's JSON rows: a baseline and a plugin compared with it, each with ``rows_runs[key]``'s records."""
    context = {"settings": {**SETTINGS, **settings}, "elapsed_s": 300.0}
    rows = []
    for key in ("torch-local", "fastpersist"):
        rows.append(goodput.summarize(goodput.row_fields(goodput.ROWS[key]), rows_runs[key], [],
                                      every_n_steps=4, max_steps=24) | {"context": context})
    goodput.add_ratios(rows)
    return rows


runs_of_a_row = st.lists(st.tuples(st.floats(0.05, 0.95), st.lists(st.floats(0.01, 2.0), min_size=1, max_size=4),
                                   st.lists(st.floats(0.01, 2.0), min_size=1, max_size=4), st.floats(0.5, 2.0)),
                         min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.fixed_dictionaries({"torch-local": runs_of_a_row, "fastpersist": runs_of_a_row}),
                min_size=2, max_size=4))
def test_pooled_runs_are_summarized_as_one_run_of_all_their_rounds(drawn):
    """Every median, ratio and bar of the pooled rows is the one a single run of all those rounds
    would give: the medians over every pooled run's measures, ratios of those medians."""
    results = [(f"run{i}.json", _result({key: [_record(r, *values) for r, values in enumerate(runs)]
                                          for key, runs in one.items()})) for i, one in enumerate(drawn)]
    pooled = {row["key"]: row for row in goodput.pool(results)}
    for key in ("torch-local", "fastpersist"):
        every = [values for one in drawn for values in one[key]]
        row = pooled[key]
        assert row["rounds"] == len(every) and [r["round"] for r in row["runs"]] == list(range(len(every)))
        stall = statistics.median([s for _, stalls, _, _ in every for s in stalls])
        plain = statistics.median([p for _, _, plain, _ in every for p in plain])
        assert row["stall_vs_plain_save"] == pytest.approx(stall / plain)
        assert row["goodput"] == pytest.approx(statistics.median([g for g, *_ in every]))
        assert row["first_step_vs_ceiling"] == pytest.approx(statistics.median([c for *_, c in every]))
        assert row["resumes"] == 3 * len(every) and len(row["restarts"]) == len(every)
    plugin, base = pooled["fastpersist"], pooled["torch-local"]
    assert plugin["goodput_vs_baseline"] == pytest.approx(plugin["goodput"] / base["goodput"])
    assert plugin["bars"]["save_stall"] == (plugin["stall_vs_plain_save"] <= goodput.STALL_BAR)
    assert plugin["bars"]["goodput"] == (plugin["goodput_vs_baseline"] >= goodput.GOODPUT_BAR)
    assert base["bars"] is None


def _two_results(**second_settings) -> list[tuple[str, list[dict]]]:
    runs = {"torch-local": [_record(0, 0.3, [0.2], [0.2], 1.0)], "fastpersist": [_record(0, 0.3, [0.1], [0.1], 1.0)]}
    return [("a.json", _result(runs)), ("b.json", _result(runs, **second_settings))]


def test_only_runs_of_the_same_rows_and_settings_are_pooled_and_what_differs_is_named():
    assert goodput.pool(_two_results(rounds=7))[1]["rounds"] == 2  # the rounds are what pooling adds up
    with pytest.raises(ValueError, match=r"b.json ran with max_steps=32, a.json with max_steps=24"):
        goodput.pool(_two_results(max_steps=32))
    (a, rows), (b, _) = _two_results()
    with pytest.raises(ValueError, match=r"b.json holds rows \['torch-local'\], a.json holds"):
        goodput.pool([(a, rows), (b, rows[:1])])
    with pytest.raises(ValueError, match="two runs or more"):
        goodput.pool([(a, rows)])


def test_runs_recorded_without_what_pooling_needs_are_refused_by_name():
    (a, rows), (b, theirs) = _two_results()
    for row in theirs:
        for run in row["runs"]:
            del run["steady_save_stalls_s"]
    with pytest.raises(ValueError, match="b.json: the runs of row torch-local lack steady_save_stalls_s"):
        goodput.pool([(a, rows), (b, theirs)])


@pytest.mark.parametrize(("extra", "named"), [
    (["--rounds", "6"], "--rounds does not apply"), (["--rows", "fastpersist"], "--rows does not apply"),
    ([], "two runs or more"),
])
def test_pooling_refuses_the_options_of_a_run(extra, named, capsys, tmp_path):
    with pytest.raises(SystemExit):
        goodput.parse_args(["--pool", str(tmp_path / "a.json"), *(["b.json"] if extra else []), *extra])
    assert named in capsys.readouterr().err


def test_pooling_never_writes_over_a_result_it_reads(capsys, tmp_path):
    with pytest.raises(SystemExit):
        goodput.parse_args(["--pool", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                            "--json", str(tmp_path / "a.json")])
    assert "would overwrite" in capsys.readouterr().err


def test_the_pooled_result_is_written_as_a_run_s(tmp_path):
    paths = []
    for source, rows in _two_results():
        paths.append(tmp_path / source)
        paths[-1].write_text(json.dumps(rows))
    out = tmp_path / "pooled.json"
    command = [sys.executable, "-m", "benchmarks.recovery", "--pool", *map(str, paths), "--json", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [r["rounds"] for r in rows] == [2, 2]
    assert rows[0]["context"]["pooled_from"] == [str(p) for p in paths]
    assert rows[0]["context"]["settings"]["rounds"] == 2
    assert "pooled from 2 runs" in proc.stderr and "Stall x plain" in proc.stdout
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)
    assert "| Row |" in out.with_suffix(".md").read_text()
    (tmp_path / "broken.json").write_text("{")
    command[4] = str(tmp_path / "broken.json")
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"cannot read the results {tmp_path / 'broken.json'}" in proc.stderr


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
    # Its records pool: the run twice over has the same medians and ratios, in twice the rounds.
    again, twice = tmp_path / "again.json", tmp_path / "twice.json"
    again.write_text(out_json.read_text())
    proc = subprocess.run([sys.executable, "-m", "benchmarks.recovery", "--pool", str(out_json), str(again),
                           "--json", str(twice)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row, pooled in zip(rows, json.loads(twice.read_text()), strict=True):
        assert pooled["rounds"] == 2 * row["rounds"] and pooled["resumes"] == 2 * row["resumes"]
        for key in ("goodput", "stall_vs_plain_save", "first_step_vs_ceiling", "goodput_vs_baseline", "wall_s"):
            assert pooled[key] == (None if row[key] is None else pytest.approx(row[key])), key


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
