"""Goodput and badput of one run of the recovery job, from its event log.

Goodput is the share of a job's wall time spent on productive steps, as Google's
``ml-goodput-measurement`` defines it: productive step time over the job's whole wall time, restarts
included. The rest, the badput, is split into that package's categories (``BadputType``), those that
apply to a Lightning job on the CPU:

* ``PROGRAM_STARTUP``: from the launch of a start (the runner's ``launch`` event, else the job's
  ``start``) to the point it loads a checkpoint (``load_start``), or to the training start when there
  is none; and what the first step of each start takes beyond the run's ideal step (as the package
  counts first-step overheads);
* ``UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME``: the plugin's load (``load_start`` to ``load_end``);
* ``TRAINING_PREP``: from the load's end to the training start (Lightning puts the state into the
  model, the optimizer and the loops);
* ``UNPRODUCTIVE_CHECKPOINT_SAVE_TIME``: the time the training thread is blocked by a save (a save of the
  plugin itself, or handing one to ``AsyncCheckpointIO``), an interrupted one included;
* ``WASTED_PROGRESS_FROM_DISRUPTION``: steps a later start did again (those after the checkpoint it
  resumed from), and the work in progress when a start was killed;
* ``INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION``: from the end of a start to the launch of the next;
* ``OTHER``: the rest: a start's shutdown after its last step (exception handling, teardown) besides
  its saves.

Not used: ``TPU_INITIALIZATION`` (no accelerator), ``DATA_LOADING_SYNC`` / ``DATA_LOADING_ASYNC``
(fetching a batch is part of a step's time here, as the package counts it unless it is recorded on
its own) and ``CUSTOM_BADPUT_EVENTS``.

The wall time is cut into consecutive segments, each of one category, so goodput and the badput
categories add up to the whole by construction (:attr:`RunAccount.fractions`). Times come from the
events' ``time`` (``time.time()``, the same clock for every process of the machine); a boundary that
comes out of order is clamped to its neighbour rather than making a negative duration. Only rank 0's
events count (every rank of a sharded job steps together).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PROGRAM_STARTUP = "PROGRAM_STARTUP"
TRAINING_PREP = "TRAINING_PREP"
CHECKPOINT_RESTORE = "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"
CHECKPOINT_SAVE = "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"
WASTED_PROGRESS = "WASTED_PROGRESS_FROM_DISRUPTION"
INFRASTRUCTURE_RECOVERY = "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"
OTHER = "OTHER"
BADPUT_TYPES = (PROGRAM_STARTUP, TRAINING_PREP, CHECKPOINT_RESTORE, CHECKPOINT_SAVE, WASTED_PROGRESS,
                INFRASTRUCTURE_RECOVERY, OTHER)
GOODPUT = "GOODPUT"
# Segments whose category is settled once the whole run is known: a step (kept, or redone by a later
# start) and a start's time after its last step (lost work if it was killed, else shutdown).
_STEP = "step"
_TAIL = "tail"

LAUNCH_EVENT = "launch"
INJECT_EVENT = "inject"
INJECTOR = "injector"


@dataclass(frozen=True)
class Window:
    """A span in which the training thread waited for a checkpoint save; ``end`` is None when the
    start ended inside it."""

    start: float
    end: float | None
    path: str
    step: int | None


@dataclass(frozen=True)
class Attempt:
    """One start of the job, as its events tell it."""

    index: int
    pid: int
    launched: float
    end: float
    ended_by: str  # "exit:<reason>", "SIGKILL", or "unknown" (its log just stops)
    load_start: float | None = None
    load_end: float | None = None
    train_start: float | None = None
    resumed_step: int = 0
    ckpt_path: str | None = None
    steps: tuple[tuple[float, int], ...] = ()
    blocked: tuple[Window, ...] = ()

    @property
    def killed(self) -> bool:
        """Whether it ended without the job's own ``exit`` (SIGKILL, or a log that stops)."""
        return not self.ended_by.startswith("exit:")

    @property
    def last_step(self) -> int:
        """The global step it reached (its resumed step if it made none)."""
        return self.steps[-1][1] if self.steps else self.resumed_step


@dataclass(frozen=True)
class Restart:
    """A start after the first: how long it took to train again, and what the one before it lost.

    ``startup_s`` runs from its launch to the point it loads (``load_start``), ``load_s`` is the
    plugin's load, ``prep_s`` Lightning's restore after it, ``to_first_step_s`` from the launch to the
    training start (the first step begins). ``lost_steps`` are the steps the previous start made past
    the checkpoint this one resumed from, ``lost_s`` the time they and its unfinished work took.
    """

    attempt: int
    disruption: str
    startup_s: float
    load_s: float | None
    prep_s: float | None
    to_first_step_s: float | None
    resumed_step: int
    ckpt_path: str | None
    lost_steps: int
    lost_s: float


