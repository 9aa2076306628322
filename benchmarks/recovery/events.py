"""Events that stop the recovery job, ways to start it, and the reader of its event log.

Starting the job:

* :class:`ProcessLauncher`: ``python -m benchmarks.recovery.job`` in a fresh process, as a user starts
  it (the start-up, imports included, is part of what a restart costs);
* :class:`ForkServer`: a process that imports torch, Lightning and the plugins once and forks every
  start of the job from there (a fraction of a second instead of the imports' tens of seconds on a
  busy machine), and runs torch's elastic agent (what ``torchrun`` runs) the same way, its ranks forked
  from it. Tests use it to run many rounds.

Both give a :class:`Job` (a process to signal, poll and wait for). The events, each a function that
waits for its moment in the event log (never a blind sleep), then acts:

* :func:`kill_at`: SIGKILL at a point of a step, a save, an async save or an upload, after a seeded
  random delay past the event that starts it;
* :func:`preempt`: SIGTERM, then SIGKILL once the grace period is over (GCE spot VMs and Kubernetes
  pods give 30 s), as Lightning's ``SIGTERMException`` and ``OnExceptionCheckpoint`` meet it;
* :func:`slurm_requeue`: Slurm's requeue signal (``scancel --signal=USR1``, what
  ``sbatch --signal=USR1@90`` sends before the time limit) to a job running with
  ``SLURMEnvironment(auto_requeue=True)``, which saves ``hpc_ckpt_N`` and requeues itself; then the
  requeued job is let start at once (Slurm holds it about two minutes);
* :func:`kill_rank`: SIGKILL of one rank under torch's elastic agent, which restarts every rank.

Each event is also written to the job's event log (``"event": "inject"``, ``"source": "injector"``), so
that the log tells the whole story. :class:`LogFollower` reads the log as it grows; :func:`whole_checkpoints`,
:func:`expected_resume` and :func:`check_resume` say from which checkpoint a restart must start, and
whether it did.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.recovery.job import ON_EXCEPTION_NAME, EventLog, JobConfig

POLL_INTERVAL_S = 0.02
KILL_POINTS = ("step", "save", "async_save", "upload")
DEFAULT_GRACE_S = 30.0  # GCE spot VMs' and GKE's default termination grace period
# A point's random delay when the log has no earlier duration to go by.
DEFAULT_POINT_S = {"step": 0.05, "save": 0.3, "async_save": 0.3, "upload": 0.3}
_HPC_RE = re.compile(r"(?:^|/)hpc_ckpt_(\d+)\.ckpt$")
_LAST_RE = re.compile(rf"(?:^|/)(?:last(?:-v\d+)?|{ON_EXCEPTION_NAME})\.ckpt$")


class JobTimeoutError(TimeoutError):
    """The job did not reach an event, or did not exit, in time; the message says what was waited for."""


class JobExitedError(RuntimeError):
    """The job exited while an event was waited for; the message says which and how it exited."""


# -- the event log -------------------------------------------------------------------------------


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete line of an event log, in order (a line a killed process left half-written is skipped)."""
    with contextlib.suppress(FileNotFoundError):
        return LogFollower(path).poll()
    return []


class LogFollower:
    """Reads an event log as it grows: :meth:`poll` returns the events written since the last call,
    :meth:`wait_for` waits for one; :attr:`events` holds every event read so far, and :attr:`cursor` is
    the index after the last one :meth:`wait_for` found."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.events: list[dict[str, Any]] = []
        self.cursor = 0
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        """The events written since the last call."""
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self._offset)
                data = stream.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            with contextlib.suppress(ValueError):
                new.append(json.loads(line))
        self.events.extend(new)
        return new

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str, *,
                 job: Job | None = None, since: int | None = None) -> dict[str, Any]:
        """The first event for which ``predicate`` is true, among those read from index ``since`` of
        :attr:`events` on (default: those not read yet); :attr:`cursor` is then the index after it.

        Args:
            predicate: the test of an event.
            timeout: seconds to wait.
            what: what is waited for, for the error message.
            job: fail at once if this job exits first.
            since: where in :attr:`events` to start looking (0: every event read so far).

        Raises:
            JobTimeoutError: no such event within ``timeout``.
            JobExitedError: ``job`` exited first.
        """
        index = len(self.events) if since is None else since
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            while index < len(self.events):
                index += 1
                if predicate(self.events[index - 1]):
                    self.cursor = index
                    return self.events[index - 1]
            if job is not None and job.poll() is not None:
                if self.poll():  # what it wrote just before it exited
                    continue
                raise JobExitedError(f"job {job.pid} exited with code {job.poll()} while waiting for {what}"
                                     f"{job.output_tail()}")
            if time.monotonic() > deadline:
                tail = job.output_tail() if job is not None else ""
                raise JobTimeoutError(f"no {what} within {timeout:.0f} s in {self.path}{tail}")
            time.sleep(POLL_INTERVAL_S)


def of_process(pid: int, event: str | Iterable[str] | None = None) -> Callable[[dict[str, Any]], bool]:
    """A predicate: an event of process ``pid`` (of kind ``event``, one of them, or any)."""
    kinds = {event} if isinstance(event, str) else set(event) if event is not None else None
    return lambda e: e.get("pid") == pid and e.get("source") != "injector" and (kinds is None or e["event"] in kinds)


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint a save finished writing (``save_end``), or one in flight when its process died."""

    path: str
    step: int
    digest: str | None
    time: float
    rank: int = 0
    whole: bool = True


