"""Goodput under kills and preemptions, for every storage plugin and its baseline.

``python -m benchmarks.recovery``: every row runs the same recovery job (:mod:`benchmarks.recovery.job`: the same model, the same
checkpoint every ``--every-n-steps`` steps, the same number of steps) through its storage plugin, and
stops it with the same schedule of disruptions, each start resuming from the run's newest checkpoint:
by default a SIGKILL in the middle of a checkpoint interval, a SIGTERM preemption with a grace period
(as spot VMs and Kubernetes pods give) and a SIGKILL during a save; then the job runs to its end.
From the event log of each run it reports, as Google's ``ml-goodput-measurement`` defines them (see
:mod:`benchmarks.recovery.accounting`):

* goodput: productive step time over the job's wall time, restarts included;
* badput by category: start-up, checkpoint restore, training preparation, checkpoint save stalls,
  wasted progress, recovery between starts, and the rest;
* for each restart: the time from its launch to its first step, against its ceiling: its own start-up
  (launch to the point it loads) plus a raw read of the checkpoint's bytes at the machine's speed, and
  for a sharded checkpoint the sharded load's own cost (DCP planning, collectives and resolving every
  item, the strategy putting the state into the model and optimizers), timed with the bytes in memory
  (:func:`benchmarks.recovery.ceilings.sharded_load_seconds`);
* each save stall, against the plugin's plain save of the same checkpoint (``trainer.save_checkpoint``
  outside training, as ``benchmarks.lightning_ckpt`` times it), measured in the same rounds;
* the progress lost to each disruption (at most one checkpoint interval).

Rows run in interleaved rounds (A B C, then B C A...), and results are medians with their min-max.
Ratios compare each plugin with TorchCheckpointIO on the same storage (for the sharded rows DCP's own
writer on it: ``FileSystemWriter`` on the local disk, ``FsspecWriter`` through gcsfs in GCS). Every
service runs on loopback: fake-gcs-server behind the XML multipart server, a redis-server, and a local
directory that takes ``O_DIRECT``. ``--pool`` runs nothing: it writes one result of all the rounds of
several earlier runs' results (:func:`pool`), for a ratio that one run's rounds leave to noise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.plugins import ServiceOptions, Services
from benchmarks.recovery import ceilings
from benchmarks.recovery.accounting import (
    BADPUT_TYPES,
    CHECKPOINT_RESTORE,
    CHECKPOINT_SAVE,
    GOODPUT,
    INFRASTRUCTURE_RECOVERY,
    INJECT_EVENT,
    INJECTOR,
    LAUNCH_EVENT,
    OTHER,
    PROGRAM_STARTUP,
    TRAINING_PREP,
    WASTED_PROGRESS,
    RunAccount,
    account,
)
from benchmarks.recovery.events import (
    ForkServer,
    Job,
    LogFollower,
    ProcessLauncher,
    check_resume,
    of_process,
    preempt,
    read_events,
)
from benchmarks.recovery.job import DCP_LOAD_EVENT, EventLog, JobConfig
from benchmarks.report import (
    MB,
    format_markdown_table,
    format_table,
    latencies_seconds,
    ratio,
    split_choices,
    spread,
    write_json,
)

log = logging.getLogger("benchmarks.recovery")

DEFAULT_JSON = "results/recovery.json"
LAUNCHERS = ("fork", "process")
DISRUPTIONS = ("sigkill", "sigterm", "sigkill-save")
DEFAULT_SCHEDULE = "sigkill@1.5,sigterm@2.5,sigkill-save@3"
# How far into a save the kill of "sigkill-save" lands: this share of the run's shortest save so far.
SAVE_KILL_FRACTION = 0.5
# Bars every plugin is held to (the stall and restart ratios at most, the goodput ratio at least).
STALL_BAR = 1.1
FIRST_STEP_BAR = 1.3
GOODPUT_BAR = 1.0
AA_SUFFIX = "~aa"
START_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Row:
    """A plugin (or a baseline) as the recovery job runs it: the job's ``plugin`` on ``strategy``, with
    checkpoints on ``storage`` (``local``, ``gcs`` or ``redis``), compared with the ``baseline`` row."""

    key: str
    name: str
    plugin: str
    strategy: str
    storage: str
    baseline: str
    control_of: str | None = None  # an A/A control: the key of the row it copies (and its baseline)

    @property
    def is_baseline(self) -> bool:
        return self.baseline == self.key

    def control(self) -> Row:
        """An A/A control of this row: the same job on the same storage, with its own paths, compared
        with this row instead of a baseline, and held to no bar."""
        return dataclasses.replace(self, key=self.key + AA_SUFFIX, name=f"{self.name} (A/A control)",
                                   baseline=self.key, control_of=self.key)


ROWS: dict[str, Row] = {r.key: r for r in [
    Row("torch-local", "TorchCheckpointIO (local)", "torch-local", "single", "local", "torch-local"),
    Row("fastpersist", "FastPersistCheckpointIO (local)", "fastpersist", "single", "local", "torch-local"),
    Row("fastpersist-aio", "FastPersistCheckpointIO, aio loads too (local)", "fastpersist-aio", "single", "local",
        "torch-local"),
    Row("fastpersist-python", "FastPersistCheckpointIO, python engine (local)", "fastpersist-python", "single",
        "local", "torch-local"),
    Row("torch-redis", "TorchCheckpointIO (redis)", "torch-redis", "single", "redis", "torch-redis"),
    Row("smartredis", "SmartRedisCheckpointIO (redis)", "smartredis", "single", "redis", "torch-redis"),
    Row("torch-gcsfs", "TorchCheckpointIO (gcsfs)", "torch-gcsfs", "single", "gcs", "torch-gcsfs"),
    Row("dataflux", "DatafluxCheckpointIO (gcs)", "dataflux", "single", "gcs", "torch-gcsfs"),
    Row("torch-dcp", "FSDP, DCP FileSystemWriter (local)", "torch-dcp", "fsdp", "local", "torch-dcp"),
    Row("fastpersist-dcp", "FSDP, FastPersist DCP storage (local)", "fastpersist-dcp", "fsdp", "local",
        "torch-dcp"),
    Row("torch-dcp-gcsfs", "FSDP, DCP FsspecWriter (gcsfs)", "torch-dcp-gcsfs", "fsdp", "gcs", "torch-dcp-gcsfs"),
    Row("dataflux-dcp", "FSDP, Dataflux DCP storage (gcs)", "dataflux-dcp", "fsdp", "gcs", "torch-dcp-gcsfs"),
]}
DEFAULT_ROWS = ("torch-local", "fastpersist", "torch-redis", "smartredis", "torch-gcsfs", "dataflux", "torch-dcp",
                "fastpersist-dcp", "torch-dcp-gcsfs", "dataflux-dcp")


# The schedule ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Disruption:
    """One event of the schedule: ``kind`` (one of :data:`DISRUPTIONS`) at ``at`` checkpoint intervals
    into the job: at the step ``ceil(at * every_n_steps)`` (``sigkill``, ``sigterm``), or in the save of
    the first checkpoint from that step on (``sigkill-save``)."""

    kind: str
    at: float

    def step(self, every_n_steps: int) -> int:
        return max(1, math.ceil(self.at * every_n_steps - 1e-9))

    def describe(self) -> str:
        return {"sigkill": "SIGKILL at step {}", "sigterm": "SIGTERM (preemption) at step {}",
                "sigkill-save": "SIGKILL in the first save from step {} on"}[self.kind]


def parse_schedule(text: str) -> tuple[Disruption, ...]:
    """``KIND@INTERVALS,...`` (for example ``sigkill@1.5,sigterm@2.5,sigkill-save@3``), in order.

    Raises:
        ValueError: an unknown kind, a malformed or non-positive position, or positions that do not
            grow (each start resumes at most one interval back, so a later event must come later).
    """
    schedule = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, at = part.partition("@")
        if kind not in DISRUPTIONS or not sep:
            raise ValueError(f"schedule entry {part!r}: expected KIND@INTERVALS, KIND one of {', '.join(DISRUPTIONS)}")
        try:
            position = float(at)
        except ValueError:
            raise ValueError(f"schedule entry {part!r}: {at!r} is not a number of checkpoint intervals") from None
        if not position > 0 or not math.isfinite(position):
            raise ValueError(f"schedule entry {part!r}: the position must be a positive number of intervals")
        if schedule and position <= schedule[-1].at:
            raise ValueError(f"schedule entry {part!r} comes no later than the one before it")
        schedule.append(Disruption(kind, position))
    return tuple(schedule)


@dataclass(frozen=True)
class Settings:
    """What every row's run shares.

    Args:
        size_mb: the checkpoint's size in MiB, about (weights and AdamW's moments).
        width: the model's layer width (the checkpoint holds six tensors per layer of ``width`` x
            ``width`` weights and its bias: weights, bias and their two AdamW moments).
        every_n_steps: a checkpoint (``last.ckpt``) every this many steps.
        max_steps: the run's steps in all. The default gives the last start saves of its own after
            its first (steps 20 and 24), so that the save stall's median holds more than the one save
            a preempted start makes after its first, ``on_exception.ckpt``.
        step_time_s: what a step waits besides its compute (a real model's step).
        schedule: the disruptions, in order.
        grace_s: seconds between a preemption's SIGTERM and its SIGKILL.
        rounds: interleaved rounds of every row.
        plain_saves: plain saves of each row per round (the save stalls' reference), made by the run's
            last start once its training has ended. The first follows Lightning's teardown, which frees the
            plugin's buffers and connections, as a restart's first save finds them; the others are steady.
        raw_reads: raw reads of the last checkpoint per run (the restarts' ceiling).
        launcher: ``fork`` (each start forked from a process that has imported torch, Lightning and
            the plugins) or ``process`` (``python -m benchmarks.recovery.job``, imports included).
    """

    size_mb: float = 64.0
    width: int = 512
    every_n_steps: int = 4
    max_steps: int = 24
    step_time_s: float = 0.05
    schedule: tuple[Disruption, ...] = parse_schedule(DEFAULT_SCHEDULE)
    grace_s: float = 30.0
    rounds: int = 3
    plain_saves: int = 4
    raw_reads: int = 3
    launcher: str = "fork"

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"unknown launcher {self.launcher!r}; choose from {', '.join(LAUNCHERS)}")
        for name in ("width", "every_n_steps", "max_steps", "rounds", "raw_reads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.plain_saves < 2:
            raise ValueError(f"plain_saves must be at least 2 (a first and a steady one), got {self.plain_saves}")
        if self.size_mb <= 0 or self.step_time_s < 0 or self.grace_s <= 0:
            raise ValueError("size_mb and grace_s must be positive, step_time_s not negative")
        last = self.schedule[-1].step(self.every_n_steps) if self.schedule else 0
        if last >= self.max_steps:
            raise ValueError(f"the schedule's last event (step {last}) must come before max_steps ({self.max_steps})")

    def describe(self) -> str:
        events = ", ".join(d.describe().format(d.step(self.every_n_steps)) for d in self.schedule)
        return (f"{self.size_mb:g} MiB checkpoint ({self.width}-wide layers) every {self.every_n_steps} steps, "
                f"{self.max_steps} steps of "
                f"{self.step_time_s * 1000:g} ms + compute; {events or 'no disruption'}; grace {self.grace_s:g} s; "
                f"{self.rounds} rounds, {self.launcher} launcher")

    def record(self) -> dict[str, Any]:
        """These settings as a result's JSON holds them (each row's ``context``)."""
        return {**dataclasses.asdict(self), "schedule": [dataclasses.asdict(d) for d in self.schedule]}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Settings:
        """The settings a result's JSON holds (:meth:`record`)."""
        return cls(**{**record, "schedule": tuple(Disruption(**d) for d in record["schedule"])})


# Storage: where each row's runs keep their checkpoints, and how they are read raw ------------------
class Storages:
    """The services of one benchmark run, and each row's place in them."""

    def __init__(self, services: Services) -> None:
        self.services = services

    def start(self, rows: Sequence[Row]) -> None:
        """Start every service the rows need, up front (so no run pays for it)."""
        for storage in sorted({row.storage for row in rows}):
            self.services.directory(storage)
        if any(row.storage == "local" for row in rows):
            check_o_direct(self.services.local_dir())

    def root(self, row: Row, run: str) -> str:
        """A fresh ``default_root_dir`` for one run of ``row``."""
        if row.storage == "redis":
            return f"redis://{self.services.redis_prefix}/{run}"
        return f"{self.services.directory(row.storage)}/{run}"

    def config(self, row: Row, root: str, event_log: str, settings: Settings, **overrides: Any) -> JobConfig:
        endpoint = self.services.endpoint
        fields: dict[str, Any] = {
            "every_n_steps": settings.every_n_steps, "save_top_k": 0, "max_steps": settings.max_steps,
            "size_mb": settings.size_mb, "width": settings.width, "step_time_s": settings.step_time_s,
            "gcs_url": endpoint.url if endpoint is not None and row.storage == "gcs" else None,
            "redis_address": self.services.redis_address() if row.storage == "redis" else None,
        }
        return JobConfig(plugin=row.plugin, root=root, event_log=event_log, strategy=row.strategy,
                         **{**fields, **overrides})

    def raw_reader(self, row: Row, path: str) -> tuple[Callable[[], int], Callable[[], None]]:
        """A raw read of the checkpoint at ``path`` (see :mod:`benchmarks.recovery.ceilings`), and what
        releases it."""
        if row.storage == "gcs":
            from dataflux_ckpt.options import CHUNK_SIZE_BYTES, MAX_WORKERS  # not the plugin: no torch here

            assert self.services.endpoint is not None
            reader = ceilings.GcsReader(path, self.services.endpoint.url, part_bytes=CHUNK_SIZE_BYTES,
                                        workers=MAX_WORKERS)
            return reader.read, reader.close
        if row.storage == "redis":
            key = path.removeprefix("redis://")
            address = self.services.redis_address()
            return (lambda: ceilings.read_redis(key, address)), (lambda: None)
        return (lambda: ceilings.read_local(path)), (lambda: None)

    def remove(self, row: Row, root: str) -> None:
        """Delete a run's checkpoints (untimed, between runs)."""
        if row.storage == "gcs":
            from google.cloud import storage

            bucket, _, prefix = root.removeprefix("gs://").partition("/")
            client = storage.Client()
            for blob in client.list_blobs(bucket, prefix=prefix + "/"):
                with contextlib.suppress(Exception):
                    blob.delete()
        elif row.storage == "redis":
            import redis

            host, port = self.services.redis_address().rsplit(":", 1)
            prefix = root.removeprefix("redis://")
            with redis.Redis(host=host, port=int(port)) as db:
                for key in db.scan_iter(match=f"*{prefix}/*"):
                    db.delete(key)
        else:
            shutil.rmtree(root, ignore_errors=True)


def check_o_direct(directory: str) -> None:
    """Raise SystemExit, naming ``--local-dir``, where ``directory`` refuses ``O_DIRECT`` (tmpfs)."""
    probe = Path(directory) / f".odirect-{uuid.uuid4().hex[:6]}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError as err:
        raise SystemExit(f"{directory} does not take O_DIRECT ({err}); the local rows need a directory on a "
                         f"disk: give one with --local-dir") from None
    finally:
        probe.unlink(missing_ok=True)


# One run of a row -----------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One run of a row: its account, and what was measured beside it."""

    row: Row
    round: int
    account: RunAccount
    plain_saves_s: list[float]
    raw_read_s: list[float]
    dcp_load_s: list[float]
    checkpoint_bytes: int
    resumes_ok: int
    resumes: int
    save_kills_in_save: int
    save_kills: int
    notes: list[str] = field(default_factory=list)

    @property
    def raw_read_median_s(self) -> float:
        return statistics.median(self.raw_read_s)

    @property
    def dcp_load_floor_s(self) -> float | None:
        """A sharded checkpoint's own load cost, the fastest of its timings (see
        :func:`benchmarks.recovery.ceilings.sharded_load_seconds`: it moves by a third between
        timings); ``None`` for a single-file checkpoint."""
        return min(self.dcp_load_s, default=None)

    @property
    def load_floor_s(self) -> float:
        """The load part of a restart's ceiling: the raw read, and for a sharded checkpoint its own
        load cost (:attr:`dcp_load_floor_s`)."""
        return self.raw_read_median_s + (self.dcp_load_floor_s or 0.0)


class Launcher:
    """Starts the job's starts, forked from ``server`` or (without one) as fresh processes, and writes
    each launch to the run's event log."""

    def __init__(self, server: ForkServer | None) -> None:
        self.server = server
        self.kind = "fork" if server is not None else "process"
        self.process = ProcessLauncher()

    def start(self, config: JobConfig, log: EventLog) -> Job:
        launched = time.time()
        job = self.server.start_job(config) if self.server is not None else self.process.start(config)
        log.emit(LAUNCH_EVENT, source=INJECTOR, target=job.pid, time=launched, launcher=self.kind)
        return job


def run_row(row: Row, round_: int, settings: Settings, storages: Storages, launcher: Launcher,
            workdir: Path) -> RunResult:
    """Run ``row``'s job through the schedule to its end, then its plain saves and raw reads."""
    run = f"{row.key}-r{round_}-{uuid.uuid4().hex[:6]}"
    root = storages.root(row, run)
    if row.storage == "local":
        Path(root).mkdir(parents=True)
    path = str(workdir / f"{run}.jsonl")
    config = storages.config(row, root, path, settings)
    follower, log = LogFollower(path), EventLog(path)
    notes: list[str] = []
    save_kills = in_save = 0
    job: Job | None = None
    try:
        for disruption in settings.schedule:
            job = launcher.start(config, log)
            landed = disrupt(job, follower, log, disruption, settings)
            if disruption.kind == "sigkill-save":
                save_kills += 1
                in_save += landed
        # The last start trains to the end, then makes the plain saves (outside training, in a warm process).
        job = launcher.start(dataclasses.replace(config, plain_saves=settings.plain_saves,
                                                 dcp_loads=settings.raw_reads if row.strategy != "single" else 0), log)
        follower.wait_for(lambda e: of_process(job.pid, "exit")(e), RUN_TIMEOUT_S,
                          f"the end of {row.name}'s run (step {settings.max_steps}) and its plain saves", job=job)
        job.wait(60.0)
        events = read_events(path)
        ends = [e for e in events if of_process(job.pid, "exit")(e)]
        if not ends or ends[-1].get("reason") != "completed":
            raise RuntimeError(f"{row.name}'s last start did not complete: {ends[-1:]}{job.output_tail()}")
        plain = plain_saves(events, job.pid)
        if len(plain) != settings.plain_saves:
            raise RuntimeError(f"{row.name}'s last start made {len(plain)} plain saves, not {settings.plain_saves}")
        checkpoint = f"{config.checkpoint_dir}/last.ckpt"
        raw_times, size = raw_reads(storages, row, checkpoint, settings.raw_reads)
        dcp_loads = [e["seconds"] for e in events if of_process(job.pid, DCP_LOAD_EVENT)(e)]
    finally:
        if job is not None and job.poll() is None:  # a start left running by a failure
            job.send(signal.SIGKILL)
            job.wait(60.0)
        log.close()
        storages.remove(row, root)
    started = [e for e in events if e["event"] == "train_start" and e.get("rank", 0) == 0]
    checks = [check_resume(events, s) for s in started[1:]]
    for check in checks:
        if not check.ok:
            notes.append(f"resume not from the newest whole checkpoint: {check.describe()}")
    if save_kills and not in_save:
        notes.append("no kill of a save landed inside the save (the saves were faster than the kill)")
    return RunResult(row, round_, account(events), plain, raw_times, dcp_loads, size, sum(c.ok for c in checks),
                     len(checks), in_save, save_kills, notes)


def disrupt(job: Job, follower: LogFollower, log: EventLog, disruption: Disruption, settings: Settings) -> bool:
    """Wait for the disruption's moment in ``job``'s run, stop the job as it says, and wait for its end.
    Returns whether a kill meant for a save landed inside it (False for the other kinds)."""
    step = disruption.step(settings.every_n_steps)
    started = follower.wait_for(of_process(job.pid, "train_start"), START_TIMEOUT_S,
                                f"the training start of process {job.pid}", job=job)
    if disruption.kind == "sigkill-save":
        # A preemption just before may have resumed the job at this step: then the next save is the target.
        step = max(step, started["step"] + 1)
        begun = follower.wait_for(lambda e: of_process(job.pid, "save_start")(e) and e.get("step", 0) >= step
                                  and e.get("blocking", True), RUN_TIMEOUT_S,
                                  f"a save from step {step} on by process {job.pid}", job=job)
        done = [e["seconds"] for e in follower.events if e["event"] == "save_end" and "seconds" in e]
        due = save_kill_due(begun["time"], done)
        time.sleep(max(0.0, due - time.time()))
        sent = _kill(job, log, "save", due - begun["time"], begun)
        follower.poll()
        return not any(of_process(job.pid, "save_end")(e) and e["path"] == begun["path"] and e["time"] <= sent
                       for e in follower.events)
    if started["step"] >= step:
        raise RuntimeError(f"process {job.pid} resumed at step {started['step']}, at or past the schedule's "
                           f"{disruption.kind} at step {step}: give the schedule more room")
    reached = follower.wait_for(lambda e: of_process(job.pid, "step")(e) and e["step"] >= step, RUN_TIMEOUT_S,
                                f"step {step} of process {job.pid}", job=job)
    if disruption.kind == "sigkill":
        _kill(job, log, "step", 0.0, reached)
    else:
        preempt(job, follower, grace_s=settings.grace_s, log=log)
    return False


def save_kill_due(began: float, saves_s: Sequence[float]) -> float:
    """When the kill of a ``sigkill-save`` is due (``time.time()``): :data:`SAVE_KILL_FRACTION` of the
    run's shortest save so far (``saves_s``) after the save began at ``began``.

    From the save's own start, not from when the log showed it to the runner, and by the shortest save:
    a start's first save and a preemption's ``on_exception.ckpt`` run long, and an aim that counted them
    sent the kill after a short steady save had ended, sparing that row the disruption."""
    return began + (SAVE_KILL_FRACTION * min(saves_s) if saves_s else 0.0)


def _kill(job: Job, log: EventLog, point: str, delay: float, trigger: Mapping[str, Any]) -> float:
    """SIGKILL ``job``, record it in the log, wait for its end; returns when the signal was sent."""
    sent = time.time()
    job.send(signal.SIGKILL)
    log.emit(INJECT_EVENT, source=INJECTOR, action="SIGKILL", target=job.pid, point=point, delay_s=delay,
             trigger=trigger.get("event"), step=trigger.get("step"), sent=sent)
    job.wait(60.0)
    return sent


def raw_reads(storages: Storages, row: Row, path: str, repeat: int) -> tuple[list[float], int]:
    """Seconds of ``repeat`` raw reads of the checkpoint at ``path``, and its bytes."""
    read, close = storages.raw_reader(row, path)
    try:
        size = read()  # the first one also warms the connections, as a plugin's first load would not need
        return latencies_seconds(read, repeat), size
    finally:
        close()


def plain_saves(events: Sequence[Mapping[str, Any]], pid: int) -> list[float]:
    """Seconds of each save process ``pid`` made after its training ended (``train_end``): the plain
    saves, ``trainer.save_checkpoint`` of the trained state through the same plugin and path, outside
    the training loop, as ``benchmarks.lightning_ckpt`` times a save."""
    ended = next((e["time"] for e in events if of_process(pid, "train_end")(e)), None)
    if ended is None:
        return []
    return [e["seconds"] for e in events if of_process(pid, "save_end")(e) and e["time"] > ended]


# Results ------------------------------------------------------------------------------------------
def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ranged(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return spread(values)


def run_record(result: RunResult) -> dict[str, Any]:
    """The JSON record of one run: everything a row's summary is made from (:func:`summarize`), so
    that the records of several runs of the runner can be pooled (:func:`pool`)."""
    run_account = result.account
    restarts = []
    for restart in run_account.restarts:
        ceiling = restart.startup_s + result.load_floor_s if restart.to_first_step_s is not None else None
        restarts.append({
            "after": restart.disruption, "startup_s": restart.startup_s,
            "load_s": restart.load_s, "prep_s": restart.prep_s, "to_first_step_s": restart.to_first_step_s,
            "raw_read_s": result.raw_read_median_s, "dcp_load_s": result.dcp_load_floor_s, "ceiling_s": ceiling,
            "vs_ceiling": ratio(restart.to_first_step_s, ceiling), "resumed_step": restart.resumed_step,
            "ckpt_path": restart.ckpt_path, "lost_steps": restart.lost_steps, "lost_s": restart.lost_s,
        })
    return {
        "round": result.round, "total_s": run_account.total_s, "goodput": run_account.goodput,
        "seconds": dict(run_account.seconds), "fractions": run_account.fractions,
        "save_stalls_s": list(run_account.save_stalls_s), "first_save_stalls_s": list(run_account.first_save_stalls_s),
        "steady_save_stalls_s": list(run_account.steady_save_stalls_s),
        "plain_saves_s": result.plain_saves_s,
        "raw_read_s": result.raw_read_s, "dcp_load_s": result.dcp_load_s, "checkpoint_bytes": result.checkpoint_bytes,
        "steps_done": run_account.steps_done, "ideal_step_s": run_account.ideal_step_s,
        "resumes_ok": result.resumes_ok, "resumes": result.resumes,
        "save_kills_in_save": result.save_kills_in_save, "save_kills": result.save_kills,
        "notes": list(result.notes), "restarts": restarts,
        "progress": [list(p) for p in run_account.progress],
        "disruptions": [list(d) for d in run_account.disruptions],
    }


def row_summary(row: Row, runs: Sequence[RunResult], failures: Sequence[str], settings: Settings) -> dict[str, Any]:
    """The JSON row of one plugin: medians over its rounds (with min-max), and every round's record;
    ``failures`` are the runs that failed (their errors)."""
    return summarize(row_fields(row), [run_record(r) for r in runs], failures,
                     every_n_steps=settings.every_n_steps, max_steps=settings.max_steps)


ROW_FIELDS = ("key", "type", "plugin", "strategy", "storage", "baseline", "control_of")


def row_fields(row: Row) -> dict[str, Any]:
    """What a result's JSON row says of ``row`` itself (:data:`ROW_FIELDS`)."""
    values = (row.key, row.name, row.plugin, row.strategy, row.storage, row.baseline, row.control_of)
    return dict(zip(ROW_FIELDS, values, strict=True))


RECORD_FIELDS = ("round", "total_s", "goodput", "fractions", "steady_save_stalls_s", "first_save_stalls_s",
                 "plain_saves_s", "raw_read_s", "dcp_load_s", "checkpoint_bytes", "ideal_step_s", "resumes_ok",
                 "resumes", "save_kills_in_save", "save_kills", "notes", "restarts", "progress", "disruptions")


def summarize(fields: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], failures: Sequence[str], *,
              every_n_steps: int, max_steps: int) -> dict[str, Any]:
    """A row's summary from the records of its runs (:func:`run_record`): the row's ``fields``
    (:data:`ROW_FIELDS`), medians over the runs with their min-max, and the runs themselves."""
    if not runs:
        return {**fields, "rounds": 0, "failures": list(failures), "every_n_steps": every_n_steps,
                "goodput": None, "runs": [], "restarts": [], "notes": []}
    goodputs = [r["goodput"] for r in runs]
    fractions = {name: _median([r["fractions"][name] for r in runs]) for name in (GOODPUT, *BADPUT_TYPES)}
    stalls = [s for r in runs for s in r["steady_save_stalls_s"]]
    first_stalls = [s for r in runs for s in r["first_save_stalls_s"]]
    plain = [s for r in runs for s in r["plain_saves_s"][1:]]
    first_plain = [r["plain_saves_s"][0] for r in runs if r["plain_saves_s"]]
    restarts = [{"round": r["round"], **restart} for r in runs for restart in r["restarts"]]
    first_step = [x["to_first_step_s"] for x in restarts if x["to_first_step_s"] is not None]
    vs_ceiling = [x["vs_ceiling"] for x in restarts if x["vs_ceiling"] is not None]
    loads = [x["load_s"] for x in restarts if x["load_s"] is not None]
    lost = [x["lost_steps"] for x in restarts]
    return {
        **fields, "size_mb": _median([r["checkpoint_bytes"] / MB for r in runs]),
        "rounds": len(runs), "every_n_steps": every_n_steps, "max_steps": max_steps,
        "wall_s": _median([r["total_s"] for r in runs]),
        "goodput": _median(goodputs), "goodput_min": min(goodputs), "goodput_max": max(goodputs),
        "badput": {name: fractions[name] for name in BADPUT_TYPES},
        "save_stall_s": _ranged(stalls), "plain_save_s": _ranged(plain),
        "stall_vs_plain_save": ratio(_median(stalls), _median(plain)),
        "first_save_stall_s": _ranged(first_stalls), "first_plain_save_s": _ranged(first_plain),
        "first_stall_vs_first_plain_save": ratio(_median(first_stalls), _median(first_plain)),
        "load_s": _ranged(loads), "to_first_step_s": _ranged(first_step),
        "ceiling_s": _median([x["ceiling_s"] for x in restarts if x["ceiling_s"] is not None]),
        "first_step_vs_ceiling": _median(vs_ceiling), "first_step_vs_ceiling_max": max(vs_ceiling, default=None),
        "raw_read_s": _median([statistics.median(r["raw_read_s"]) for r in runs]),
        "dcp_load_s": _median([min(r["dcp_load_s"]) for r in runs if r["dcp_load_s"]]),
        "lost_steps_max": max(lost, default=0), "lost_steps": lost,
        "resumes_ok": sum(r["resumes_ok"] for r in runs), "resumes": sum(r["resumes"] for r in runs),
        "save_kills_in_save": sum(r["save_kills_in_save"] for r in runs),
        "save_kills": sum(r["save_kills"] for r in runs),
        "ideal_step_s": _median([r["ideal_step_s"] for r in runs]),
        "notes": [note for r in runs for note in r["notes"]], "failures": list(failures),
        "runs": [dict(r) for r in runs],
        "restarts": restarts,
    }


def pool(results: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> list[dict[str, Any]]:
    """Rows that pool the runs of several runs of the runner: ``results`` holds each one's JSON rows
    (with where they came from, for the errors). Each pooled row is summarized from every run of that
    row in all of them (its rounds renumbered in that order) and its ratios and bars come from those
    pooled medians, as if the runs had been one run of that many rounds.

    Raises:
        ValueError: fewer than two results; results whose rows or settings (but the rounds) differ,
            naming what differs; or rows written by a runner whose run records lack a field pooling needs.
    """
    if len(results) < 2:
        raise ValueError(f"pooling takes the results of two runs or more, got {len(results)}")
    (first_source, first), *others = results
    keys = [r["key"] for r in first]
    settings = _pooled_settings(first_source, first)
    for source, rows in others:
        theirs = [r["key"] for r in rows]
        if sorted(theirs) != sorted(keys):
            raise ValueError(f"{source} holds rows {theirs}, {first_source} holds {keys}: pool runs of the same rows")
        other = _pooled_settings(source, rows)
        for name in sorted(set(settings) | set(other)):
            if settings.get(name) != other.get(name):
                raise ValueError(f"{source} ran with {name}={other.get(name)!r}, {first_source} with "
                                 f"{name}={settings.get(name)!r}: pool runs of the same settings (but --rounds)")
    pooled = []
    for key in keys:
        runs: list[dict[str, Any]] = []
        failures: list[str] = []
        for source, rows in results:
            row = next(r for r in rows if r["key"] == key)
            for run in row["runs"]:
                missing = [name for name in RECORD_FIELDS if name not in run]
                if missing:
                    raise ValueError(f"{source}: the runs of row {key} lack {', '.join(missing)}: it was written by "
                                     f"an older runner; pool the results of runs made by this one")
                runs.append({**run, "round": len(runs)})
            failures += row.get("failures", [])
        template = next(r for r in first if r["key"] == key)
        pooled.append(summarize({name: template[name] for name in ROW_FIELDS}, runs, failures,
                                every_n_steps=settings["every_n_steps"], max_steps=settings["max_steps"]))
    add_ratios(pooled)
    return pooled


def _pooled_settings(source: str, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A result's settings, but the rounds (what pooling adds up)."""
    if not rows:
        raise ValueError(f"{source} holds no rows")
    try:
        settings = dict(rows[0]["context"]["settings"])
    except (KeyError, TypeError):
        raise ValueError(f"{source} is not the JSON of python -m benchmarks.recovery: its rows lack their "
                         f"context's settings") from None
    settings.pop("rounds", None)
    return settings


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's goodput and job time against its baseline's (the same storage's TorchCheckpointIO, or
    DCP's own writer), and whether it holds every bar (plugins only: the baselines are what they are
    held to).

    The job time (the wall time of the same steps under the same schedule) is shown beside goodput, not
    held to a bar: goodput counts a step's measured time as productive, so a row whose steps run slower
    (the machine busier during its rounds) gains goodput while it takes longer; the job time ratio and
    the ideal step of each row show when that is so.

    An A/A control's "baseline" is the row it copies: its ratios are this run's noise, and it is held to
    no bar.
    """
    by_key = {r["key"]: r for r in rows}
    for row in rows:
        base = by_key.get(row["baseline"])
        row["goodput_vs_baseline"] = ratio(row["goodput"], base and base["goodput"])
        row["wall_vs_baseline"] = ratio(row.get("wall_s"), base and base.get("wall_s"))
        if row["key"] == row["baseline"] or not row["runs"] or row["control_of"]:
            row["bars"] = None
            continue
        row["bars"] = {
            "save_stall": _holds(row["stall_vs_plain_save"], STALL_BAR, at_most=True),
            "restart": _holds(row["first_step_vs_ceiling"], FIRST_STEP_BAR, at_most=True),
            "progress_lost": row["lost_steps_max"] <= row["every_n_steps"],
            "goodput": _holds(row["goodput_vs_baseline"], GOODPUT_BAR, at_most=False),
        }


def _holds(value: float | None, bar: float, *, at_most: bool) -> bool | None:
    if value is None:
        return None
    return value <= bar if at_most else value >= bar


BADPUT_TITLES = {
    PROGRAM_STARTUP: "Start-up", CHECKPOINT_RESTORE: "Restore", TRAINING_PREP: "Prep", CHECKPOINT_SAVE: "Save",
    WASTED_PROGRESS: "Wasted", INFRASTRUCTURE_RECOVERY: "Recovery", OTHER: "Other",
}


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def _s_range(values: Mapping[str, float | None]) -> str | None:
    if values["median"] is None:
        return None
    return f"{values['median']:.2f} ({values['min']:.2f}-{values['max']:.2f})"


def _mark(row: Mapping[str, Any], bar: str) -> str:
    bars = row.get("bars")
    if not bars or bars[bar] is None:
        return ""
    return "" if bars[bar] else " FAIL"


def table_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The two tables' rows: goodput and badput (shares of the wall time), and the bars."""
    goodput = []
    bars = []
    for r in rows:
        if not r["runs"]:
            failed = f"failed in every round: {r['failures'][0].splitlines()[0][:80]}"
            goodput.append({"type": r["type"], "goodput": failed})
            bars.append({"type": r["type"], "stall": failed})
            continue
        goodput.append({
            "type": r["type"], "size": f"{r['size_mb']:.1f}", "wall": f"{r['wall_s']:.1f}",
            "goodput": f"{_pct(r['goodput'])} ({_pct(r['goodput_min'])}-{_pct(r['goodput_max'])})",
            **{name: _pct(r["badput"][name]) for name in BADPUT_TYPES},
        })
        x = r["goodput_vs_baseline"]
        bars.append({
            "type": r["type"],
            "stall": _s_range(r["save_stall_s"]), "plain": _s_range(r["plain_save_s"]),
            "stall_x": None if r["stall_vs_plain_save"] is None else
            f"{r['stall_vs_plain_save']:.2f}{_mark(r, 'save_stall')}",
            "first": None if r["first_save_stall_s"]["median"] is None else
            f"{r['first_save_stall_s']['median']:.2f} / {r['first_plain_save_s']['median']:.2f}",
            "restart": _s_range(r["to_first_step_s"]),
            "ceiling": None if r["ceiling_s"] is None else f"{r['ceiling_s']:.2f}",
            "first_x": None if r["first_step_vs_ceiling"] is None else
            f"{r['first_step_vs_ceiling']:.2f} (max {r['first_step_vs_ceiling_max']:.2f}){_mark(r, 'restart')}",
            "lost": f"{r['lost_steps_max']} of {r['every_n_steps']}{_mark(r, 'progress_lost')}",
            "goodput_x": None if x is None else f"{x:.3f} ({r['baseline']}){_mark(r, 'goodput')}",
            "step": f"{r['ideal_step_s']:.3f}",
            "wall_x": None if r["wall_vs_baseline"] is None else f"{r['wall_vs_baseline']:.3f}",
        })
    return goodput, bars


GOODPUT_COLUMNS = {"type": "Row", "size": "Ckpt MB", "wall": "Wall s", "goodput": "Goodput (min-max)",
                   **{name: BADPUT_TITLES[name] for name in BADPUT_TYPES}}
BAR_COLUMNS = {
    "type": "Row", "stall": "Save stall s (min-max)", "plain": "Plain save s", "stall_x": "Stall x plain",
    "first": "1st save of a start / plain s", "restart": "Restart to 1st step s", "ceiling": "Ceiling s",
    "first_x": "x ceiling", "lost": "Steps lost (max)",
    "goodput_x": "Goodput x baseline", "step": "Step s", "wall_x": "Job time x baseline",
}


def format_report(rows: Sequence[dict[str, Any]], table: Callable[..., str] = format_table) -> str:
    """Both tables (``table`` formats one: plain text or Markdown)."""
    goodput, bars = table_rows(rows)
    return f"{table(goodput, GOODPUT_COLUMNS)}\n\n{table(bars, BAR_COLUMNS)}"


def write_chart(path: str | os.PathLike[str], rows: Sequence[dict[str, Any]], title: str) -> Path:
    """The step counter over wall time, one line per row (its round of median goodput), each start's
    end marked: x for a SIGKILL, v for a preemption that ended in the job's own exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
    for index, row in enumerate(rows):
        if not row["runs"]:
            continue
        runs = sorted(row["runs"], key=lambda r: r["goodput"])
        run = runs[(len(runs) - 1) // 2]
        color = f"C{index % 10}"
        times = [p[0] for p in run["progress"]]
        steps = [p[1] for p in run["progress"]]
        ax.plot(times, steps, color=color, linewidth=1.2, drawstyle="steps-post",
                label=f"{row['type']}: goodput {100 * run['goodput']:.1f}%")
        for when, step, how in run["disruptions"]:
            ax.plot([when], [step], marker="x" if how == "SIGKILL" or how == "unknown" else "v", color=color,
                    markersize=7, linestyle="none")
    ax.set_xlabel("wall time since the first launch (s); x: SIGKILL, v: preemption (SIGTERM, the job exits)")
    ax.set_ylabel("global step")
    ax.set_title(title, fontsize=9, wrap=True)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# The command --------------------------------------------------------------------------------------
def run_rounds(rows: Sequence[Row], settings: Settings, storages: Storages, launcher: Launcher,
               workdir: Path) -> tuple[dict[str, list[RunResult]], dict[str, list[str]]]:
    """Every row once per round, the order rotating by one each round; a line as each run ends. A run
    that fails is reported (here and in the results) and the others go on."""
    results: dict[str, list[RunResult]] = {row.key: [] for row in rows}
    failures: dict[str, list[str]] = {row.key: [] for row in rows}
    started = time.monotonic()
    for round_ in range(settings.rounds):
        order = list(rows[round_ % len(rows):]) + list(rows[: round_ % len(rows)])
        for row in order:
            where = f"round {round_ + 1}/{settings.rounds}, {row.name}"
            try:
                result = run_row(row, round_, settings, storages, launcher, workdir)
            except (RuntimeError, TimeoutError, OSError) as err:
                failures[row.key].append(f"{type(err).__name__}: {err}")
                say(f"{where}: FAILED ({time.monotonic() - started:.0f} s in all): {_brief(failures[row.key][-1])}")
                continue
            results[row.key].append(result)
            say(f"{where}: goodput {100 * result.account.goodput:.1f}%, {result.account.total_s:.1f} s of training "
                f"job ({time.monotonic() - started:.0f} s in all)")
    return results, failures


def _brief(error: str) -> str:
    """An error's first line and, when it quotes a job's output, that output's last line."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} [...] {lines[-1].strip()}"


# What a run is made of, which --pool takes from the results it pools instead.
RUN_OPTIONS = ("rows", "aa", "rounds", "size_mb", "width", "every_n_steps", "max_steps", "step_time_s", "schedule",
               "grace_s", "plain_saves", "raw_reads", "launcher", "local_dir", "logs")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.recovery", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Rows for --rows: " + ", ".join(f"{r.key} = {r.name}" for r in ROWS.values())
               + f". Schedule kinds: {', '.join(DISRUPTIONS)}.",
    )
    defaults = Settings()
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated rows to run")
    parser.add_argument("--aa", metavar="ROWS",
                        help="comma-separated rows of --rows to run twice: each copy (an A/A control) is "
                             "compared with its original as a plugin with its baseline, which shows how far "
                             "this run's noise alone moves those ratios")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="interleaved rounds of every row")
    parser.add_argument("--size-mb", type=float, default=defaults.size_mb,
                        help="the checkpoint's size in MiB, about (weights and AdamW's two moments)")
    parser.add_argument("--width", type=int, default=defaults.width,
                        help="the model's layer width (its layers are as many as make --size-mb)")
    parser.add_argument("--every-n-steps", type=int, default=defaults.every_n_steps,
                        help="a checkpoint every this many steps (the checkpoint interval)")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps, help="steps of the whole run")
    parser.add_argument("--step-time-s", type=float, default=defaults.step_time_s,
                        help="what each step waits besides its compute, standing for a real model's step")
    parser.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                        help="the disruptions, KIND@INTERVALS in order: sigkill (at a step), sigterm (a "
                             "preemption: SIGTERM, SIGKILL after --grace-s), sigkill-save (in the save of the "
                             "first checkpoint from that step on); positions in checkpoint intervals")
    parser.add_argument("--grace-s", type=float, default=defaults.grace_s,
                        help="seconds from a preemption's SIGTERM to its SIGKILL (GCE spot VMs and GKE: 30)")
    parser.add_argument("--plain-saves", type=int, default=defaults.plain_saves,
                        help="plain saves per row and round, the reference of the save stalls")
    parser.add_argument("--raw-reads", type=int, default=defaults.raw_reads,
                        help="raw reads of each run's last checkpoint, the load part of a restart's ceiling")
    parser.add_argument("--launcher", choices=LAUNCHERS, default=defaults.launcher,
                        help="fork: every start forked from a process that imported torch, Lightning and the "
                             "plugins once; process: python -m benchmarks.recovery.job, imports included")
    parser.add_argument("--local-dir", help="directory for the local rows; it must take O_DIRECT "
                                            "(default: a temporary directory)")
    parser.add_argument("--logs", metavar="DIR", help="keep every run's event log and output here")
    parser.add_argument("--json", metavar="PATH", default=DEFAULT_JSON,
                        help="write the rows as a JSON list here, the tables as Markdown (.md) and the chart "
                             "(.png) next to it")
    parser.add_argument("--chart", metavar="PATH", help="write the PNG chart here (default: the JSON path with .png)")
    parser.add_argument("--pool", nargs="+", metavar="JSON",
                        help="run nothing: pool the runs in these results of earlier runs (the same rows and "
                             "settings but --rounds) into one result, its medians, ratios and bars over all their "
                             "rounds, written to --json as a run's would be")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the services and plugins do")
    args = parser.parse_args(argv)
    if args.pool:
        given = [f"--{name.replace('_', '-')}" for name in RUN_OPTIONS if getattr(args, name) != parser.get_default(name)]
        if given:
            parser.error(f"--pool reads the rows and settings from its results: {', '.join(given)} does not apply")
        if len(args.pool) < 2:
            parser.error("--pool takes the results of two runs or more")
        if {p.resolve() for p in output_paths(args)} & {Path(p).resolve() for p in args.pool}:
            parser.error(f"--json {args.json} would overwrite one of the results --pool reads")
        return args
    try:
        keys = split_choices(args.rows, list(ROWS), "--rows")
        copied = [] if args.aa is None else split_choices(args.aa, keys, "--aa")
    except SystemExit as err:
        parser.error(str(err))
    args.rows = [ROWS[k] for k in keys]
    args.rows += [ROWS[k].control() for k in copied]
    try:
        args.settings = Settings(size_mb=args.size_mb, width=args.width, every_n_steps=args.every_n_steps,
                                 max_steps=args.max_steps,
                                 step_time_s=args.step_time_s, schedule=parse_schedule(args.schedule),
                                 grace_s=args.grace_s, rounds=args.rounds, plain_saves=args.plain_saves,
                                 raw_reads=args.raw_reads, launcher=args.launcher)
    except ValueError as err:
        parser.error(str(err))
    return args