@dataclass(frozen=True)
class Segment:
    """A span of the run's wall time in one category, of one start (``attempt``; a step's with its
    global ``step``, and whether it is the start's ``first`` step)."""

    start: float
    end: float
    category: str
    attempt: int
    step: int | None = None
    first: bool = False

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class RunAccount:
    """Where a run's wall time went.

    ``seconds`` maps :data:`GOODPUT` and each of :data:`BADPUT_TYPES` to seconds; they add up to
    ``total_s``. ``ideal_step_s`` is the median time of a step that was not a start's first,
    without the saves it waited for. ``save_stalls_s`` is how long each save the training thread
    waited for took (finished ones), ``first_save_stalls_s`` those of them that were the first of their
    start (a new process: the plugin sets up its buffers and connections in it), ``steady_save_stalls_s``
    the others, ``progress`` the global
    step over the run's wall time (seconds
    since the first launch, a point at each step and at each training start), ``disruptions`` when
    each start that did not complete ended and how.
    """

    total_s: float
    seconds: Mapping[str, float]
    attempts: tuple[Attempt, ...]
    restarts: tuple[Restart, ...]
    ideal_step_s: float
    save_stalls_s: tuple[float, ...]
    first_save_stalls_s: tuple[float, ...]
    steady_save_stalls_s: tuple[float, ...]
    progress: tuple[tuple[float, int], ...]
    disruptions: tuple[tuple[float, int, str], ...]
    segments: tuple[Segment, ...] = field(repr=False, default=())

    @property
    def goodput(self) -> float:
        """Productive step time over the whole wall time (0 for a run of no time)."""
        return self.seconds[GOODPUT] / self.total_s if self.total_s > 0 else 0.0

    @property
    def fractions(self) -> dict[str, float]:
        """Each category's share of the wall time; they add up to 1 (for a run of some time)."""
        return {name: (value / self.total_s if self.total_s > 0 else 0.0) for name, value in self.seconds.items()}

    @property
    def steps_done(self) -> int:
        """The global step the run ended at."""
        return self.attempts[-1].last_step if self.attempts else 0


def _ours(event: Mapping[str, Any]) -> bool:
    return event.get("source") != INJECTOR and event.get("rank", 0) == 0


def attempts_of(events: Sequence[Mapping[str, Any]]) -> list[Attempt]:
    """Every start of the job in the log, in order.

    A start is a process whose rank-0 ``start`` event is in the log. Its launch is the runner's
    ``launch`` event naming its pid (``target``), else its ``start``; its end is the end of its training
    (``train_end``: what it does after, such as timing plain saves, is not part of the run), else its
    ``exit`` event, else
    the time of an ``inject`` event that killed it with SIGKILL (a kill, or a preemption whose grace
    period ran out), else its last event.
    """
    order: list[int] = []
    by_pid: dict[int, list[Mapping[str, Any]]] = {}
    launches: dict[int, float] = {}
    kills: dict[int, float] = {}
    for event in events:
        if event.get("source") == INJECTOR:
            if event["event"] == LAUNCH_EVENT and event.get("target") is not None:
                launches[event["target"]] = event["time"]
            elif event["event"] == INJECT_EVENT and event.get("action") == "SIGKILL":
                kills.setdefault(event.get("target"), event.get("sent", event["time"]))
            elif event["event"] == INJECT_EVENT and event.get("killed"):  # a grace period that ran out
                sent = event["time"] - event.get("exited_after_s", 0.0)
                kills.setdefault(event.get("target"), sent + event.get("grace_s", event.get("exited_after_s", 0.0)))
            continue
        if not _ours(event):
            continue
        pid = event["pid"]
        if event["event"] == "start" and pid not in by_pid:
            order.append(pid)
            by_pid[pid] = []
        if pid in by_pid:
            by_pid[pid].append(event)
    attempts = []
    for index, pid in enumerate(order):
        own = by_pid[pid]
        first = {}
        for event in own:
            first.setdefault(event["event"], event)
        exits = [e for e in own if e["event"] == "exit"]
        if "train_end" in first:  # training ended; what the start does after it is not the job's
            end, ended_by = first["train_end"]["time"], f"exit:{exits[-1].get('reason') if exits else 'completed'}"
            own = [e for e in own if e["time"] <= end]
        elif exits:
            end, ended_by = exits[-1]["time"], f"exit:{exits[-1].get('reason')}"
        elif pid in kills:
            end, ended_by = kills[pid], "SIGKILL"
        else:
            end, ended_by = own[-1]["time"], "unknown"
        train = first.get("train_start")
        blocked = _blocked_windows(own)
        attempts.append(Attempt(
            index=index, pid=pid, launched=min(launches.get(pid, own[0]["time"]), own[0]["time"]), end=end,
            ended_by=ended_by,
            load_start=first["load_start"]["time"] if "load_start" in first else None,
            load_end=first["load_end"]["time"] if "load_end" in first else None,
            train_start=train["time"] if train else None,
            resumed_step=int(train["step"]) if train else 0,
            ckpt_path=train.get("ckpt_path") if train else None,
            steps=tuple((e["time"], int(e["step"])) for e in own if e["event"] == "step"),
            blocked=blocked,
        ))
    return attempts


