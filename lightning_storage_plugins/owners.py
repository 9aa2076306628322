"""Who owns a save's temporaries, and when that owner is certainly gone.

A save that is killed cannot clean up after itself: its temporaries (part objects, locks, keys)
stay until something else removes them. Each plugin names or stamps its temporaries with the
:class:`Owner` of the save, so that a restart, or the next save of the same path, can tell the
temporaries of a dead save from those of a save still running in another process, on another
node of the job, or in another job sharing the storage.

An owner is certainly gone (:meth:`Owner.gone`) when

* it ran on this machine (the same kernel boot and pid namespace, so its pid means the same
  process here) and that process has exited, or its pid now belongs to a process started later;
* or it ran in an earlier attempt of this Slurm job (the same cluster and job id, a lower
  ``SLURM_RESTART_COUNT``): Slurm ends every process of an attempt before it requeues the job.

Anything else may still be running: a plugin then keeps the temporary until its lease runs out.
torchrun's ``TORCHELASTIC_RESTART_COUNT`` is not an attempt number of the job: each agent counts
its own restarts, and a healthy agent restarts its workers without counting when another node's
fail. Earlier attempts of a torchrun job on this machine are found by their pids instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Mapping

__all__ = ["Owner"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_PID_NAMESPACE = "/proc/self/ns/pid"
_DIGEST_HEX = 12
# A token: "m<machine>.p<pid>[.t<start>][.j<job>.a<attempt>]"; the fields a name may hold.
_HEX = f"[0-9a-f]{{{_DIGEST_HEX}}}"
_TOKEN_RE = re.compile(
    rf"^(?:m(?P<machine>{_HEX})\.)?p(?P<pid>\d{{1,10}})(?:\.t(?P<started>\d{{1,20}}))?"
    rf"(?:\.j(?P<job>{_HEX})\.a(?P<attempt>\d{{1,9}}))?$"
)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_HEX]


def _read(path: str) -> str | None:
    try:
        with open(path) as stream:
            return stream.read().strip()
    except OSError:
        return None


def _this_machine() -> str | None:
    """Who can read this process' pids as it does: the kernel boot and the pid namespace (two
    containers on one host see different processes under one pid); ``None`` without ``/proc``."""
    boot = _read(_BOOT_ID)
    try:
        namespace = os.readlink(_PID_NAMESPACE)
    except OSError:
        return None
    return _digest(f"{boot}\n{namespace}") if boot else None


def _process_state(pid: int) -> tuple[str, int] | None:
    """The state letter and start time (clock ticks after boot) of process ``pid``, or ``None``."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _slurm_job(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None, None
    try:
        attempt = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return None, None
    # Job ids are unique within one cluster only; two clusters may share a bucket.
    return _digest(f"slurm\n{environ.get('SLURM_CLUSTER_NAME', '')}\n{job_id}"), attempt


@dataclasses.dataclass(frozen=True)
class Owner:
    """The process a save runs in, as its temporaries record it.

    Attributes:
        pid: its process id.
        machine: a digest of the kernel boot and pid namespace it ran in (``None`` where unknown):
            processes with the same ``machine`` see one another under the same pids.
        started: its start time in clock ticks after boot (``None`` where unknown), which tells
            it from a later process given the same pid.
        job: a digest of its Slurm cluster name and job id (``None`` outside Slurm).
        attempt: its job's ``SLURM_RESTART_COUNT`` (0 before the first requeue).
    """

    pid: int
    machine: str | None = None
    started: int | None = None
    job: str | None = None
    attempt: int | None = None

    @classmethod
    def current(cls, environ: Mapping[str, str] | None = None) -> Owner:
        """This process, read now (from ``environ``, default ``os.environ``, for the job)."""
        pid = os.getpid()
        state = _process_state(pid)
        job, attempt = _slurm_job(os.environ if environ is None else environ)
        return cls(pid, _this_machine(), state[1] if state else None, job, attempt)

    def token(self) -> str:
        """This owner as a short string of letters, digits and dots, fit for object and file names."""
        parts = [f"m{self.machine}"] if self.machine else []
        parts.append(f"p{self.pid}")
        if self.started is not None:
            parts.append(f"t{self.started}")
        if self.job is not None and self.attempt is not None:
            parts += [f"j{self.job}", f"a{self.attempt}"]
        return ".".join(parts)

    @classmethod
    def from_token(cls, token: str) -> Owner | None:
        """The owner :meth:`token` wrote, or ``None`` when ``token`` is not one."""
        match = _TOKEN_RE.match(token)
        if match is None:
            return None
        started, attempt = match["started"], match["attempt"]
        return cls(int(match["pid"]), match["machine"], None if started is None else int(started),
                   match["job"], None if attempt is None else int(attempt))

    def gone(self, observer: Owner | None = None) -> str | None:
        """Why this owner's save is certainly over, seen from ``observer`` (default: this process),
        or ``None`` when it may still be running."""
        observer = Owner.current() if observer is None else observer
        if (self.job is not None and self.job == observer.job and self.attempt is not None
                and observer.attempt is not None and self.attempt < observer.attempt):
            return (f"it ran in attempt {self.attempt} of this Slurm job, which Slurm ended before "
                    f"this attempt ({observer.attempt})")
        if self.machine is None or self.machine != observer.machine:
            return None
        state = _process_state(self.pid)
        if state is None or state[0] in ("Z", "X"):  # a zombie has exited; only its parent has not looked yet
            return f"its process (pid {self.pid}) on this machine has exited"
        if self.started is not None and state[1] != self.started:
            return f"its process (pid {self.pid}) on this machine has exited, and the pid now names another"
        return None
