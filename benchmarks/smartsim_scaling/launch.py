"""Run directories, the database deployment, and the client applications of one scaling run.

A scaling test is a set of *applications* (the throughput clients; the aggregation producers and
their consumer) that run at the same time against one database. Each application is a function
``fn(comm, params, timing)`` run on ``nprocs`` ranks: as ``multiprocessing`` processes on one machine
(``--launcher local``, the default) or as the ranks of ``mpirun -n N python -m
benchmarks.smartsim_scaling.launch RUN_DIR APP`` with mpi4py (``--launcher mpi``), so the same code
scales to many nodes. Every rank writes its timings as SmartSim-Scaling's tests do: one CSV per rank, rows
``rank,function,seconds``; the run's attributes, versions and applications are in ``run.json``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import redis

if TYPE_CHECKING:
    from benchmarks.smartsim_scaling.slurm import SlurmSession

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
CLIENT_MODULES = [f"benchmarks.smartsim_scaling.{m}" for m in ("throughput", "inference", "aggregation")]
# attribute -> tag in run directory names, as SmartSim-Scaling names its sessions (N1-T4-DBN3-ITER100-TB1024)
NAME_TAGS = {"client_nodes": "N", "clients_per_node": "T", "db_nodes": "DBN", "iterations": "ITER",
             "tensor_bytes": "TB"}
TIMING_SUFFIX = "rank_{rank}_timing.csv"
BARRIER_TIMEOUT_S = 600.0
DEFAULT_RUN_TIMEOUT_S = 1800.0
MPI_POLL_INTERVAL_S = 0.05
MPI_LOG_TAIL_CHARS = 4000  # of an mpirun's output, in the error when it fails
MPI_MISSING = (
    "--launcher mpi needs mpi4py and an MPI launcher: `pip install -e '.[mpi]'` (or `pip install mpi4py`) "
    "with an MPI implementation such as Open MPI or MPICH installed"
)


# --------------------------------------------------------------------------------------------
# Communicators: what a client function may ask of its application


class Comm(Protocol):
    rank: int
    size: int

    def barrier(self) -> None: ...


class LocalComm:
    """The ranks of one application as processes of this machine, synchronised by one Barrier."""

    def __init__(self, rank: int, size: int, barrier: Any) -> None:
        self.rank = rank
        self.size = size
        self._barrier = barrier

    def barrier(self) -> None:
        # A timeout breaks the barrier for every rank, so one crashed rank never hangs the others.
        self._barrier.wait(BARRIER_TIMEOUT_S)


class MpiComm:
    """``MPI.COMM_WORLD`` of the application that ``mpirun`` started."""

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise RuntimeError(MPI_MISSING) from exc
        self._comm = MPI.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()

    def barrier(self) -> None:
        self._comm.Barrier()


class Timings:
    """The timing rows of one rank, kept in memory and written once at the end (no I/O in the loop)."""

    def __init__(self, run_dir: Path, rank: int, prefix: str = "") -> None:
        self.path = Path(run_dir) / (prefix + TIMING_SUFFIX.format(rank=rank))
        self.rank = rank
        self._rows: list[tuple[str, float]] = []

    def add(self, function: str, seconds: float) -> None:
        self._rows.append((function, seconds))

    def extend(self, function: str, seconds: Sequence[float]) -> None:
        self._rows.extend((function, s) for s in seconds)

    def write(self) -> None:
        with open(self.path, "w") as out:
            out.writelines(f"{self.rank},{function},{seconds!r}\n" for function, seconds in self._rows)


# --------------------------------------------------------------------------------------------
# Applications and their launch


@dataclass(frozen=True)
class App:
    """One application of a run: ``target`` (``module:function``) on ``nprocs`` ranks, spread over ``nodes``
    nodes where a workload manager places them (``--launcher slurm``)."""

    name: str
    target: str
    nprocs: int
    params: Mapping[str, Any] = field(default_factory=dict)
    prefix: str = ""  # of its timing files, so that two applications' ranks do not collide
    nodes: int = 1


def _resolve(target: str) -> Callable[[Comm, Mapping[str, Any], Timings], None]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run_rank(app: App, comm: Comm, run_dir: Path) -> None:
    """Run one rank of ``app`` and write its timing file, with ``main()`` as SmartSim-Scaling records it."""
    start = time.perf_counter()
    timings = Timings(run_dir, comm.rank, app.prefix)
    _resolve(app.target)(comm, app.params, timings)
    timings.add("main()", time.perf_counter() - start)
    timings.write()


def _local_rank(app: App, rank: int, barrier: Any, run_dir: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        run_rank(app, LocalComm(rank, app.nprocs, barrier), Path(run_dir))
    except BaseException:
        traceback.print_exc()
        # Wake the ranks waiting for this one: they fail at once instead of at the barrier timeout.
        barrier.abort()
        raise SystemExit(1) from None


def _context() -> multiprocessing.context.BaseContext:
    # forkserver: children fork from a clean server process (no torch thread pools or sockets of the
    # parent), and with the client modules preloaded they start in milliseconds and run the code the
    # driver loaded, even if the files change during a long sweep.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "numpy", "redis", "smartredis_io", *CLIENT_MODULES])
    return ctx


def _run_local(apps: Sequence[App], run_dir: Path, timeout_s: float) -> None:
    ctx = _context()
    procs: list[tuple[str, multiprocessing.process.BaseProcess]] = []
    # Held until every rank is done: Process.start() drops its args, and a Barrier collected before
    # a child has unpickled it takes its semaphores with it.
    barriers = []
    for app in apps:
        barrier = ctx.Barrier(app.nprocs)
        barriers.append(barrier)
        for rank in range(app.nprocs):
            proc = ctx.Process(target=_local_rank, args=(app, rank, barrier, str(run_dir)),
                               name=f"{app.name}-{rank}", daemon=True)
            proc.start()
            procs.append((f"{app.name} rank {rank}", proc))
    try:
        _wait_all(procs, timeout_s)
    finally:
        for _, proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(5)


def _wait_all(procs: Sequence[tuple[str, multiprocessing.process.BaseProcess]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(procs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"scaling run did not finish in {timeout_s:.0f} s: {sorted(pending)} still running")
        multiprocessing.connection.wait([p.sentinel for p in pending.values()], timeout=left)
        for label, proc in list(pending.items()):
            if proc.exitcode is None:
                continue
            del pending[label]
            if proc.exitcode != 0:
                raise RuntimeError(f"{label} failed with exit code {proc.exitcode} (its traceback is above)")


def _run_mpi(apps: Sequence[App], run_dir: Path, mpirun: str, timeout_s: float) -> None:
    if importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError(MPI_MISSING)
    argv0 = shlex.split(mpirun)
    if not argv0 or shutil.which(argv0[0]) is None:
        raise RuntimeError(f"MPI launcher {mpirun!r} not found on PATH; {MPI_MISSING}")
    logs = {app.name: Path(run_dir) / f"{app.prefix}{app.name}.mpirun.log" for app in apps}
    # The environment as Python holds it, not the process' C environment: an MPI library initialized
    # in this process (mpi4py, e.g. by Lightning's cluster detection) adds OMPI_*/PMIX_* variables
    # there, and an mpirun that inherits them takes itself for a nested launch and exits at once.
    env = dict(os.environ)
    procs = []
    for app in apps:
        with open(logs[app.name], "wb") as log_file:  # the child keeps its own descriptor
            procs.append((app.name, subprocess.Popen(
                [*argv0, "-n", str(app.nprocs), sys.executable, "-m", __name__, str(run_dir), app.name],
                stdout=log_file, stderr=subprocess.STDOUT, env=env)))
    deadline = time.monotonic() + timeout_s
    try:
        pending = dict(procs)
        while pending:  # polled, so that one application failing stops the others at once
            if time.monotonic() > deadline:
                raise TimeoutError(f"scaling run did not finish in {timeout_s:.0f} s: {sorted(pending)} running")
            for name, proc in list(pending.items()):
                code = proc.poll()
                if code is None:
                    continue
                del pending[name]
                if code != 0:
                    tail = logs[name].read_text(errors="replace")[-MPI_LOG_TAIL_CHARS:]
                    raise RuntimeError(f"{mpirun} for application {name} failed with exit code {code}; "
                                       f"the end of its output ({logs[name]}):\n{tail}")
            time.sleep(MPI_POLL_INTERVAL_S)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_apps(apps: Sequence[App], run_dir: Path, launcher: str = "local", mpirun: str = "mpirun",
             timeout_s: float = DEFAULT_RUN_TIMEOUT_S) -> None:
    """Run every application of a run at the same time and wait for all; a failed rank fails the run."""
    if launcher == "local":
        _run_local(apps, run_dir, timeout_s)
    elif launcher == "mpi":
        _run_mpi(apps, run_dir, mpirun, timeout_s)
    else:
        raise ValueError(f"unknown launcher {launcher!r}: expected 'local' or 'mpi'")


def mpi_main(argv: Sequence[str] | None = None) -> int:
    """Entry of one MPI rank: ``python -m benchmarks.smartsim_scaling.launch RUN_DIR APP``."""
    run_dir, app_name = (argv if argv is not None else sys.argv[1:])[:2]
    spec = read_run(Path(run_dir))
    app = next(App(**a) for a in spec["apps"] if a["name"] == app_name)
    run_rank(app, MpiComm(), Path(run_dir))
    return 0


# --------------------------------------------------------------------------------------------
# Run directories


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(address: str | None = None) -> dict[str, Any]:
    """Versions that a result depends on: Python, libraries, this project, and the server's."""
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "lightning-storage-plugins": _version("lightning-storage-plugins"),
        "numpy": _version("numpy"),
        "redis-py": _version("redis"),
        "hiredis": _version("hiredis"),
        "torch": _version("torch"),
        "smartredis": _version("smartredis"),
    }
    if address:
        found["redis_server"] = server_info(address).get("redis_version")
    return found


