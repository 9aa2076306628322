"""Supervised local service processes (fake-gcs-server, redis-server, toxiproxy, workers).

The plugins' embedded launchers (``dataflux_ckpt.testing.FakeGcsServer``, ``smartredis_io.RedisServer``...)
are built on :class:`ManagedProcess`, so that every service started for a user, a test or a
benchmark is waited for, reports its log tail when it fails, and never outlives the Python process
that started it. Binaries are found by :func:`find_binary`: an environment variable, then ``PATH``,
then an optional package that ships the binary; never a path into a source checkout.
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4096
POLL_INTERVAL_S = 0.05
STOP_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1

__all__ = [
    "ManagedProcess",
    "MissingBinaryError",
    "ServiceStartError",
    "die_with_parent",
    "find_binary",
    "free_port",
    "is_loopback",
]

_running: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
_running_lock = threading.Lock()


class MissingBinaryError(FileNotFoundError):
    """A service binary is not installed; the message names the set-up command."""


class ServiceStartError(RuntimeError):
    """A service did not come up; the message carries the tail of its log."""


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def find_binary(
    name: str,
    env_var: str,
    *,
    install_hint: str,
    providers: Sequence[Callable[[], str | None]] = (),
) -> str:
    """Locate the executable ``name``.

    Looked up, in order: ``$env_var`` (which must then be executable), ``PATH``, and each of
    ``providers`` (callables returning a path from an optional package, or ``None``).

    Raises:
        MissingBinaryError: nothing found; the message names every place looked at and
            ``install_hint``, which says how to get the binary.
    """
    explicit = os.environ.get(env_var)
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise MissingBinaryError(f"${env_var}={explicit!r} is not an executable file")
    found = shutil.which(name)
    if found:
        return found
    for provider in providers:
        candidate = provider()
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise MissingBinaryError(f"{name} not found: ${env_var} is not set and {name} is not on PATH. {install_hint}")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send this process ``sig`` when its parent dies, even by SIGKILL.

    Used between fork and exec of a service, and at the start of a worker child process, so that
    nothing outlives the process that started it. A no-op where ``prctl`` does not exist.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except AttributeError:  # not Linux
        pass


class ManagedProcess:
    """One supervised child process.

    ``ready`` is polled until it returns True (the service answers) or ``startup_timeout_s``
    passes; an early exit or a timeout raises :class:`ServiceStartError` with the log tail. The
    child runs in its own process group (a terminal's Ctrl-C reaches only Python, which then stops
    it in order) and is stopped by :meth:`stop`, at interpreter exit, or by the kernel if this
    process is killed outright.

    The kernel's parent-death signal follows the *thread* that forked the child: start services from
    a thread that lives as long as they should (the main thread, typically), not from a short-lived
    worker thread, or they are stopped when that thread ends.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        ready: Callable[[], bool],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self._ready = ready
        self._cwd = cwd
        self._env = env
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> str | None:
        return self._log_file.name if self._log_file else None

    def start(self) -> ManagedProcess:
        """Start the process and block until it is ready."""
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self._log_file = tempfile.NamedTemporaryFile(prefix=f"{self.name}-", suffix=".log", delete=False)
        log.debug("starting %s: %s (log %s)", self.name, " ".join(self.argv), self._log_file.name)
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self._cwd,
            env=self._env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        with _running_lock:
            _running.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("%s is up (pid %d)", self.name, self._proc.pid)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServiceStartError(
                    f"{self.name} exited with code {code} during start-up; log tail:\n{self.log_tail()}"
                )
            try:
                if self._ready():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"{self.name} did not answer within {self._startup_timeout_s:.0f} s; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(POLL_INTERVAL_S)

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """The last ``max_bytes`` of the process' combined stdout and stderr."""
        if not self._log_file:
            return ""
        with open(self._log_file.name, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Terminate the process group (SIGTERM, then SIGKILL) and remove the log. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop on SIGTERM; killing it", self.name)
                self._signal_group(proc, signal.SIGKILL)
                proc.wait()
        with _running_lock:
            _running.discard(self)
        if self._log_file:
            self._log_file.close()
            Path(self._log_file.name).unlink(missing_ok=True)
            self._log_file = None
        self._proc = None
        log.debug("%s stopped", self.name)

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    with _running_lock:
        running = list(_running)
    for proc in running:
        proc.stop()