def _blocked_windows(own: Sequence[Mapping[str, Any]]) -> tuple[Window, ...]:
    """The spans the training thread waited for saves: each blocking save of the plugin (``save_start``
    with ``blocking``), and each hand-over to ``AsyncCheckpointIO`` (``stall_start``)."""
    windows: list[Window] = []
    open_: dict[tuple[str, str], Mapping[str, Any]] = {}
    for event in own:
        kind = event["event"]
        if kind in ("save_start", "stall_start"):
            if kind == "save_start" and not event.get("blocking", True):
                continue
            open_[(kind.split("_")[0], event.get("path", ""))] = event
        elif kind in ("save_end", "save_error", "stall_end"):
            started = open_.pop(("stall" if kind == "stall_end" else "save", event.get("path", "")), None)
            if started is not None:
                windows.append(Window(started["time"], event["time"], started.get("path", ""), started.get("step")))
    windows += [Window(e["time"], None, e.get("path", ""), e.get("step")) for e in open_.values()]
    return tuple(sorted(windows, key=lambda w: w.start))


class _Cutter:
    """Cuts one start's ``[start, end]`` into consecutive segments; a boundary out of order is clamped."""

    def __init__(self, attempt: int, start: float, end: float) -> None:
        self.attempt = attempt
        self.cursor, self.end = start, max(start, end)
        self.segments: list[Segment] = []

    def to(self, until: float | None, category: str, step: int | None = None, first: bool = False) -> None:
        if until is None:
            return
        until = min(max(until, self.cursor), self.end)
        if until > self.cursor:
            self.segments.append(Segment(self.cursor, until, category, self.attempt, step, first))
        self.cursor = until

    def through(self, until: float, category: str, windows: Sequence[Window], step: int | None = None,
                first: bool = False) -> None:
        """Up to ``until`` in ``category``, the parts inside ``windows`` as save time."""
        for window in windows:
            if window.start >= until:
                break
            if (window.end if window.end is not None else self.end) <= self.cursor:
                continue
            self.to(min(window.start, until), category, step, first)
            self.to(min(window.end if window.end is not None else self.end, until), CHECKPOINT_SAVE)
        self.to(until, category, step, first)