# --------------------------------------------------------------------------------------------
# The clients compared: smartredis_io, the published SmartRedis package, raw redis-py

#: prefix of the timing names of the published SmartRedis client (``smartredis_put_tensor``...)
PUBLISHED = "smartredis_"
#: SmartRedis 0.6.1's own settings for its client in the benchmarks: its log off the console, and a
#: socket timeout longer than a run (its default, 250 ms, makes a longer run_model fail and be sent again)
PUBLISHED_ENV = {"SR_LOG_FILE": os.devnull, "SR_LOG_LEVEL": "QUIET", "SR_SOCKET_TIMEOUT": "600000"}


def published_available() -> bool:
    """Whether the published SmartRedis client (``pip install smartredis==0.6.1``) is importable."""
    return importlib.util.find_spec("smartredis") is not None


def published_client(address: str, cluster: bool) -> Any:
    """A client of the published SmartRedis package (its C++ core, RedisAI's commands) for ``address``."""
    for name, value in PUBLISHED_ENV.items():
        os.environ.setdefault(name, value)
    import smartredis

    return smartredis.Client(address=address, cluster=cluster)


def published_dataset(name: str) -> Any:
    """A dataset of the published SmartRedis package."""
    import smartredis

    return smartredis.Dataset(name)


REDIS_PY_BUFFER_CUTOFF = 6000  # redis-py's own: values above it are sent as separate buffers