def is_last_candidate(path: str) -> bool:
    """Whether ``ckpt_path="last"`` considers ``path``: ``last.ckpt`` (``last-vN.ckpt``) or ``on_exception.ckpt``."""
    return bool(_LAST_RE.search(path.rstrip("/")))


def hpc_number(path: str) -> int | None:
    """N of Lightning's ``hpc_ckpt_N.ckpt``, or None."""
    match = _HPC_RE.search(path.rstrip("/"))
    return int(match.group(1)) if match else None


def _finished_saves(events: Iterable[Mapping[str, Any]], rank: int) -> dict[str, list[SavedCheckpoint]]:
    """Each path's finished saves by ``rank``, oldest first, forgotten when the path is removed."""
    finished: dict[str, list[SavedCheckpoint]] = {}
    for event in events:
        if event.get("rank", 0) != rank or event.get("source") == "injector":
            continue
        if event["event"] == "save_end":
            finished.setdefault(event["path"], []).append(
                SavedCheckpoint(event["path"], event["step"], event.get("digest"), event["time"], rank))
        elif event["event"] == "remove":
            finished.pop(event["path"], None)
    return finished


def whole_checkpoints(events: Iterable[Mapping[str, Any]], *, rank: int = 0) -> dict[str, SavedCheckpoint]:
    """The checkpoints the log says are whole after ``events`` (``rank``'s part of them): for each path,
    its last finished save, unless it was removed after. A save that was started again and not finished
    leaves the earlier one whole (the plugins publish a save in one step)."""
    return {path: saves[-1] for path, saves in _finished_saves(events, rank).items()}


def unfinished_saves(events: Sequence[Mapping[str, Any]], *, rank: int = 0) -> list[SavedCheckpoint]:
    """Saves the log shows started and not finished: those a signal, a kill or the end of a grace period
    interrupted, and those that failed on this rank. Any of them may have been published whole: just
    before its process died, or, for a sharded save, by the coordinating rank before another rank died
    and this rank's part of the save failed on it."""
    open_saves: dict[tuple[int, str], Mapping[str, Any]] = {}
    for event in events:
        if event.get("rank", 0) != rank or event.get("source") == "injector":
            continue
        key = (event["pid"], event.get("path", ""))
        if event["event"] == "save_start":
            open_saves[key] = event
        elif event["event"] == "save_end":
            open_saves.pop(key, None)
    return [SavedCheckpoint(e["path"], e["step"], e.get("digest"), e["time"], rank, whole=False)
            for e in open_saves.values()]


def finished_where_another_rank_died(events: Sequence[Mapping[str, Any]], *, rank: int = 0,
                                     ranks: int = 1) -> list[SavedCheckpoint]:
    """Sharded saves ``rank`` finished whose step another rank started and never finished: that rank
    may have died after the save was published whole (the coordinating rank between its commit, which
    lets the others return, and its own record of the end)."""
    interrupted = {(save.path, save.step) for other in range(ranks) if other != rank
                   for save in unfinished_saves(events, rank=other)}
    return [saves[-1] for path, saves in _finished_saves(events, rank).items()
            if (path, saves[-1].step) in interrupted]


