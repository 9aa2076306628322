"""The recovery job in tests: where each plugin's run keeps its checkpoints, what temporaries are left
there and by whom, and a round of kill-and-restart that checks each resume against the event log."""

from __future__ import annotations

import dataclasses
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from benchmarks.recovery.events import (
    ForkServer,
    Injection,
    Job,
    LogFollower,
    ResumeCheck,
    check_resume,
    of_process,
)
from benchmarks.recovery.job import CHECKPOINT_SUBDIR, EventLog, JobConfig
from lightning_storage_plugins.dcp import LOCK_NAME
from lightning_storage_plugins.owners import Owner
from tests.support.files import files_under

# The single-file plugins each event is tried with (the baselines run once: tests/recovery/test_job.py).
EVENT_PLUGINS = ["dataflux", "fastpersist-aio", "fastpersist-python", "smartredis"]
# Every test run of the job: checkpoints of about 2 MiB, a save every 2 steps, steps of 20 ms.
TEST_JOB = {"size_mb": 2.0, "every_n_steps": 2, "step_time_s": 0.02, "io_buffer_mb": 4,
            "transfer_chunk_kib": 256, "transfer_workers": 2}
START_TIMEOUT_S = 180.0
_FASTPERSIST_TEMP = re.compile(r"^\..+\.(?P<pid>\d+)-[0-9a-f]+\.fastpersist\.tmp$")
_PARTS = re.compile(r"\.dataflux-parts/[0-9a-f]{32}-\d+s(?:-(?P<owner>[0-9a-z.]+))?/")


@dataclass
class Storage:
    """Where one plugin's run keeps its checkpoints, and how to look at them from the test."""

    plugin: str
    root: str
    gcs_url: str | None = None
    redis_address: str | None = None
    _gcs: Any = field(default=None, repr=False)

    def config(self, log: str | os.PathLike[str], **overrides: Any) -> JobConfig:
        """The job's config for this storage, with the tests' small sizes."""
        return JobConfig(plugin=self.plugin, root=self.root, event_log=os.fspath(log), gcs_url=self.gcs_url,
                         redis_address=self.redis_address, **{"max_steps": 100_000, **TEST_JOB, **overrides})

    def _bucket(self) -> tuple[Any, str]:
        from google.cloud import storage

        if self._gcs is None:
            self._gcs = storage.Client()
        bucket, _, prefix = self.root[len("gs://"):].partition("/")
        return self._gcs.bucket(bucket), prefix

    def names(self) -> list[str]:
        """Every file, object or key under the run's root, relative to it."""
        if self.root.startswith("gs://"):
            bucket, prefix = self._bucket()
            return sorted(blob.name[len(prefix) + 1:] for blob in bucket.list_blobs(prefix=prefix + "/"))
        if self.root.startswith("redis://"):
            import redis

            host, port = self.redis_address.rsplit(":", 1)
            prefix = self.root[len("redis://"):]
            with redis.Redis(host=host, port=int(port)) as db:
                return sorted(key.decode()[len(prefix) + 1:] for key in db.scan_iter(match=f"{prefix}/*"))
        return files_under(self.root)

    def temporaries(self) -> dict[str, int | None]:
        """Each temporary a save left under the root (part objects, temporary files, keys that are not
        checkpoints), with the pid of the process that made it where its name says (else None)."""
        found: dict[str, int | None] = {}
        for name in self.names():
            base = name.rsplit("/", 1)[-1]
            if match := _PARTS.search(name):
                owner = Owner.from_token(match["owner"]) if match["owner"] else None
                found[name] = owner.pid if owner is not None else None
            elif match := _FASTPERSIST_TEMP.match(base):
                found[name] = int(match["pid"])
            elif self.root.startswith("redis://") and not base.endswith(".ckpt"):
                found[name] = None
        return found

    def first_part(self, path: str) -> bool:
        """Whether the save of ``path`` (gs://) has its first part object in the bucket yet."""
        bucket, _ = self._bucket()
        key = path[len("gs://"):].split("/", 1)[1]
        return any(True for _ in bucket.list_blobs(prefix=key + ".dataflux-parts/", max_results=1))

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.root}/{CHECKPOINT_SUBDIR}"


@dataclass
class Round:
    """One start of the job: how it resumed, and what stopped it."""

    index: int
    job: Job
    started: Mapping[str, Any]
    resume: ResumeCheck
    leftovers: dict[str, int | None]
    injection: Injection | None = None


