"""Execution workers: run the models and scripts that clients ask for with run_model / run_script.

``python -m smartredis_io.worker --address HOST:PORT [--device cpu|cuda:N] [--workers N] [--user NAME | --allow-root]``

The smartredis_io Redis module starts this command by itself (one per server, ``WORKERS`` module
argument), already as its ``WORKER_USER`` when the server runs as root, with ``--secret-stdin``: its
standard input is the module's control socket, whose first message is the secret the workers show
the module (``SRIO.HELLO``), and whose end means the server is gone (the module holds the other end
for its whole life, so even a SIGKILL of redis-server closes it); there, or on the module's
``worker_protocol.STOP``, the workers get SIGTERM, and SIGKILL ``STOP_GRACE_S`` later. A worker that
cannot start tells the module why on that socket (``worker_protocol.START_ERROR``): INFO srio and the
runs' errors show it. Once its workers, and every process it started, have ended, the command says
``worker_protocol.ENDING`` and exits when the module closes the socket: where redis-server is PID 1
(a container without an init), it is the server's child, which the module then reaps at once. Started
by hand (separate pools, other machines), it takes the secret from ``--secret-file`` or
``$SRIO_WORKER_SECRET``, and refuses to start without one.

Credentials, TLS and deadlines come from the environment as for a SmartRedis client (``SR_USERNAME``,
``SR_PASSWORD``, ``SR_TLS``..., ``SR_CMD_TIMEOUT``), or from a ``redis://user:password@`` address.
The database must have the smartredis_io Redis module loaded (our launchers load it).

The command is a supervisor: it runs no model and imports no torch, and starts ``--workers`` worker
processes (:mod:`smartredis_io.worker.executor`), each serving every server of the database (a module's
own workers: the server that started them, in a cluster its shard). A worker that
exits while the supervisor is not stopping (killed, even by a signal, crashed, or stopped by its
deadline watchdog because a run outlived its deadline) is started again at once when it had run
``--healthy-after`` seconds (``HEALTHY_AFTER_S`` by default), else after pauses that double up to
``RESTART_BACKOFF_MAX_S`` while workers keep dying young. A worker whose server closes its
connection logs it in one line and exits (``EXIT_SERVER_GONE``), to be started again likewise.
Each SIGTERM / SIGINT the supervisor gets is passed to every worker once: an idle worker stops at
once, a busy one finishes its request, and
a second signal stops it anyway (its request then runs on another worker). Workers are in a process
group of their own, so a signal to the supervisor's group reaches them once, through it.

A worker started by hand as root refuses to run unless it drops to ``--user`` once connected and
warmed up, or is told ``--allow-root``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pwd
import select
import signal
import socket
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis

from lightning_storage_plugins.services import die_with_parent
from smartredis_io._client.connection import ConnectionSettings, detect_cluster, parse_address, plain_client
from smartredis_io.error import RedisConnectionError
from smartredis_io.worker.worker_protocol import (
    ENDING,
    EXIT_DEADLINE,
    EXIT_SERVER_GONE,
    SECRET_ENV,
    START_ERROR,
    STOP,
    secret_from_line,
)

log = logging.getLogger(__name__)

RESTART_BACKOFF_MAX_S = 10.0  # longest pause before starting a worker again
HEALTHY_AFTER_S = 30.0  # a worker that ran this long resets the pause (--healthy-after)
STOP_GRACE_S = 2.0  # once the server is gone: SIGTERM to the workers, SIGKILL this much later
SECRET_WAIT_S = 30.0  # how long --secret-stdin waits for the secret's line
START_ERROR_MAX_BYTES = 400  # of a reason a worker could not start, sent to the module
CLUSTER_POLL_S = 0.2  # how often a worker started before its cluster formed asks again
CHILD_POLL_S = 0.02  # how often a supervisor that is ending looks for children that ended


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


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """What every worker process of a supervisor is started with.

    Args:
        settings: how to reach the database (its first address is the server a worker with
            ``own_server`` takes requests from).
        device: ``cpu``, ``cuda:N``, or ``cuda`` (worker i on GPU i modulo the GPU count).
        threads: torch intra-op threads per worker.
        interop_threads: torch inter-op threads per worker (None: torch's default).
        user: the user a worker started as root becomes once connected.
        secret: what the workers show the Redis module (``SRIO.HELLO``); None: ``$SRIO_WORKER_SECRET`` as they find it.
        own_server: in a cluster, take requests only from the server at the address (a module's own
            workers serve their shard), instead of from every primary.
    """

    settings: ConnectionSettings
    device: str = "cpu"
    threads: int = 1
    interop_threads: int | None = None
    user: str | None = None
    secret: str | None = dataclasses.field(default=None, repr=False)
    own_server: bool = False


def _start_error(exc: BaseException) -> str:
    """Why a worker could not start, in one line for the module (INFO srio, the runs' errors)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= START_ERROR_MAX_BYTES else text[:START_ERROR_MAX_BYTES - 3] + "..."


def _serve(options: WorkerOptions, device: str, name: str,
           reasons: multiprocessing.connection.Connection | None = None) -> None:
    """A worker process: connect, drop privileges if asked, serve until stopped; the process then ends.

    A worker that fails before it serves sends why on ``reasons`` (the supervisor passes it on to the
    module); one whose server closes its connection while it serves says so in one line and exits
    with ``EXIT_SERVER_GONE``.
    """
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
    serving = False
    settings, user = options.settings, options.user
    if options.secret is not None:
        os.environ[SECRET_ENV] = options.secret  # where the connection handshake finds it
    try:
        import torch

        from smartredis_io.worker import executor

        torch.set_num_threads(options.threads)
        if options.interop_threads:
            torch.set_num_interop_threads(options.interop_threads)
        dropping = bool(user) and os.geteuid() == 0
        if dropping and settings.tls_ca_cert:
            # Connections made after the drop must not need files only root can read.
            with open(settings.tls_ca_cert) as ca:
                settings = settings.with_(tls_ca_data=ca.read(), tls_ca_cert=None)
        if settings.cluster and not _wait_for_cluster(settings, early):
            code = 0
            return
        worker = early["worker"] = executor.Worker(settings, device, name, own_server=options.own_server)
        if early["stop"]:
            worker.request_stop()
        if dropping:
            executor.warm_up()
            drop_privileges(user)
        serving = True
        worker.serve()
        code = 0
    except (redis.exceptions.ConnectionError, RedisConnectionError) as exc:
        if not serving:
            _could_not_start(name, exc, reasons)
        else:  # the server stopped (or was killed): the supervisor learns it too, or starts another
            log.info("worker %s: the server closed its connection (%s); leaving", name, exc)
            code = EXIT_SERVER_GONE
    except Exception as exc:  # noqa: BLE001 - logged for the supervisor's log; it starts a new worker
        if not serving:
            _could_not_start(name, exc, reasons)
        else:
            log.exception("worker %s failed", name)
    finally:
        _exit(code)


def _could_not_start(name: str, exc: BaseException, reasons: multiprocessing.connection.Connection | None) -> None:
    log.exception("worker %s could not start", name)
    if reasons is not None:
        try:
            reasons.send(_start_error(exc))
        except OSError:
            pass  # the supervisor is gone: nobody to tell


def _wait_for_cluster(settings: ConnectionSettings, early: dict[str, Any]) -> bool:
    """Wait until the cluster node at the address serves every slot (a module starts its workers when
    the server starts, before ``redis-cli --cluster create`` joins the nodes); False if stopped first."""
    endpoint = parse_address(settings.address)[0]
    waiting_since = None
    while not early["stop"]:
        client = plain_client(endpoint, settings, settings.command_timeout_s)
        try:
            if client.cluster("info").get("cluster_state") == "ok":
                if waiting_since is not None:
                    log.info("the cluster formed after %.1f s", time.monotonic() - waiting_since)
                return True
        except redis.exceptions.ConnectionError:
            pass  # not answering yet: the worker's own connection gives the error, after its own wait
        finally:
            client.close()
        if waiting_since is None:
            waiting_since = time.monotonic()
            log.info("waiting for the cluster at %s to serve every slot (cluster_state:ok)", settings.address)
        time.sleep(CLUSTER_POLL_S)
    return False


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
    """Starts the worker processes, starts again those that exit, and passes stop signals on.

    ``lifeline``: a file descriptor whose end (EOF) means the server is gone: the workers are then
    stopped, by SIGKILL after ``STOP_GRACE_S`` if SIGTERM has not stopped them. Started by the module,
    it is the module's control socket, where a worker's reason for not starting goes, and where the
    module's ``STOP`` stops the workers likewise. A worker that ran ``healthy_after_s`` is started
    again at once when it exits.
    """

    def __init__(self, options: WorkerOptions, base: str, count: int, lifeline: int | None = None,
                 healthy_after_s: float = HEALTHY_AFTER_S) -> None:
        self._options = options
        self._healthy_after_s = healthy_after_s
        self._base = base
        self._lifeline = lifeline
        self._context = multiprocessing.get_context("spawn")
        self._slots: list[dict[str, Any]] = [
            {"process": None, "reasons": None, "started": 0.0, "pause": 0.0, "due": 0.0, "generation": 0}
            for _ in range(count)
        ]
        self._stopping = False
        self._kill_at: float | None = None  # when workers still running after the server left get SIGKILL

    def _start(self, index: int) -> None:
        slot = self._slots[index]
        name = f"{self._base}.{index}" + (f"-{slot['generation']}" if slot["generation"] else "")
        slot["generation"] += 1
        reasons, tell = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_serve, args=(self._options, worker_device(self._options.device, index), name, tell),
            name=name, daemon=True,
        )
        process.start()
        tell.close()
        slot.update(process=process, reasons=reasons, started=time.monotonic())

    def _signal_workers(self, signum: int) -> None:
        for slot in self._slots:
            process = slot["process"]
            if process is not None and process.pid and process.exitcode is None:
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stopping = True
        self._signal_workers(signum)

    @property
    def lifeline(self) -> int | None:
        """The lifeline, while it has not ended."""
        return self._lifeline

    def _server_gone(self) -> None:
        log.warning("the server that started these workers is gone (its control socket closed): stopping %d worker(s)",
                    sum(slot["process"] is not None for slot in self._slots))
        self._lifeline = None
        self._stop_workers()

    def _stopped_by_module(self) -> None:
        log.info("the Redis module stops its workers: stopping %d worker(s)",
                 sum(slot["process"] is not None for slot in self._slots))
        self._stop_workers()

    def _stop_workers(self) -> None:
        self._stopping = True
        self._kill_at = time.monotonic() + STOP_GRACE_S
        self._signal_workers(signal.SIGTERM)

    def _timeout(self) -> float | None:
        """How long to wait for a worker's exit or the lifeline before something is due."""
        now = time.monotonic()
        due = [] if self._stopping else [slot["due"] for slot in self._slots if slot["process"] is None]
        if self._kill_at is not None:
            due.append(self._kill_at)
        return max(min(due) - now, 0.0) if due else None

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
            watched: list[Any] = [p.sentinel for p in running]
            if self._lifeline is not None:
                watched.append(self._lifeline)
            ready = multiprocessing.connection.wait(watched, self._timeout())
            if self._lifeline is not None and self._lifeline in ready:
                message = os.read(self._lifeline, 4096)
                if not message:
                    self._server_gone()
                elif message == STOP:
                    self._stopped_by_module()
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_at = None
                self._signal_workers(signal.SIGKILL)
            for index, slot in enumerate(self._slots):
                process = slot["process"]
                if process is not None and process.exitcode is not None:
                    self._exited(index, process.exitcode)
                elif process is None and not self._stopping and time.monotonic() >= slot["due"]:
                    self._start(index)

    def _exited(self, index: int, code: int) -> None:
        slot = self._slots[index]
        slot["process"] = None
        reason = self._reason(slot)
        if self._stopping:
            return
        lived = time.monotonic() - slot["started"]
        if lived >= self._healthy_after_s:
            slot["pause"] = 0.0  # it served a while: a new one starts at once
        else:  # it died young, whatever killed it (a signal too: OOM, a CUDA fault): wait longer each time
            slot["pause"] = min(max(slot["pause"] * 2, 0.5), RESTART_BACKOFF_MAX_S)
        slot["due"] = time.monotonic() + slot["pause"]
        if reason is not None:
            self._tell_module(f"worker {index} could not start: {reason}")
        if code == EXIT_SERVER_GONE:
            log.info("worker %d left (its server closed the connection) after %.1f s; starting a new one in %.1f s",
                     index, lived, slot["pause"])
            return
        why = ("a run outlived its deadline" if code == EXIT_DEADLINE
               else f"killed by signal {-code}" if code < 0 else f"exit status {code}")
        log.warning("worker %d exited (%s) after %.1f s; starting a new one in %.1f s", index, why, lived, slot["pause"])

    @staticmethod
    def _reason(slot: dict[str, Any]) -> str | None:
        """Why the worker of ``slot`` could not start (None: it started, or did not say)."""
        reasons, slot["reasons"] = slot["reasons"], None
        try:
            return reasons.recv() if reasons is not None and reasons.poll() else None
        except (EOFError, OSError):
            return None
        finally:
            if reasons is not None:
                reasons.close()

    def _tell_module(self, text: str) -> None:
        if self._lifeline is not None:
            _tell_module(self._lifeline, text)


def _wait_for_children(timeout_s: float = STOP_GRACE_S) -> None:
    """Close every descriptor but the standard ones, then wait up to ``timeout_s`` for the children
    left (multiprocessing's resource tracker ends once its pipe is closed), so that none outlives the
    module's supervisor: an orphan's new parent would be a redis-server that is PID 1 (a container
    without an init), which logs it as a child it does not know when it ends during a background save."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0 and time.monotonic() >= deadline:
            log.warning("leaving processes this supervisor started that did not end within %g s", timeout_s)
            return
        if pid == 0:
            time.sleep(CHILD_POLL_S)


def _end_with_module(control: int, timeout_s: float = STOP_GRACE_S) -> None:
    """Say ``ENDING`` on the module's control socket, and wait up to ``timeout_s`` for the module to
    close it: where redis-server is PID 1, this supervisor is its child, which the module then reaps
    as it exits (redis-server's own wait, during a background save, would log it as unknown)."""
    try:
        os.write(control, ENDING)
    except OSError:
        return  # the server is gone
    select.select([control], [], [], timeout_s)


def _tell_module(control: int, text: str) -> None:
    """Send the module, on its control socket, why a worker (or this supervisor) could not start."""
    try:
        os.write(control, START_ERROR + text.encode("utf-8", "replace"))
    except OSError:
        pass  # the server is gone: the end of the control socket says so next


def _read_secret_line(fd: int, timeout_s: float = SECRET_WAIT_S) -> bytes:
    """The first line of ``fd`` (the module sends the secret and a newline in one message)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in data:
        if not select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))[0]:
            raise SystemExit(f"--secret-stdin: no secret on standard input within {timeout_s:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


def _take_log(fd: int, timeout_s: float = SECRET_WAIT_S) -> None:
    """Write to the server's log from now on, where the module sends its descriptor after the secret
    (on its control socket): until then the module reads this process' output itself (to tell why one
    that cannot even import this package does not start), which would end with the server."""
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        return
    with socket.socket(fileno=os.dup(fd)) as control:
        if not select.select([control], [], [], timeout_s)[0]:
            return
        message, fds, _, _ = socket.recv_fds(control, 16, 1)
    if message == b"log" and fds:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fds[0], sys.stdout.fileno())
        os.dup2(fds[0], sys.stderr.fileno())
    for passed in fds:
        os.close(passed)


NO_SECRET = (
    "python -m smartredis_io.worker: no worker secret: pass --secret-file FILE, FILE holding the secret the Redis "
    f"module reads from its WORKER_SECRET_FILE (or set ${SECRET_ENV} to it)"
)


def _secret(args: argparse.Namespace) -> str:
    """The secret the workers show the module: from standard input, a file, or the environment.

    Raises:
        SystemExit: none is given, or it breaks the rule of ``worker_protocol.secret_from_line``, with one
            line saying so.
    """
    if args.secret_stdin:
        data, origin = _read_secret_line(sys.stdin.fileno()), "standard input's first line"
    elif args.secret_file:
        try:
            with open(args.secret_file, "rb") as f:
                data = f.readline(64 * 1024)
        except OSError as exc:
            raise SystemExit(f"python -m smartredis_io.worker: --secret-file {args.secret_file}: {exc.strerror}") from None
        origin = f"--secret-file {args.secret_file}"
    elif os.environ.get(SECRET_ENV):
        data, origin = os.environb[SECRET_ENV.encode()], f"${SECRET_ENV}"
    else:
        raise SystemExit(NO_SECRET)
    try:
        return secret_from_line(data, origin)
    except ValueError as exc:
        raise SystemExit(f"python -m smartredis_io.worker: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m smartredis_io.worker`` command line; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m smartredis_io.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=os.environ.get("SSDB"),
                        help="host:port[,host:port...] or unix:///path (default $SSDB)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda:N, or cuda (worker i on GPU i modulo the GPU count): where models set for "
                             "device GPU run; a model set for GPU:N runs on GPU N, one set for CPU on the CPU")
    parser.add_argument("--workers", type=int, default=1, help="worker processes sharing the requests")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--interop-threads", type=int, default=None,
                        help="torch inter-op threads per worker (default: torch's)")
    parser.add_argument("--name", default="", help="worker name prefix (default host:pid)")
    parser.add_argument("--user", default=None,
                        help="run models as this user: started as root, the worker connects, then drops to it")
    parser.add_argument("--allow-root", action="store_true",
                        help="run models as root (refused without this flag or --user when started as root)")
    parser.add_argument("--healthy-after", type=float, default=HEALTHY_AFTER_S, metavar="S",
                        help="a worker that exits after running this many seconds is started again at once; one that "
                             f"dies sooner, after pauses that double up to {RESTART_BACKOFF_MAX_S:g} s; default: "
                             "%(default)s")
    secret = parser.add_mutually_exclusive_group()
    secret.add_argument("--secret-file", default=None,
                        help="the module's worker secret is this file's first line: the file the module reads as its "
                             f"WORKER_SECRET_FILE (default ${SECRET_ENV}; one of them is required)")
    secret.add_argument("--secret-stdin", action="store_true",
                        help="the secret is standard input's first line, and the end of standard input means the "
                             "server is gone: the workers are stopped. How the Redis module starts its workers: "
                             "in a cluster, they take requests from that server only")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("--address or $SSDB is required")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.threads < 1 or (args.interop_threads is not None and args.interop_threads < 1):
        parser.error("--threads and --interop-threads must be at least 1")
    if not args.healthy_after >= 0:
        parser.error(f"--healthy-after must be a number of seconds, at least 0, got {args.healthy_after}")
    if os.geteuid() == 0 and not args.user and not args.allow_root:
        parser.error("refusing to run stored models as root: pass --user NAME (e.g. --user nobody) to drop to "
                     "an unprivileged user, or --allow-root if the database's writers are trusted with root")
    if args.user and os.geteuid() != 0 and args.user != pwd.getpwuid(os.geteuid()).pw_name:
        parser.error(f"--user {args.user}: only a worker started as root can change its user")
    options_secret = _secret(args)
    if args.secret_stdin:
        _take_log(sys.stdin.fileno())
    _configure_logging()
    address = args.address
    if address.startswith("unix:") and not address.startswith("unix://"):
        address = "unix://" + address[len("unix:"):]  # unix:/path, as servers print it
    settings = ConnectionSettings.from_options(address=address, cluster=False)
    try:
        settings = settings.with_(cluster=detect_cluster(settings))
    except Exception as exc:
        if args.secret_stdin:  # the module shows it (its log has the traceback)
            _tell_module(sys.stdin.fileno(), f"the supervisor could not reach {address}: {_start_error(exc)}")
        raise
    base = args.name or f"{socket.gethostname()}:{os.getpid()}"
    options = WorkerOptions(settings, args.device, args.threads, args.interop_threads, args.user, options_secret,
                            own_server=args.secret_stdin)
    lifeline = sys.stdin.fileno() if args.secret_stdin else None
    supervisor = _Supervisor(options, base, args.workers, lifeline, args.healthy_after)
    code = supervisor.run()
    if args.secret_stdin:
        _wait_for_children()
    if supervisor.lifeline is not None:
        _end_with_module(supervisor.lifeline)
    return code