def expected_resume(events: Sequence[Mapping[str, Any]], *, slurm: bool = False, rank: int = 0,
                    ranks: int = 1) -> SavedCheckpoint | None:
    """The checkpoint a restart after ``events`` must resume from, by the log: the newest whole one that
    ``ckpt_path="last"`` considers (``last.ckpt``, ``on_exception.ckpt``; Lightning takes the one
    modified last), or under Slurm's auto-requeue the ``hpc_ckpt_N`` of the highest N (Lightning's own
    choice, whatever is newer); None when there is none. A sharded checkpoint of ``ranks`` ranks is
    whole when every rank finished its save of that step (one rank's save that returned while another
    rank had died is not). Returns ``rank``'s record of it."""
    finished = [_finished_saves(events, r) for r in range(ranks)]

    def whole(path: str) -> SavedCheckpoint | None:
        for saved in reversed(finished[rank].get(path, [])):
            if all(any(other.step == saved.step for other in finished[r].get(path, [])) for r in range(ranks)):
                return saved
        return None

    candidates = [c for c in map(whole, finished[rank]) if c is not None]
    if slurm:
        hpc = [c for c in candidates if hpc_number(c.path) is not None]
        if hpc:
            return max(hpc, key=lambda c: hpc_number(c.path) or 0)
    last = [c for c in candidates if is_last_candidate(c.path)]
    return max(last, key=lambda c: c.time) if last else None


@dataclass(frozen=True)
class ResumeCheck:
    """How one start of the job resumed, against what the log before it says it must resume from."""

    started: Mapping[str, Any]
    expected: SavedCheckpoint | None
    allowed: tuple[SavedCheckpoint, ...]
    matched: SavedCheckpoint | None

    @property
    def ok(self) -> bool:
        """Resumed from the expected checkpoint, or from a newer one whose save the log does not show
        finished and that was published whole all the same (the same step and state as its save started
        with); from step 0 only when nothing whole existed."""
        if self.expected is None and self.started["step"] == 0 and not self.started.get("ckpt_path"):
            return True
        return self.matched is not None

    def describe(self) -> str:
        expected = (f"{self.expected.path} at step {self.expected.step}" if self.expected else "no checkpoint")
        return (f"process {self.started['pid']} started at step {self.started['step']} from "
                f"{self.started.get('ckpt_path')} (digest {self.started.get('digest')}); the log says the newest whole "
                f"checkpoint is {expected}; also allowed: "
                f"{[(c.path, c.step) for c in self.allowed if c != self.expected]}")


def check_resume(events: Sequence[Mapping[str, Any]], started: Mapping[str, Any], *,
                 slurm: bool = False, ranks: int = 1) -> ResumeCheck:
    """Whether the ``train_start`` event ``started`` resumed from the checkpoint the events before it name
    (for its rank, of ``ranks``): the same step and the same state digest (no mixed or partial
    checkpoint)."""
    rank = started.get("rank", 0)
    before = [e for e in events if e["time"] < started["time"] and e.get("pid") != started["pid"]]
    expected = expected_resume(before, slurm=slurm, rank=rank, ranks=ranks)
    # A save in flight when its process died may have been published whole just before: newer, allowed.
    allowed = [expected] if expected else []
    if not (slurm and expected is not None and hpc_number(expected.path) is not None):
        allowed += [save for save in [*unfinished_saves(before, rank=rank),
                                      *finished_where_another_rank_died(before, rank=rank, ranks=ranks)]
                    if is_last_candidate(save.path) and (expected is None or save.time > expected.time)]
    if slurm:
        allowed += [save for save in unfinished_saves(before, rank=rank) if hpc_number(save.path) is not None
                    and (expected is None or (hpc_number(save.path) or 0) > (hpc_number(expected.path) or 0))]
    matched = next((c for c in allowed if c.step == started["step"]
                    and (c.digest is None or c.digest == started.get("digest"))), None)
    return ResumeCheck(started, expected, tuple(allowed), matched)


# -- starting the job ----------------------------------------------------------------------------


class Job(Protocol):
    """A started job (one process: the job itself, or torch's elastic agent of its ranks)."""

    pid: int

    def poll(self) -> int | None:
        """Its exit code (a signal's as ``-signum``), or None while it runs."""

    def wait(self, timeout: float) -> int:
        """Wait for its exit and return its code. Raises JobTimeoutError."""

    def send(self, signum: int) -> None:
        """Send it a signal (nothing when it is gone)."""

    def output_tail(self, max_bytes: int = 3000) -> str:
        """The end of what it printed, for error messages."""