class Rounds:
    """Starts of one run of the job, each checked when it starts: it resumed from the checkpoint the log
    names (:func:`~benchmarks.recovery.events.check_resume`), and no temporary of an earlier, dead start is
    left in the storage (the start's sweep removed them)."""

    def __init__(self, server: ForkServer | None, storage: Storage, log: str | os.PathLike[str], seed: int) -> None:
        self.server = server
        self.storage = storage
        self.log_path = os.fspath(log)
        self.follower = LogFollower(self.log_path)
        self.log = EventLog(self.log_path)
        self.rng = random.Random(seed)
        self.rounds: list[Round] = []

    def start(self, config: JobConfig, *, slurm: bool = False) -> Round:
        """Fork a start of the job and wait until it trains; check its resume and the leftovers."""
        assert self.server is not None, "rounds without a fork server start no job"
        job = self.server.start_job(config)
        started = self.follower.wait_for(of_process(job.pid, "train_start"), START_TIMEOUT_S,
                                         f"the training start of process {job.pid}", job=job)
        resume = check_resume(self.follower.events, started, slurm=slurm)
        leftovers = {name: pid for name, pid in self.storage.temporaries().items() if pid != job.pid}
        current = Round(len(self.rounds), job, started, resume, leftovers)
        self.rounds.append(current)
        return current

    def assert_resumed(self, current: Round) -> None:
        """The round resumed where the log says."""
        assert current.resume.ok, f"round {current.index}: {current.resume.describe()}"

    def assert_sound(self, current: Round) -> None:
        """The round resumed where the log says, and no dead start's temporary was left."""
        self.assert_resumed(current)
        assert not current.leftovers, (f"round {current.index}: temporaries of dead starts left after the restart's "
                                       f"sweep: {current.leftovers}")

    def each_point(self, config: JobConfig, events: int, points: list[str]) -> Iterator[tuple[int, str, Round]]:
        """Start the job ``events + 1`` times (the last start checks the last event), each for the next
        of ``points`` (behind ``AsyncCheckpointIO`` for ``async_save``); yield the round's index, point
        and start once it is checked (:meth:`assert_sound`), for the caller's event."""
        for index in range(events + 1):
            point = points[index % len(points)]
            current = self.start(replace(config, async_save=point == "async_save"))
            self.assert_sound(current)
            yield index, point, current

    def summary(self) -> str:
        lines = []
        for r in self.rounds:
            injection = r.injection
            what = (f"{injection.action} at {injection.point} +{injection.delay_s:.3f}s "
                    f"after {injection.trigger and injection.trigger.get('event')}") if injection else "-"
            lines.append(f"round {r.index}: started at step {r.started['step']}, then {what}")
        return "\n".join(lines)


def interrupted(events: list[Mapping[str, Any]], injection: Injection) -> list[Mapping[str, Any]]:
    """The saves of the injection's target that were started and not finished when it was stopped."""
    return in_flight(events, injection.pid, float("inf"))


def in_flight(events: list[Mapping[str, Any]], pid: int, moment: float) -> list[Mapping[str, Any]]:
    """The saves of process ``pid`` that had started and not finished at ``moment``."""
    open_saves: dict[str, Mapping[str, Any]] = {}
    for event in events:
        if event.get("pid") != pid or event.get("source") == "injector" or event["time"] >= moment:
            continue
        if event["event"] == "save_start":
            open_saves[event["path"]] = event
        elif event["event"] in ("save_end", "save_error"):
            open_saves.pop(event["path"], None)
    return list(open_saves.values())


def replace(config: JobConfig, **changes: Any) -> JobConfig:
    return dataclasses.replace(config, **changes)


def points_for(plugin: str) -> list[str]:
    """The kill points that apply to a plugin: a step, a save and an async save; an upload on gs://."""
    return ["step", "save", "async_save"] + (["upload"] if plugin == "dataflux" else [])


def first_part_of(storage: Storage) -> Callable[[str], bool] | None:
    return storage.first_part if storage.root.startswith("gs://") else None


def attempt_started(follower: LogFollower, job: Job, attempt: int, ranks: int,
                    timeout: float = START_TIMEOUT_S) -> dict[int, Mapping[str, Any]]:
    """The ``train_start`` of each rank of restart ``attempt`` of an elastic job, waited for."""
    started: dict[int, Mapping[str, Any]] = {}
    for rank in range(ranks):
        def of_attempt(event: Mapping[str, Any], rank: int = rank) -> bool:
            return (event["event"] == "train_start" and event.get("rank", 0) == rank
                    and any(e["event"] == "start" and e["pid"] == event["pid"] and e.get("attempt") == attempt
                            for e in follower.events))
        started[rank] = follower.wait_for(of_attempt, timeout, f"rank {rank} training in attempt {attempt}",
                                          job=job, since=0)
    return started


def sharded_leftovers(storage: Storage, follower: LogFollower, live: set[int]) -> tuple[list[str], list[str]]:
    """What killed sharded saves left under the checkpoint directory, not counting what processes in
    ``live`` may be writing: checkpoints without ``.metadata`` that hold shards (a save that never
    published), FastPersist temporary files and Dataflux part objects of dead processes; and, apart,
    the directories that hold nothing but the DCP save lock (``.dcp-save.lock``) of a save killed before
    it wrote anything there. The storage is listed first, then the log read: a save that wrote something
    listed had logged its start by then."""
    names = [name for name in storage.names() if name.startswith(CHECKPOINT_SUBDIR + "/")]
    temporaries = storage.temporaries()
    follower.poll()
    in_progress = {e["path"].rstrip("/").rsplit("/", 1)[-1] for e in follower.events
                   if e["event"] == "save_start" and e.get("pid") in live}
    checkpoints: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("/")
        checkpoints.setdefault(parts[1], []).append("/".join(parts[2:]))
    left, lock_only = [], []
    for checkpoint, files in sorted(checkpoints.items()):
        if ".metadata" in files or checkpoint in in_progress:
            continue
        if files == [LOCK_NAME]:
            lock_only.append(checkpoint)
        else:
            left.append(f"{checkpoint}: no .metadata, {sorted(files)}")
    for name, pid in temporaries.items():
        if pid not in live:
            left.append(name)
    return left, lock_only


def expect_no_leftovers(plugin: str, leftovers: Mapping[int, Any]) -> None:
    """Fail on what killed saves left when restarts began (by restart): each restart's sweep, when
    training starts, removes what saves that are over left, sharded (DCP) saves included."""
    assert not leftovers, f"{plugin}: leftovers of killed saves when restarts began: {leftovers}"


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it: torchrun starts each rank in a session of its own, so
    killing its process group leaves the ranks running."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=30)