def account(events: Iterable[Mapping[str, Any]]) -> RunAccount:
    """Goodput, badput by category, restarts and progress of one run, from its event log.

    Args:
        events: the run's events, as :func:`benchmarks.recovery.events.read_events` gives them (every
            start of the job, and the runner's ``launch`` and ``inject`` events).
    """
    events = list(events)
    attempts = attempts_of(events)
    if not attempts:
        return RunAccount(0.0, {GOODPUT: 0.0, **dict.fromkeys(BADPUT_TYPES, 0.0)}, (), (), 0.0, (), (), (), (), ())
    # A step counts as productive unless a later start resumed from before it and did it again.
    kept_through = []
    for index in range(len(attempts)):
        later = [a.resumed_step for a in attempts[index + 1:] if a.train_start is not None]
        kept_through.append(min(later) if later else math.inf)
    segments: list[Segment] = []
    previous_end: float | None = None
    for attempt in attempts:
        if previous_end is not None:
            segments.append(Segment(previous_end, max(previous_end, attempt.launched), INFRASTRUCTURE_RECOVERY,
                                    attempt.index))
        start = attempt.launched if previous_end is None else max(previous_end, attempt.launched)
        cut = _Cutter(attempt.index, start, attempt.end)
        loaded = attempt.load_start is not None
        cut.to(attempt.load_start if loaded else attempt.train_start, PROGRAM_STARTUP)
        if loaded:
            cut.to(attempt.load_end if attempt.load_end is not None else cut.end, CHECKPOINT_RESTORE)
            cut.to(attempt.train_start, TRAINING_PREP)
        if attempt.train_start is not None:
            for number, (when, step) in enumerate(attempt.steps):
                cut.through(when, _STEP, attempt.blocked, step, first=number == 0)
        cut.through(cut.end, _TAIL, attempt.blocked)
        segments += cut.segments
        previous_end = cut.end
    # The ideal step: the median of steps other than a start's first, without their save waits.
    durations: dict[tuple[int, int], float] = {}
    first_steps: set[tuple[int, int]] = set()
    for segment in segments:
        if segment.category == _STEP:
            key = (segment.attempt, segment.step)
            durations[key] = durations.get(key, 0.0) + segment.seconds
            if segment.first:
                first_steps.add(key)
    regular = [seconds for key, seconds in durations.items() if key not in first_steps]
    ideal = statistics.median(regular) if regular else 0.0
    seconds = {GOODPUT: 0.0, **dict.fromkeys(BADPUT_TYPES, 0.0)}
    for segment in segments:
        if segment.category == _STEP:
            kept = segment.step <= kept_through[segment.attempt]
            seconds[GOODPUT if kept else WASTED_PROGRESS] += segment.seconds
        elif segment.category == _TAIL:
            seconds[WASTED_PROGRESS if attempts[segment.attempt].killed else OTHER] += segment.seconds
        else:
            seconds[segment.category] += segment.seconds
    # What a start's first step takes beyond the ideal step is start-up, as the package counts it.
    for attempt_index, step in first_steps:
        extra = max(0.0, durations[(attempt_index, step)] - ideal) if regular else 0.0
        bucket = GOODPUT if step <= kept_through[attempt_index] else WASTED_PROGRESS
        extra = min(extra, seconds[bucket])
        seconds[bucket] -= extra
        seconds[PROGRAM_STARTUP] += extra
    total = segments[-1].end - segments[0].start if segments else 0.0
    return RunAccount(
        total_s=total, seconds=seconds, attempts=tuple(attempts),
        restarts=tuple(_restarts(attempts, segments)), ideal_step_s=ideal,
        save_stalls_s=tuple(w.end - w.start for a in attempts for w in a.blocked if w.end is not None),
        first_save_stalls_s=tuple(a.blocked[0].end - a.blocked[0].start for a in attempts
                                  if a.blocked and a.blocked[0].end is not None),
        steady_save_stalls_s=tuple(w.end - w.start for a in attempts for w in a.blocked[1:] if w.end is not None),
        progress=tuple(_progress(attempts)), disruptions=tuple(_disruptions(attempts)),
        segments=tuple(segments),
    )


def _restarts(attempts: Sequence[Attempt], segments: Sequence[Segment]) -> list[Restart]:
    restarts = []
    for previous, attempt in zip(attempts, attempts[1:], strict=False):
        loaded = attempt.load_start is not None
        ready = attempt.load_start if loaded else attempt.train_start
        lost_s = sum(s.seconds for s in segments if s.attempt == previous.index and (
            (s.category == _STEP and s.step > attempt.resumed_step) or (s.category == _TAIL and previous.killed)))
        restarts.append(Restart(
            attempt=attempt.index, disruption=previous.ended_by,
            startup_s=(ready if ready is not None else attempt.end) - attempt.launched,
            load_s=attempt.load_end - attempt.load_start if loaded and attempt.load_end is not None else None,
            prep_s=(attempt.train_start - attempt.load_end
                    if loaded and attempt.load_end is not None and attempt.train_start is not None else None),
            to_first_step_s=attempt.train_start - attempt.launched if attempt.train_start is not None else None,
            resumed_step=attempt.resumed_step, ckpt_path=attempt.ckpt_path,
            lost_steps=max(0, previous.last_step - attempt.resumed_step) if attempt.train_start is not None else 0,
            lost_s=lost_s,
        ))
    return restarts


def _progress(attempts: Sequence[Attempt]) -> list[tuple[float, int]]:
    origin = attempts[0].launched
    points: list[tuple[float, int]] = []
    for attempt in attempts:
        if attempt.train_start is not None:
            points.append((attempt.train_start - origin, attempt.resumed_step))
        points += [(when - origin, step) for when, step in attempt.steps]
    return points


def _disruptions(attempts: Sequence[Attempt]) -> list[tuple[float, int, str]]:
    """When each start but the last ended (seconds since the first launch), at which step, and how."""
    origin = attempts[0].launched
    return [(a.end - origin, a.last_step, a.ended_by) for a in attempts[:-1]]