def _wait(job: Job, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (code := job.poll()) is None:
        if time.monotonic() > deadline:
            raise JobTimeoutError(f"job {job.pid} did not exit within {timeout:.0f} s{job.output_tail()}")
        time.sleep(POLL_INTERVAL_S)
    return code


def _tail(path: str | None, max_bytes: int) -> str:
    if not path:
        return ""
    with contextlib.suppress(OSError), open(path, "rb") as stream:
        stream.seek(0, os.SEEK_END)
        stream.seek(max(0, stream.tell() - max_bytes))
        return "; its output ends:\n" + stream.read().decode(errors="replace")
    return ""


class ProcessJob:
    """The job as a child process of this one (:class:`ProcessLauncher`)."""

    def __init__(self, process: subprocess.Popen[bytes], output: str) -> None:
        self._process = process
        self.pid = process.pid
        self.output = output

    def poll(self) -> int | None:
        return self._process.poll()

    def wait(self, timeout: float) -> int:
        return _wait(self, timeout)

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def output_tail(self, max_bytes: int = 3000) -> str:
        return _tail(self.output, max_bytes)


class ProcessLauncher:
    """Starts each run of the job as ``python -m benchmarks.recovery.job`` in a fresh process.

    Args:
        python: the interpreter (default: this one).
        env: environment variables over this process' own.
    """

    def __init__(self, python: str = sys.executable, env: Mapping[str, str] | None = None) -> None:
        self.python = python
        self.env = dict(env or {})

    def command(self, config: JobConfig) -> list[str]:
        """The command line that runs one start of ``config``."""
        argv = [self.python, "-m", "benchmarks.recovery.job"]
        for name, value in json.loads(config.to_json()).items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                argv += [flag, str(value)]
        return argv

    def start(self, config: JobConfig, env: Mapping[str, str] | None = None) -> ProcessJob:
        """Start the job; its output goes to ``<log>.<n>.out`` beside its event log."""
        output = _output_path(config.event_log)
        with open(output, "wb") as stream:
            process = subprocess.Popen(self.command(config), stdin=subprocess.DEVNULL, stdout=stream,
                                       stderr=subprocess.STDOUT, env={**os.environ, **self.env, **(env or {})})
        return ProcessJob(process, output)


def _output_path(log: str) -> str:
    for index in range(1, 1_000_000):
        path = f"{log}.{index}.out"
        if not os.path.exists(path):
            return path
    raise RuntimeError(f"too many outputs beside {log}")


class ForkedJob:
    """A start of the job forked by a :class:`ForkServer` (its exit code comes from the server)."""

    def __init__(self, server: ForkServer, pid: int, output: str) -> None:
        self._server = server
        self.pid = pid
        self.output = output
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            self._code = self._server._request({"op": "poll", "pid": self.pid})
        return self._code

    def wait(self, timeout: float) -> int:
        return _wait(self, timeout)

    def send(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill_group(self) -> None:
        """SIGKILL to its process group: the job, or the elastic agent and its ranks."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)

    def output_tail(self, max_bytes: int = 3000) -> str:
        return _tail(self.output, max_bytes)


# Imported by the fork server before it forks anything: what every start of the job needs.
# DeepSpeed too, which FastPersist imports at its first read or write (its aio op): every other plugin's
# libraries are here, and a start that paid for DeepSpeed's import alone would charge FastPersist for it.
PRELOAD = ("torch", "lightning.pytorch", "torch.distributed.checkpoint", "torch.distributed.elastic.agent.server",
           "torch.distributed.launcher.api", "dataflux_ckpt", "dataflux_ckpt.checkpoint_io", "dataflux_ckpt.strategies",
           "gcsfs", "fastpersist", "fastpersist.checkpoint_io", "fastpersist.strategies", "deepspeed", "smartredis_io",
           "smartredis_io.lightning.checkpoint_io", "benchmarks.recovery.job")


class ForkServer:
    """A process that has imported torch, Lightning and the plugins, and forks starts of the job.

    Forked starts skip the imports (tens of seconds on a busy 2-core machine) and are otherwise what
    :class:`ProcessLauncher` starts: the server makes no thread, client, handle or buffer before it
    forks, so each start makes its own, as a fresh process would. Every start runs in a process group
    of its own and ends with the server (and the server with this process). A context manager.

    Args:
        python: the interpreter of the server.
        env: environment variables over this process' own, for the server and every start.
        startup_timeout_s: how long the server has to import everything.
    """

    def __init__(self, python: str = sys.executable, env: Mapping[str, str] | None = None, *,
                 startup_timeout_s: float = 300.0) -> None:
        self.python = python
        self.env = dict(env or {})
        self._startup_timeout_s = startup_timeout_s
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Any = None
        self._jobs: list[ForkedJob] = []

    def __enter__(self) -> ForkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ForkServer:
        """Start the server and wait until it has imported everything.

        Raises:
            JobTimeoutError: it was not ready within ``startup_timeout_s``.
            RuntimeError: it exited during start-up (the message holds its output).
        """
        from multiprocessing.connection import Client

        from lightning_storage_plugins.services import die_with_parent

        self._dir = tempfile.TemporaryDirectory(prefix="recovery-forkserver-")
        address = os.path.join(self._dir.name, "socket")
        authkey = secrets.token_bytes(32)
        output = os.path.join(self._dir.name, "server.out")
        with open(output, "wb") as stream:
            self._process = subprocess.Popen(
                [self.python, "-m", "benchmarks.recovery.events", "serve", address], stdin=subprocess.PIPE,
                stdout=stream, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                preexec_fn=die_with_parent)
        assert self._process.stdin is not None
        self._process.stdin.write(authkey.hex().encode() + b"\n")
        self._process.stdin.close()
        deadline = time.monotonic() + self._startup_timeout_s
        while not os.path.exists(address + ".ready"):
            if self._process.poll() is not None:
                raise RuntimeError(f"the recovery fork server exited with code {self._process.returncode} while "
                                   f"importing torch, Lightning and the plugins{_tail(output, 3000)}")
            if time.monotonic() > deadline:
                self.stop()
                raise JobTimeoutError(f"the recovery fork server did not import torch, Lightning and the plugins "
                                      f"within {self._startup_timeout_s:.0f} s{_tail(output, 3000)}")
            time.sleep(0.1)
        self._conn = Client(address, family="AF_UNIX", authkey=authkey)
        return self

    def _request(self, request: dict[str, Any]) -> Any:
        if self._conn is None:
            raise RuntimeError("the recovery fork server is not running")
        self._conn.send(request)
        reply = self._conn.recv()
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"the recovery fork server refused {request['op']}: {reply['error']}")
        return reply

    def start_job(self, config: JobConfig, env: Mapping[str, str] | None = None) -> ForkedJob:
        """Fork one start of the job; its output goes to ``<log>.<n>.out`` beside its event log."""
        return self._fork("job", config, env)

    def start_elastic(self, config: JobConfig, *, nproc: int, max_restarts: int,
                      env: Mapping[str, str] | None = None) -> ForkedJob:
        """Fork torch's elastic agent (what ``torchrun --standalone --nproc-per-node NPROC --max-restarts N``
        runs) with ``nproc`` ranks of the job, each forked from the agent; the job is the agent."""
        return self._fork("elastic", config, env, nproc=nproc, max_restarts=max_restarts)

    def _fork(self, kind: str, config: JobConfig, env: Mapping[str, str] | None, **extra: Any) -> ForkedJob:
        output = _output_path(config.event_log)
        pid = self._request({"op": "fork", "kind": kind, "config": config.to_json(), "env": dict(env or {}),
                             "output": output, **extra})
        job = ForkedJob(self, pid, output)
        self._jobs.append(job)
        return job

    def stop(self) -> None:
        """Kill every start still running (and its ranks), then stop the server. Idempotent."""
        for job in self._jobs:
            with contextlib.suppress(Exception):
                job.kill_group()
        self._jobs.clear()
        if self._conn is not None:
            with contextlib.suppress(OSError, EOFError):
                self._conn.send({"op": "stop"})
            self._conn.close()
            self._conn = None
        if self._process is not None:
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def _serve(address: str) -> None:
    """The fork server's loop (``python -m benchmarks.recovery.events serve ADDRESS``; the key on stdin)."""
    from multiprocessing.connection import Listener

    from dataflux_ckpt.emulator import configure_gcsfs_for_emulator

    authkey = bytes.fromhex(sys.stdin.readline().strip())
    configure_gcsfs_for_emulator()  # before gcsfs is imported: the emulator serves no gRPC probe
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a plugin whose extra is missing is reported by its job
            importlib.import_module(name)
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    Path(address + ".ready").touch()
    conn = listener.accept()
    children: set[int] = set()
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                break
            if request["op"] == "stop":
                break
            if request["op"] == "poll":
                conn.send(_reap(request["pid"], children))
                continue
            gc.collect()  # garbage is destroyed here, not in each child
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child reports through its exit status
                conn.close()
                listener.close()
                _child(request)
            children.add(pid)
            conn.send(pid)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _reap(pid: int, children: set[int]) -> int | None | dict[str, str]:
    if pid not in children:
        return {"error": f"{pid} is not a child of the fork server"}
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        return None
    children.discard(pid)
    return os.waitstatus_to_exitcode(status)


def _child(request: Mapping[str, Any]) -> None:  # pragma: no cover - runs in the forked child
    from lightning_storage_plugins.services import die_with_parent

    code = 1
    try:
        os.setsid()
        die_with_parent(signal.SIGKILL)
        fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(request["env"])
        config = JobConfig.from_json(request["config"])
        if request["kind"] == "elastic":
            _elastic(config, request["nproc"], request["max_restarts"])
        else:
            from benchmarks.recovery.job import run

            run(config)
        code = 0
    except SystemExit as exc:  # Lightning's SIGTERMException exits with status 0, as a real process does
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _elastic(config: JobConfig, nproc: int, max_restarts: int) -> None:  # pragma: no cover - in a child
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchrun --standalone's rendezvous: a c10d store on a free port of this host.
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="fork")
    elastic_launch(launch, _rank)(config.to_json())