def configure_console(verbose: bool) -> None:
    """Warnings only, unless ``verbose``: the console shows the progress and the tables."""
    from benchmarks.report import quiet_self_printing_loggers

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:
        quiet_self_printing_loggers()


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _workdir(keep: str | None) -> Iterator[Path]:
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as name:
        yield Path(name)


def say(text: str) -> None:
    """A progress line on standard error (the tables go to standard output)."""
    print(text, file=sys.stderr, flush=True)


def pooled(paths: Sequence[str]) -> tuple[list[dict[str, Any]], Settings]:
    """The rows of :func:`pool` over the JSON results at ``paths``, and the settings they ran with (their
    rounds added up); each row's context names the results it pools."""
    results = []
    for path in paths:
        try:
            rows = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read the results {path}: {err}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path} is not the JSON of python -m benchmarks.recovery: not a list of rows")
        results.append((str(path), rows))
    rows = pool(results)
    settings = dataclasses.replace(Settings.from_record(results[0][1][0]["context"]["settings"]),
                                   rounds=max(r["rounds"] for r in rows))
    context = {"settings": settings.record(),
               "elapsed_s": sum(r[0]["context"].get("elapsed_s", 0.0) for _, r in results),
               "pooled_from": [str(p) for p in paths]}
    for row in rows:
        row["context"] = context
    return rows, settings