def _copy_free(base: type[redis.connection.AbstractConnection]) -> type:
    """``base`` with redis-py's pure-Python command packer, which sends a large value as it is.

    With hiredis installed redis-py packs commands with ``hiredis.pack_command``, which copies every
    value into one new buffer, at about 0.1 GB/s on this machine: a SET of 1 MiB would measure that
    copy rather than Redis. The ceiling uses the packer that does not copy.
    """

    class CopyFree(base):
        def __init__(self, **kwargs: Any) -> None:
            encoder = redis.connection.Encoder(kwargs.get("encoding", "utf-8"),
                                               kwargs.get("encoding_errors", "strict"), False)
            kwargs.setdefault("command_packer",
                              redis.connection.PythonRespSerializer(REDIS_PY_BUFFER_CUTOFF, encoder.encode))
            super().__init__(**kwargs)

    CopyFree.__name__ = CopyFree.__qualname__ = f"CopyFree{base.__name__}"
    return CopyFree


CopyFreeConnection = _copy_free(redis.connection.Connection)
CopyFreeUnixConnection = _copy_free(redis.connection.UnixDomainSocketConnection)


def raw_client(address: str, cluster: bool = False) -> redis.Redis | redis.RedisCluster:
    """A plain redis-py client of ``address`` (``host:port``, a comma list, or ``unix:///path``).

    For a cluster, the first node seeds the slot map; otherwise the first node is the server.
    Commands are packed without copying their values (see :func:`_copy_free`).
    """
    first = address.split(",")[0]
    if first.startswith("unix://"):
        pool = redis.ConnectionPool(path=first[len("unix://"):], connection_class=CopyFreeUnixConnection)
        return redis.Redis(connection_pool=pool)
    host, _, port = first.rpartition(":")
    if cluster:
        # only the from_url path hands connection_class on to the per-node pools
        return redis.RedisCluster.from_url(f"redis://{host}:{port}", connection_class=CopyFreeConnection)
    pool = redis.ConnectionPool(host=host, port=int(port), connection_class=CopyFreeConnection)
    return redis.Redis(connection_pool=pool)