def _rank(config_json: str) -> None:  # pragma: no cover - a rank forked by the elastic agent
    from benchmarks.recovery.job import run

    run(JobConfig.from_json(config_json))


# -- the events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Injection:
    """What an event did: the signal(s), when, at which point, after which logged event and delay."""

    action: str
    pid: int
    point: str
    trigger: Mapping[str, Any] | None
    delay_s: float
    time: float
    exit_code: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def _record(log: EventLog | None, injection: Injection) -> None:
    if log is not None:
        log.emit("inject", source="injector", action=injection.action, target=injection.pid, point=injection.point,
                 delay_s=injection.delay_s, trigger=injection.trigger and injection.trigger.get("event"),
                 exit_code=injection.exit_code, **injection.extra)


def _typical_seconds(events: Sequence[Mapping[str, Any]], point: str) -> float:
    """How long the point's part of the run took so far (the median), to bound a random delay into it."""
    if point == "step":
        steps = [e for e in events if e["event"] == "step" and e.get("source") != "injector"]
        gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False) if a["pid"] == b["pid"]]
        return statistics.median(gaps[-20:]) if gaps else DEFAULT_POINT_S["step"]
    blocking = point == "save"
    seconds = [e["seconds"] for e in events
               if e["event"] == "save_end" and "seconds" in e and _blocking(events, e) == blocking]
    return statistics.median(seconds[-20:]) if seconds else DEFAULT_POINT_S[point]