def output_paths(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """Where the results go: the JSON (``--json``), its tables as Markdown beside it, and the chart
    (``--chart``, else beside the JSON)."""
    json_path = Path(args.json)
    return json_path, json_path.with_suffix(".md"), Path(args.chart or json_path.with_suffix(".png"))


def write_results(args: argparse.Namespace, summaries: list[dict[str, Any]], header: str, done: str) -> None:
    """The tables on the console, each row's notes and failures on standard error, and the JSON, its
    tables as Markdown and the chart at the paths ``args`` names; ``done`` opens the closing line."""
    print()
    print(format_report(summaries))
    for summary in summaries:
        for note in summary["notes"] + [f"a run failed: {_brief(failure)}" for failure in summary["failures"]]:
            say(f"{summary['type']}: {note}")
    json_path, markdown, chart_path = output_paths(args)
    write_json(json_path, summaries)
    markdown.write_text(f"{header}\n\n{format_report(summaries, format_markdown_table)}\n")
    chart = write_chart(chart_path, summaries, header)
    print(f"\n{done}; rows: {args.json} (tables as Markdown: {markdown}); chart: {chart}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_console(args.verbose)
    if args.pool:
        try:
            summaries, settings = pooled(args.pool)
        except ValueError as err:
            say(f"python -m benchmarks.recovery: error: {err}")
            return 2
        header = (f"Goodput under kills and preemptions, pooled from {len(args.pool)} runs: "
                  f"{settings.describe()}")
        say(header)
        write_results(args, summaries, header, f"{len(summaries)} rows x {settings.rounds} rounds pooled")
        return 0
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    settings: Settings = args.settings
    rows: list[Row] = args.rows
    header = f"Goodput under kills and preemptions: {settings.describe()}"
    started = time.monotonic()
    try:
        # fake-gcs-server's memory backend: its filesystem backend keeps each object in a file of its
        # name, so it cannot hold a sharded checkpoint's commit record beside the objects under its prefix.
        with Services(ServiceOptions(local_dir=args.local_dir, emulator_backend="memory")) as services, \
                ExitStack() as stack:
            storages = Storages(services)
            say("starting the services: " + ", ".join(sorted({r.storage for r in rows})))
            storages.start(rows)
            workdir = stack.enter_context(_workdir(args.logs))
            server = None
            if settings.launcher == "fork":
                say("starting the fork server: it imports torch, Lightning and the plugins once "
                    "(a minute on a busy 2-core machine)")
                server = stack.enter_context(ForkServer())
            say(header)
            results, failures = run_rounds(rows, settings, storages, Launcher(server), workdir)
    except KeyboardInterrupt:
        say("interrupted; services stopped")
        return 130
    summaries = [row_summary(row, results[row.key], failures[row.key], settings) for row in rows]
    add_ratios(summaries)
    elapsed = time.monotonic() - started
    context = {"settings": settings.record(), "elapsed_s": elapsed}
    for summary in summaries:
        summary["context"] = context
    write_results(args, summaries, header, f"{len(rows)} rows x {settings.rounds} rounds in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

