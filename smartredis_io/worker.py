"""Execution workers: run the models and scripts that clients ask for with run_model / run_script.

``python -m smartredis_io.worker --address HOST:PORT [--device cpu|cuda:N] [--workers N] [--user NAME | --allow-root]``

Credentials, TLS and deadlines come from the environment as for a SmartRedis client (``SR_USERNAME``,
``SR_PASSWORD``, ``SR_TLS``..., ``SR_CMD_TIMEOUT``), or from a ``redis://user:password@`` address.
The database must have the smartredis_io Redis module loaded (our launchers load it).

The command is a supervisor: it runs no model and imports no torch, and starts ``--workers`` worker
processes (:mod:`smartredis_io.executor`), each serving every server of the database. A worker that
exits while the supervisor is not stopping (killed, crashed, or stopped by its deadline watchdog
because a run outlived its deadline) is started again at once, then after pauses that grow to
``RESTART_BACKOFF_MAX_S`` while workers keep dying young. Each SIGTERM / SIGINT the supervisor gets
is passed to every worker once: an idle worker stops at once, a busy one finishes its request, and
a second signal stops it anyway (its request then runs on another worker). Workers are in a process
group of their own, so a signal to the supervisor's group reaches them once, through it.

A worker started as root refuses to run unless it drops to ``--user`` once connected, or is told
``--allow-root``.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import pwd
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from lightning_storage_plugins.services import die_with_parent
from smartredis_io.connection import ConnectionSettings, detect_cluster

log = logging.getLogger(__name__)

RESTART_BACKOFF_MAX_S = 10.0  # longest pause before starting a worker again
HEALTHY_AFTER_S = 30.0  # a worker that ran this long resets the pause
EXIT_DEADLINE = 3  # a worker's exit status when a run outlived its deadline
EXIT_STOPPED = 4  # a worker's exit status after a second SIGTERM / SIGINT during a run


def drop_privileges(user: str) -> None:
    """Become ``user`` (its uid and gid, no supplementary groups) for good.

    Raises:
        KeyError: no such user.
        PermissionError: this process may not change its user.
    """
    entry = pwd.getpwnam(user)
    parent = os.getppid()
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)
    die_with_parent()  # the kernel forgets the parent-death signal when credentials change
    if os.getppid() != parent:
        raise SystemExit(f"the process that started this worker exited while it became {user}")
    log.info("running as %s (uid %d)", user, entry.pw_uid)


def _configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("SRIO_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")


def _serve(settings: ConnectionSettings, device: str, name: str, threads: int, user: str | None) -> None:
    """A worker process: connect, drop privileges if asked, serve until stopped; the process then ends."""
    os.setpgid(0, 0)  # signals to the supervisor's group reach this worker once, through the supervisor
    die_with_parent()
    _configure_logging()
    # A stop signal while the worker starts (importing torch, registering, dropping privileges) is
    # kept, and the worker then leaves at once through serve(), unregistering as any stopping worker.
    early: dict[str, Any] = {"stop": False, "worker": None}

    def stop_early(signum: int, frame: object) -> None:
        early["stop"] = True
        if early["worker"] is not None:
            early["worker"].request_stop()

    signal.signal(signal.SIGTERM, stop_early)
    signal.signal(signal.SIGINT, stop_early)
    code = 1
    try:
        import torch

        from smartredis_io import executor

        torch.set_num_threads(threads)
        dropping = bool(user) and os.geteuid() == 0
        if dropping and settings.tls_ca_cert:
            # Connections made after the drop must not need files only root can read.
            with open(settings.tls_ca_cert) as ca:
                settings = settings.with_(tls_ca_data=ca.read(), tls_ca_cert=None)
        worker = early["worker"] = executor.Worker(settings, device, name)
        if early["stop"]:
            worker.request_stop()
        if dropping:
            executor.warm_up()
            drop_privileges(user)
        worker.serve()
        code = 0
    except Exception:  # noqa: BLE001 - logged for the supervisor's log; it starts a new worker
        log.exception("worker %s failed", name)
    finally:
        _exit(code)


def _exit(code: int) -> None:
    """End the process now that the worker has stopped and unregistered.

    With torch.export's loader imported (dynamo, inductor, sympy), the interpreter's own teardown
    takes seconds on a busy machine, longer than a launcher waits after SIGTERM; nothing is left to
    clean up, so it is skipped.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_device(device: str, index: int, gpus: int | None = None) -> str:
    """The device of worker ``index``: ``cuda`` spreads the workers over the GPUs, one GPU each in turn."""
    if device != "cuda":
        return device
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return f"cuda:{index % gpus}" if gpus else "cpu"