def _blocking(events: Sequence[Mapping[str, Any]], end: Mapping[str, Any]) -> bool:
    for event in reversed(events):
        if event["event"] == "save_start" and event["pid"] == end["pid"] and event["path"] == end["path"]:
            return bool(event.get("blocking", True))
    return True


def wait_point(job: Job, follower: LogFollower, point: str, rng: random.Random, *,
               first_part: Callable[[str], bool] | None = None, pid: int | None = None, rank: int | None = None,
               skip: int = 0, timeout: float = 120.0) -> tuple[dict[str, Any], float]:
    """Wait for a random moment of ``point`` in the job's run: the event that starts it (a ``step`` event; a
    blocking ``save_start``; a ``save_start`` behind ``AsyncCheckpointIO``; for ``upload``, a save whose first
    part object ``first_part(path)`` sees in the storage), then a delay drawn from ``rng`` up to how long
    that part of the run took so far (the median in the log). Returns the event and the delay.
    With ``skip``, that many such moments pass first (so that a point lands in a later save, not
    always in the first one after a restart).

    Args:
        job: the job.
        follower: the job's event log.
        point: one of :data:`KILL_POINTS`.
        rng: the source of the delay (seed it to replay a run).
        first_part: for ``upload``: whether the save of a path has its first part in the storage yet.
        pid: the process whose events start the point (default: ``job``'s, unless ``rank`` is given).
        rank: the rank whose events start the point.
        skip: how many moments of ``point`` to let pass first.
        timeout: seconds to wait for the point.

    Raises:
        ValueError: an unknown point, or ``upload`` without ``first_part``.
        JobTimeoutError, JobExitedError: the point did not come.
    """
    if point not in KILL_POINTS:
        raise ValueError(f"unknown kill point {point!r}; choose from {', '.join(KILL_POINTS)}")
    if point == "upload" and first_part is None:
        raise ValueError("the upload point needs first_part, to see a save's first part object")
    target = pid if pid is not None or rank is not None else job.pid

    def ours(event: Mapping[str, Any]) -> bool:
        if event.get("source") == "injector":
            return False
        return event.get("rank", 0) == rank if rank is not None else event["pid"] == target

    who = f"rank {rank}" if rank is not None else f"process {target}"
    blocking = point != "async_save"
    deadline = time.monotonic() + timeout
    since = len(follower.events)
    while True:
        if point == "step":
            trigger = follower.wait_for(lambda e: ours(e) and e["event"] == "step",
                                        max(1.0, deadline - time.monotonic()), f"a step of {who}", job=job,
                                        since=since)
            since = follower.cursor
            if skip <= 0:
                break
            skip -= 1
            continue
        trigger = follower.wait_for(
            lambda e: ours(e) and e["event"] == "save_start" and (point == "upload" or e.get("blocking") == blocking),
            max(1.0, deadline - time.monotonic()), f"a {'blocking' if blocking else 'background'} save of {who}",
            job=job, since=since)
        since = follower.cursor
        if point != "upload":
            if skip <= 0:
                break
            skip -= 1
            continue
        assert first_part is not None
        while not first_part(trigger["path"]):
            follower.poll()
            ended = [e for e in follower.events[since:] if e["event"] in ("save_end", "save_error")
                     and e.get("path") == trigger["path"] and ours(e)]
            if ended or job.poll() is not None or time.monotonic() > deadline:
                break  # over before a part was seen: the next save
            time.sleep(POLL_INTERVAL_S)
        else:
            if skip <= 0:
                break
            skip -= 1
    delay = rng.uniform(0.0, _typical_seconds(follower.events, point))
    time.sleep(delay)
    return trigger, delay