def server_info(address: str) -> dict[str, Any]:
    """``INFO`` of the first node of ``address``."""
    client = raw_client(address)
    try:
        return client.info()
    finally:
        client.close()


def new_run_dir(exp_dir: Path, command: str, attributes: Mapping[str, Any], keys: Mapping[str, str]) -> Path:
    """A fresh directory named from the permutation, e.g. ``throughput-sess-N1-T4-DBN3-TB1024-1a2b3c4d``."""
    parts = [f"{command}-sess", *(f"{tag}{attributes[key]}" for key, tag in keys.items()), uuid.uuid4().hex[:8]]
    run_dir = Path(exp_dir) / "-".join(parts)
    run_dir.mkdir(parents=True)
    return run_dir


def write_run(run_dir: Path, command: str, attributes: Mapping[str, Any], apps: Sequence[App],
              address: str | None, driver_options: Mapping[str, str] | None = None) -> None:
    spec = {
        "name": run_dir.name,
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "attributes": dict(attributes),
        "versions": versions(address),
        "system": {"platform": platform.platform(), "host": socket.gethostname(), "cpus": os.cpu_count()},
        "apps": [asdict(app) for app in apps],
        "driver_options_not_used": dict(driver_options or {}),
    }
    (run_dir / RUN_FILE).write_text(json.dumps(spec, indent=2, default=str) + "\n")


def read_run(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / RUN_FILE).read_text())


# --------------------------------------------------------------------------------------------
# The database: the embedded launcher unless --address names one


@dataclass(frozen=True)
class Deployment:
    """Where the clients connect, and what the database is. ``address`` is None for databases colocated
    with each node of the application (``--launcher slurm``): its ranks find theirs in ``SSDB``."""

    address: str | None
    cluster: bool
    db_nodes: int
    colocated: bool = False


def shard_count(address: str) -> tuple[bool, int]:
    """``(cluster, primaries)`` of the database at ``address``, asked of the server, not guessed."""
    if not int(server_info(address).get("cluster_enabled", 0)):
        return False, 1
    client = raw_client(address)
    try:
        return True, int(client.cluster("info")["cluster_size"])
    finally:
        client.close()


@contextlib.contextmanager
def deploy(address: str | None, db_nodes: int, workers: int = 0, device: str = "cpu",
           colocated: bool = False) -> Iterator[Deployment]:
    """Yield a :class:`Deployment`: the database at ``address``, or one started here and torn down.

    With ``workers > 0`` that many execution worker processes serve ``run_model``/``run_script``
    (started here also when ``address`` is given, since a bare Redis has none). ``colocated`` puts the
    clients on a Unix-domain socket of a standalone server, the one-machine analogue of SmartSim's
    colocated database; the standard deployment goes through TCP loopback.
    """
    from benchmarks.smartsim_scaling import embedded

    if colocated and db_nodes > 1:
        raise ValueError("a colocated deployment is one standalone database (db_nodes=1)")
    with contextlib.ExitStack() as stack:
        if address is None:
            address = stack.enter_context(embedded.deployment(db_nodes, workers, device, colocated))
            log.info("started %s database at %s with %d workers",
                     f"{db_nodes}-shard cluster" if db_nodes > 1 else "standalone", address, workers)
        else:
            if colocated and not address.startswith("unix://"):
                raise ValueError("--colocated with --address needs a unix:///path address")
            stack.enter_context(embedded.workers_for(address, workers, device))
        cluster, shards = shard_count(address)
        yield Deployment(address=address, cluster=cluster, db_nodes=shards, colocated=colocated)