class _Supervisor:
    """Starts the worker processes, starts again those that exit, and passes stop signals on."""

    def __init__(self, settings: ConnectionSettings, base: str, count: int, device: str, threads: int,
                 user: str | None) -> None:
        self._settings = settings
        self._base = base
        self._device = device
        self._threads = threads
        self._user = user
        self._context = multiprocessing.get_context("spawn")
        self._slots: list[dict[str, Any]] = [
            {"process": None, "started": 0.0, "pause": 0.0, "due": 0.0, "generation": 0} for _ in range(count)
        ]
        self._stopping = False

    def _start(self, index: int) -> None:
        slot = self._slots[index]
        name = f"{self._base}.{index}" + (f"-{slot['generation']}" if slot["generation"] else "")
        slot["generation"] += 1
        process = self._context.Process(
            target=_serve, args=(self._settings, worker_device(self._device, index), name, self._threads, self._user),
            name=name, daemon=True,
        )
        process.start()
        slot.update(process=process, started=time.monotonic())

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True
        for slot in self._slots:
            process = slot["process"]
            if process is not None and process.pid and process.exitcode is None:
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass

    def run(self) -> int:
        """Supervise until stopped and every worker has exited; the exit status."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for index in range(len(self._slots)):
            self._start(index)
        while True:
            running = [slot["process"] for slot in self._slots if slot["process"] is not None]
            if self._stopping and not running:
                return 0
            now = time.monotonic()
            waiting = [slot["due"] for slot in self._slots if slot["process"] is None]
            timeout = max(min(waiting) - now, 0.0) if waiting and not self._stopping else None
            multiprocessing.connection.wait([p.sentinel for p in running], timeout)
            for index, slot in enumerate(self._slots):
                process = slot["process"]
                if process is not None and process.exitcode is not None:
                    self._exited(index, process.exitcode)
                elif process is None and not self._stopping and time.monotonic() >= slot["due"]:
                    self._start(index)

    def _exited(self, index: int, code: int) -> None:
        slot = self._slots[index]
        slot["process"] = None
        if self._stopping:
            return
        lived = time.monotonic() - slot["started"]
        if code in (EXIT_DEADLINE, EXIT_STOPPED) or code < 0 or lived >= HEALTHY_AFTER_S:
            slot["pause"] = 0.0  # it was serving: a new one starts at once
        else:  # it failed early (database unreachable, module missing...): wait longer each time
            slot["pause"] = min(max(slot["pause"] * 2, 0.5), RESTART_BACKOFF_MAX_S)
        slot["due"] = time.monotonic() + slot["pause"]
        why = ("a run outlived its deadline" if code == EXIT_DEADLINE
               else f"killed by signal {-code}" if code < 0 else f"exit status {code}")
        log.warning("worker %d exited (%s); starting a new one in %.1f s", index, why, slot["pause"])


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m smartredis_io.worker`` command line; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m smartredis_io.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=os.environ.get("SSDB"), help="host:port[,host:port...] (default $SSDB)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda:N, or cuda (worker i on GPU i modulo the GPU count): where models set for "
                             "device GPU run; a model set for GPU:N runs on GPU N, one set for CPU on the CPU")
    parser.add_argument("--workers", type=int, default=1, help="worker processes sharing the requests")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--name", default="", help="worker name prefix (default host:pid)")
    parser.add_argument("--user", default=None,
                        help="run models as this user: started as root, the worker connects, then drops to it")
    parser.add_argument("--allow-root", action="store_true",
                        help="run models as root (refused without this flag or --user when started as root)")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("--address or $SSDB is required")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if os.geteuid() == 0 and not args.user and not args.allow_root:
        parser.error("refusing to run stored models as root: pass --user NAME (e.g. --user nobody) to drop to "
                     "an unprivileged user, or --allow-root if the database's writers are trusted with root")
    if args.user and os.geteuid() != 0 and args.user != pwd.getpwuid(os.geteuid()).pw_name:
        parser.error(f"--user {args.user}: only a worker started as root can change its user")
    _configure_logging()
    settings = ConnectionSettings.from_options(address=args.address, cluster=False)
    settings = settings.with_(cluster=detect_cluster(settings))
    base = args.name or f"{socket.gethostname()}:{os.getpid()}"
    return _Supervisor(settings, base, args.workers, args.device, args.threads, args.user).run()


if __name__ == "__main__":
    _exit(main())