def kill_at(job: Job, follower: LogFollower, point: str, rng: random.Random, *, log: EventLog | None = None,
            first_part: Callable[[str], bool] | None = None, pid: int | None = None, rank: int | None = None,
            skip: int = 0, timeout: float = 120.0) -> Injection:
    """SIGKILL the job (or the process ``pid``: a rank of an elastic job) at a random moment of ``point``
    (:func:`wait_point`), and wait for the job's exit; the injection is recorded in ``log``.

    Raises:
        ValueError: an unknown point, or ``upload`` without ``first_part``.
        JobTimeoutError, JobExitedError: the point did not come, or the job did not exit.
    """
    trigger, delay = wait_point(job, follower, point, rng, first_part=first_part, pid=pid, rank=rank, skip=skip,
                                timeout=timeout)
    target = pid if pid is not None else trigger["pid"] if rank is not None else job.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(target, signal.SIGKILL)
    code = job.wait(timeout) if target == job.pid else None
    injection = Injection("SIGKILL", target, point, dict(trigger), delay, time.time(), code)
    _record(log, injection)
    return injection


def preempt(job: Job, follower: LogFollower, *, grace_s: float = DEFAULT_GRACE_S, log: EventLog | None = None,
            point: str | None = None, rng: random.Random | None = None,
            first_part: Callable[[str], bool] | None = None, skip: int = 0, signum: int = signal.SIGTERM,
            timeout: float = 120.0) -> Injection:
    """SIGTERM the job, now or at a random moment of ``point`` (:func:`wait_point`), as a spot VM's or a
    pod's preemption does; SIGKILL it if it has not exited when ``grace_s`` is over.
    ``extra["killed"]`` says whether the grace ran out, ``extra["exited_after_s"]`` when it exited.

    Args:
        job: the job.
        follower: its event log (read up to the job's exit, so the caller sees everything it wrote).
        grace_s: seconds between SIGTERM and SIGKILL.
        log: where to record the injection.
        point: one of :data:`KILL_POINTS`, or None for now.
        rng: the source of the delay into ``point``.
        first_part, skip: as for :func:`wait_point`.
        signum: the signal that starts the grace period.
        timeout: seconds to wait for the point.

    Raises:
        ValueError: ``point`` without ``rng``.
    """
    trigger, delay = None, 0.0
    if point is not None:
        if rng is None:
            raise ValueError("a preemption at a point needs rng, for its random delay")
        trigger, delay = wait_point(job, follower, point, rng, first_part=first_part, skip=skip, timeout=timeout)
    sent = time.time()
    job.send(signum)
    killed = False
    try:
        code = job.wait(grace_s)
    except JobTimeoutError:
        job.send(signal.SIGKILL)
        killed = True
        code = job.wait(60.0)
    follower.poll()
    injection = Injection(signal.Signals(signum).name, job.pid, point or "now", trigger, delay, sent, code,
                          {"grace_s": grace_s, "killed": killed, "exited_after_s": time.time() - sent})
    _record(log, injection)
    return injection