# --------------------------------------------------------------------------------------------
# A sweep: every permutation of a command, one run directory each


Prepare = Callable[[Deployment, dict[str, Any], Path], list[App]]
Summarize = Callable[[Path, dict[str, Any]], dict[str, Any]]


@dataclass
class Sweep:
    """How a command turns its permutations into runs.

    ``deployments`` are the attribute sets that need a database of their own (``db_nodes``, and
    ``workers`` for inference); ``permutations`` run against each. ``prepare`` makes a run's
    applications (and may set models in the database first); ``summarize`` reads a finished run
    into one row of the command's table; ``name_keys`` maps attributes to the run name's tags.
    """

    command: str
    deployments: list[dict[str, Any]]
    permutations: list[dict[str, Any]]
    prepare: Prepare
    summarize: Summarize
    name_keys: Mapping[str, str]
    device: str = "cpu"
    colocated: bool = False
    driver_options: dict[str, str] = field(default_factory=dict)  # the driver's, given and not used here


def run_sweep(sweep: Sweep, exp_dir: Path, address: str | None, launcher: str = "local",
              mpirun: str = "mpirun", timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
              report: Callable[[dict[str, Any]], None] | None = None,
              slurm: SlurmSession | None = None) -> list[dict[str, Any]]:
    """Run every permutation of ``sweep`` in its own run directory under ``exp_dir``; return the rows.

    With ``launcher="slurm"``, ``slurm`` starts the databases (unless ``address`` names one) and the
    applications through SmartSim's Slurm launcher; each deployment's attributes then carry ``db_cpus``.

    Raises:
        ValueError: ``launcher="slurm"`` without a ``slurm`` session.
    """
    if (launcher == "slurm") != (slurm is not None):
        raise ValueError("launcher 'slurm' runs through a SlurmSession, and only it does")
    deployments = sweep.deployments
    if address is not None:
        # One database: its size is read from the server, so --db_nodes permutes nothing.
        deployments = list({tuple((k, v) for k, v in d.items() if k != "db_nodes"): d for d in deployments}.values())
        if len(deployments) < len(sweep.deployments):
            log.info("--address names one database: --db_nodes is ignored, its shard count is asked of it")
    rows = []
    for dep_attrs in deployments:
        with _deployment(sweep, dep_attrs, address, slurm) as dep:
            for perm in sweep.permutations:
                attributes = {**dep_attrs, **perm, "db_nodes": dep.db_nodes, "cluster": dep.cluster,
                              "colocated": sweep.colocated, "launcher": launcher}
                run_dir = new_run_dir(exp_dir, sweep.command, attributes, sweep.name_keys)
                apps = sweep.prepare(dep, attributes, run_dir)
                write_run(run_dir, sweep.command, attributes, apps, dep.address, sweep.driver_options)
                log.info("run %s", run_dir)
                if slurm is None:
                    run_apps(apps, run_dir, launcher, mpirun, timeout_s)
                else:
                    colocated = dep_attrs if dep.address is None else None
                    slurm.run_apps(apps, run_dir, timeout_s, colocated=colocated)
                row = {"run": run_dir.name, **sweep.summarize(run_dir, attributes)}
                if report:
                    report(row)
                rows.append(row)
    return rows


def _deployment(sweep: Sweep, attributes: Mapping[str, Any], address: str | None,
                slurm: SlurmSession | None) -> contextlib.AbstractContextManager[Deployment]:
    workers = attributes.get("workers", 0)
    if slurm is None or address is not None:
        return deploy(address, attributes["db_nodes"], workers, sweep.device, sweep.colocated)
    if sweep.colocated:  # each run's application starts its databases, one per node
        return contextlib.nullcontext(Deployment(address=None, cluster=False, db_nodes=1, colocated=True))
    return slurm.database(attributes["db_nodes"], workers, attributes["db_cpus"])


if __name__ == "__main__":
    sys.exit(mpi_main())