class SlurmCluster(Protocol):
    """What :func:`slurm_requeue` needs of a Slurm cluster (``tests.support.slurm.LocalSlurm`` has it)."""

    def signal(self, job_id: int, sig: str = "USR1", *, batch: bool = True, full: bool = False) -> None: ...

    def requeue_now(self, job_id: int, timeout: float = 120.0, *, restarts: int = 1) -> None: ...


def slurm_requeue(cluster: SlurmCluster, job_id: int, follower: LogFollower, *, restarts: int,
                  log: EventLog | None = None, batch: bool = False, timeout: float = 180.0) -> Injection:
    """Send a running Slurm job Lightning's requeue signal now, and have the requeued job start at once.

    The job's ``SLURMEnvironment(auto_requeue=True)`` handler saves ``hpc_ckpt_N`` through the plugin and
    runs ``scontrol requeue``; Slurm then stops the job (SIGTERM, and SIGKILL after ``KillWait``) and holds
    the requeued job about two minutes, which this lifts (``scontrol update StartTime=now``).

    Args:
        cluster: the cluster.
        job_id: the job.
        follower: the job's event log: the hpc save is waited for there.
        restarts: which requeue this is (1 for the first).
        log: where to record the injection.
        batch: signal the batch shell (``scancel --batch``: a script that ``exec``s the job) rather than the
            job's steps (``srun``).
        timeout: seconds for the hpc save and for the requeue.

    Raises:
        JobTimeoutError: no hpc save within ``timeout``.
    """
    sent = time.time()
    cluster.signal(job_id, "USR1", batch=batch)
    saved = follower.wait_for(lambda e: e["event"] in ("save_end", "save_error") and hpc_number(e.get("path", ""))
                              is not None and e["time"] >= sent, timeout, f"an hpc_ckpt save of Slurm job {job_id}")
    injection = Injection("USR1", job_id, "now", None, 0.0, sent, None,
                          {"hpc": saved["path"], "hpc_step": saved.get("step"), "hpc_saved": saved["event"]})
    _record(log, injection)
    cluster.requeue_now(job_id, timeout, restarts=restarts)
    return injection


def rank_pids(events: Iterable[Mapping[str, Any]], *, attempt: int | None = None) -> dict[int, int]:
    """The pid of each rank's newest ``start`` (of ``attempt``, if given)."""
    pids: dict[int, int] = {}
    for event in events:
        if event["event"] == "start" and (attempt is None or event.get("attempt") == attempt):
            pids[event.get("rank", 0)] = event["pid"]
    return pids


def kill_rank(job: Job, follower: LogFollower, rank: int, point: str, rng: random.Random, *, attempt: int,
              log: EventLog | None = None, skip: int = 0, timeout: float = 180.0) -> Injection:
    """SIGKILL one rank of an elastic job (the agent restarts every rank) at a random moment of ``point``
    (``step`` or ``save``, after ``skip`` of them) of that rank's run in restart ``attempt``.

    Raises:
        JobTimeoutError, JobExitedError: the rank did not start, or the point did not come.
    """
    started = follower.wait_for(lambda e: e["event"] == "start" and e.get("rank", 0) == rank
                                and e.get("attempt") == attempt, timeout, f"rank {rank} of attempt {attempt}",
                                job=job, since=0)
    return kill_at(job, follower, point, rng, log=log, pid=started["pid"], rank=rank, skip=skip, timeout=timeout)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit("usage: python -m benchmarks.recovery.events serve ADDRESS  (the key on stdin)")
    _serve(sys.argv[2])
