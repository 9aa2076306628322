"""A private Slurm cluster on this machine, with accounting, for tests and the test-run benchmarks.

:class:`LocalSlurm` starts Debian's Slurm daemons as root, the way ``RedisCluster`` starts Redis: in a
directory of its own, on free ports, each daemon a :class:`~lightning_storage_plugins.services.ManagedProcess`
waited for until it answers, and everything stopped and removed on exit. It has its own ``munged``
(its own key and socket), and with ``accounting=True`` its own MariaDB server and ``slurmdbd``; it never
reads ``/etc/slurm`` or ``/etc/munge`` and never starts a system service, so two test sessions can
each run one. ``nodes`` ``slurmd`` processes on this one host (``slurmd -N n1``...) make a multi-node
cluster, so that a job spanning three nodes has them.

The daemons run without cgroups: ``ProctrackType=proctrack/linuxproc`` (a job's processes are found
through their parent chain) and ``TaskPlugin=task/none``. Every node declares this machine's CPUs and
the partition oversubscribes each core four times (``OverSubscribe=FORCE:4``), so that a few jobs run
side by side on a 2-core machine, as they would on a cluster's nodes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import psutil

from lightning_storage_plugins.services import ManagedProcess, ServiceStartError, free_port

__all__ = [
    "LocalSlurm",
    "SlurmCommandError",
    "SlurmError",
    "SlurmJobError",
    "parse_scontrol",
    "slurm_unavailable_reason",
]

SLURM_BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "salloc", "scontrol", "scancel",
                  "sinfo", "squeue")
ACCOUNTING_BINARIES = ("slurmdbd", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")
INSTALL_HINT = "`make setup` installs them (Debian: apt-get install slurm-wlm munge slurmdbd mariadb-server)"
# Slurm's daemons (and MariaDB) are found on PATH, with the system directories root's PATH has added:
# Debian puts the daemons in /usr/sbin.
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")
# Variables of an enclosing Slurm job or of a user's shell that would steer our client commands
# (SBATCH_PARTITION, SLURM_JOB_ID...) to something other than what the caller asked for.
_INHERITED_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SACCT_", "SCONTROL_")
# SmartRedis' and SmartSim's client variables: the database of this process (an earlier test's) is none of
# a job's, and a step given its SSDB connects there instead of to the database its experiment launched.
_CLIENT_VARIABLES = ("SSDB", "SR_DB_TYPE", "SSKEYIN", "SSKEYOUT")
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                             "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "NodeList", "NNodes", "NTasks", "Start", "End")
POLL_INTERVAL_S = 0.25
PROBE_TIMEOUT_S = 1.0
KILL_TIMEOUT_S = 10.0
CLOCK_MARGIN_S = 0.05
OUTPUT_TAIL_BYTES = 2048
_MIB = 1 << 20

log = logging.getLogger(__name__)


class SlurmError(RuntimeError):
    """Something the local Slurm cluster was asked to do did not happen."""


class SlurmCommandError(SlurmError):
    """A Slurm client command failed or outlived its deadline; the message carries its output."""


class SlurmJobError(SlurmError):
    """A job ended, or did not reach a state in time; the message names its state, reason and output."""


def _search_path() -> str:
    dirs = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return os.pathsep.join(dirs + [d for d in SYSTEM_DIRS if d not in dirs])


def slurm_unavailable_reason(*, accounting: bool = True) -> str | None:
    """Why a :class:`LocalSlurm` cannot run here, or None when it can.

    Args:
        accounting: whether the cluster would run with accounting (``slurmdbd`` and MariaDB).
    """
    if not hasattr(os, "geteuid") or not Path("/proc").is_dir():
        return "the local Slurm cluster needs Linux"
    path = _search_path()
    missing = [name for name in SLURM_BINARIES + (ACCOUNTING_BINARIES if accounting else ())
               if shutil.which(name, path=path) is None]
    if missing:
        return f"Slurm is not installed here (missing {', '.join(missing)}): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return ("the local Slurm cluster runs its daemons as root (SlurmUser=root, no cgroups); "
                "run the tests as root, as CI does")
    return None


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S):
        return True


def _unix_listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_TIMEOUT_S)
        sock.connect(os.fspath(path))
        return True


def parse_scontrol(line: str) -> dict[str, str]:
    """The fields of one line of ``scontrol show -o`` (``Key=value Key=value ...``), by key: a value may
    hold ``=`` and spaces, but no space followed by a ``Key=``."""
    fields = re.split(r"\s+(?=[A-Za-z][\w:/]*=)", line.strip())
    return dict(field.partition("=")[::2] for field in fields if "=" in field)


class LocalSlurm:
    """A private Slurm cluster: ``munged``, ``slurmctld``, ``nodes`` ``slurmd``, and with accounting
    MariaDB and ``slurmdbd``, all in a temporary directory, on free ports reached over loopback.

    MariaDB listens on loopback only. Slurm's daemons listen on every interface, as Slurm 22.05 does
    (it can bind slurmd to one address, not slurmctld or slurmdbd), and take only messages signed by
    this cluster's own munge key, which only root can read.

    Timeouts are Slurm's defaults, which users' clusters have, except where a test would wait on them
    for nothing (each is set in :meth:`_slurm_conf` with its reason). A requeued job keeps Slurm's
    hold of about two minutes (its ``BeginTime``, the job credential's lifetime) as on any cluster:
    :meth:`requeue_now` lifts it.

    Args:
        nodes: how many ``slurmd`` (nodes ``n1``, ``n2``...) run on this host.
        accounting: run ``slurmdbd`` on a MariaDB server of its own, so that ``sacct``, ``sstat`` and
            ``sacctmgr`` work (SmartSim's Slurm launcher needs them).
        cpus_per_node: the CPUs each node declares (default: this machine's; more than it has makes
            Slurm refuse the node).
        kill_wait_s: Slurm's ``KillWait``, the grace between SIGTERM and SIGKILL when a job is
            cancelled, requeued or reaches its time limit; 30 s is Slurm's default, and the grace GCE
            spot VMs and Kubernetes pods get.
        cluster_name: Slurm's ``ClusterName``.
        startup_timeout_s: how long each daemon, then every node, has to come up.
        command_timeout_s: the default deadline of a client command (:meth:`run`).
        base_dir: where the cluster's temporary directory is made (default: the system's); every
            directory above it must let others traverse it, or munged refuses its socket there.

    Raises:
        ValueError: ``nodes`` or ``cpus_per_node`` below 1, or a ``cluster_name`` Slurm refuses.
    """

    def __init__(self, nodes: int = 3, *, accounting: bool = True, cpus_per_node: int | None = None,
                 kill_wait_s: int = 30, cluster_name: str = "local", startup_timeout_s: float = 120.0,
                 command_timeout_s: float = 60.0, base_dir: str | os.PathLike[str] | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {nodes}")
        cpus = cpus_per_node or os.cpu_count() or 1
        if cpus < 1:
            raise ValueError(f"cpus_per_node must be at least 1, got {cpus_per_node}")
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,39}", cluster_name):
            raise ValueError(f"cluster_name must be lower case letters, digits and _ (Slurm's rule), "
                             f"got {cluster_name!r}")
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.accounting = accounting
        self.cpus_per_node = cpus
        self.kill_wait_s = kill_wait_s
        self.cluster_name = cluster_name
        self.partition = "debug"
        self._startup_timeout_s = startup_timeout_s
        self._command_timeout_s = command_timeout_s
        self._base_dir = base_dir
        self._path: Path | None = None
        self._daemons: list[ManagedProcess] = []
        self._ports: dict[str, int] = {}
        self._db_password = secrets.token_hex(16)

    # -- where things are ------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """The cluster's directory (configuration, state, spool, logs, database)."""
        if self._path is None:
            raise SlurmError("the local Slurm cluster is not started")
        return self._path

    @property
    def conf(self) -> Path:
        """Its ``slurm.conf`` (every client command reads it through ``$SLURM_CONF``)."""
        return self.path / "slurm.conf"

    @property
    def jobs_dir(self) -> Path:
        """Where :meth:`sbatch` runs from by default, so that ``slurm-<id>.out`` files land there."""
        return self.path / "jobs"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's client commands and for programs that call them (SmartSim's
        launcher, Lightning's requeue): this process' own, without the ``SLURM_*``-style variables of an
        enclosing job nor a SmartRedis database address (``SSDB`` and its kin), with ``SLURM_CONF`` naming
        this cluster and Slurm's directories on ``PATH``."""
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(_INHERITED_PREFIXES) and not key.startswith(_CLIENT_VARIABLES)}
        env["PATH"] = _search_path()
        env["SLURM_CONF"] = os.fspath(self.conf)
        return env

    @property
    def pids(self) -> dict[str, int]:
        """Process id of every running daemon, by name (``munged``, ``slurmctld``, ``slurmd:n1``...)."""
        return {daemon.name: daemon.pid for daemon in self._daemons if daemon.pid is not None}

    def _binary(self, name: str) -> str:
        found = shutil.which(name, path=_search_path())
        if found is None:
            raise ServiceStartError(f"{name} not found on PATH or in {', '.join(SYSTEM_DIRS)}: {INSTALL_HINT}")
        return found

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> LocalSlurm:
        """Start every daemon and wait until every node is idle (and, with accounting, the cluster is
        registered in the database); stop everything again if any of it fails.

        Raises:
            lightning_storage_plugins.services.ServiceStartError: a daemon did not come up; the
                message names it and carries its log tail.
        """
        if self._path is not None:
            raise SlurmError(f"the local Slurm cluster in {self._path} is already started")
        reason = slurm_unavailable_reason(accounting=self.accounting)
        if reason:
            raise ServiceStartError(reason)
        started = time.monotonic()
        self._path = Path(tempfile.mkdtemp(prefix="local-slurm-", dir=self._base_dir))
        log.info("starting a local Slurm cluster in %s: %d node(s), %s accounting", self._path, len(self.nodes),
                 "with" if self.accounting else "without")
        atexit.register(self.stop)
        try:
            self._layout()
            self._start_munge()
            if self.accounting:
                self._start_database()
                self._start_slurmdbd()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
            self._wait_nodes_idle()
            if self.accounting:
                self._wait_registered()
        except BaseException:
            self.stop()
            raise
        log.info("local Slurm cluster %s up in %.1f s", self.conf, time.monotonic() - started)
        return self

    def _layout(self) -> None:
        # munged refuses a socket whose directories others cannot traverse; nothing here is listable
        # or writable by others, and the key, the database and slurmdbd's password are owner-only.
        self.path.chmod(0o711)
        for sub, mode in (("run", 0o711), ("munge", 0o700), ("state", 0o700), ("log", 0o700),
                          ("jobs", 0o700), ("spool", 0o700)):
            (self.path / sub).mkdir(mode=mode)
        for node in self.nodes:
            (self.path / "spool" / node).mkdir(mode=0o700)
        self._ports = {"slurmctld": free_port(), **{node: free_port() for node in self.nodes}}
        if self.accounting:
            self._ports.update(slurmdbd=free_port(), mariadb=free_port())
        self._write(self.path / "munge" / "munge.key", os.urandom(1024), 0o600)
        # Slurm's default plugin stack file is /etc/slurm/plugstack.conf: this cluster loads none.
        self._write(self.path / "plugstack.conf", b"", 0o644)
        self._write(self.conf, self._slurm_conf().encode(), 0o644)

    @staticmethod
    def _write(path: Path, data: bytes, mode: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    @property
    def _munge_socket(self) -> Path:
        return self.path / "run" / "munge.socket"

    def _slurm_conf(self) -> str:
        d = self.path
        host = socket.gethostname().split(".")[0]
        memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // _MIB
        # each slurmd reports the whole machine's memory; the nodes share it
        node_memory = max(1, memory_mib * 9 // 10 // len(self.nodes))
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self._ports['slurmctld']}",
            f"SlurmdPort={self._ports[self.nodes[0]]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self._munge_socket}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd.%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd.%n.log",
            f"PlugStackConfig={d}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/linux",
            "JobAcctGatherFrequency=30",
            "SchedulerType=sched/backfill",
            # Not the default (3 s, which batches the scheduling of jobs submitted at a high rate): a
            # test's batch job, and a requeued one, start about a second after they are eligible
            "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "MailProg=/bin/true",
            # a node that restarts (its slurmd stopped and started by a test) is usable again at once
            "ReturnToService=2",
            # The grace between SIGTERM and SIGKILL: what preemption and requeue tests must see.
            f"KillWait={self.kill_wait_s}",
            # AuthInfo's cred_expire stays Slurm's 120 s: a requeued job is held that long, as on
            # users' clusters (requeue_now lifts the hold for one job).
            # Slurm's defaults, kept: shorter RPC deadlines, or a node declared dead sooner, fail
            # healthy daemons on a busy 2-core machine; and finished jobs stay in `scontrol show job`
            # for MinJobAge seconds, which tests read after a job ends.
            "MessageTimeout=10",
            "SlurmdTimeout=300",
            "MinJobAge=300",
            # Not the default (0: never): an allocation whose srun or salloc died (a test killed on
            # its deadline) is ended after a minute instead of holding its CPUs for the whole session.
            "InactiveLimit=60",
        ]
        if self.accounting:
            lines += [
                "AccountingStorageType=accounting_storage/slurmdbd",
                "AccountingStorageHost=127.0.0.1",
                f"AccountingStoragePort={self._ports['slurmdbd']}",
                # the munge socket of connections to slurmdbd, which do not follow AuthInfo
                f"AccountingStoragePass={self._munge_socket}",
            ]
        else:
            lines.append("AccountingStorageType=accounting_storage/none")
        lines += [
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={self._ports[node]} "
            f"CPUs={self.cpus_per_node} RealMemory={node_memory} State=UNKNOWN"
            for node in self.nodes
        ]
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
                     "State=UP OverSubscribe=FORCE:4")
        return "\n".join(lines) + "\n"

    def _daemon(self, name: str, argv: Sequence[str], ready: Callable[[], bool]) -> ManagedProcess:
        process = ManagedProcess(name, argv, ready, cwd=self.path, env=self.env,
                                 startup_timeout_s=self._startup_timeout_s)
        self._daemons.append(process)
        process.start()
        return process

    def _start_munge(self) -> None:
        m = self.path / "munge"
        self._daemon("munged", [
            # Slurm's daemons ask for more than munged's default 2 threads under load
            self._binary("munged"), "--foreground", "--num-threads=10", f"--socket={self._munge_socket}",
            f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
            f"--seed-file={m}/munged.seed",
        ], lambda: _unix_listening(self._munge_socket))

    def _start_database(self) -> None:
        db = self.path / "mysql"
        db.mkdir(mode=0o700)
        my_cnf = db / "my.cnf"
        self._write(my_cnf, "\n".join([
            "[mysqld]",
            "user=root",
            f"datadir={db}/data",
            f"socket={db}/mysqld.sock",
            f"pid-file={db}/mysqld.pid",
            f"port={self._ports['mariadb']}",
            "bind-address=127.0.0.1",
            "skip-name-resolve",
            # slurmdbd's tables are tiny; the default pool (128 MiB) is memory for nothing
            "innodb_buffer_pool_size=16M",
            "[client]",
            f"socket={db}/mysqld.sock",
            "",
        ]).encode(), 0o600)
        defaults = f"--defaults-file={my_cnf}"
        self._setup_command("mariadb-install-db", [self._binary("mariadb-install-db"), defaults, "--user=root",
                                                   "--skip-test-db"])
        self._daemon("mariadbd", [self._binary("mariadbd"), defaults],
                     lambda: _unix_listening(db / "mysqld.sock"))
        # on stdin: a password on a command line is visible to every user of the machine
        self._setup_command("mariadb", [self._binary("mariadb"), defaults], input=(
            f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{self._db_password}';\n"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';\n"))

    def _setup_command(self, name: str, argv: Sequence[str], input: str | None = None) -> None:
        try:
            result = subprocess.run(argv, input=input, capture_output=True, text=True, env=self.env,
                                    timeout=self._startup_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise ServiceStartError(f"{name} did not finish within {self._startup_timeout_s:.0f} s") from exc
        if result.returncode != 0:
            raise ServiceStartError(f"{name} exited with code {result.returncode}; output tail:\n"
                                    f"{(result.stdout + result.stderr)[-OUTPUT_TAIL_BYTES:]}")

    def _start_slurmdbd(self) -> None:
        # slurmdbd has no option for its configuration: it reads slurmdbd.conf beside $SLURM_CONF,
        # and refuses one that others can read (it holds the database password)
        self._write(self.path / "slurmdbd.conf", "\n".join([
            "AuthType=auth/munge",
            f"AuthInfo=socket={self._munge_socket}",
            "DbdHost=localhost",
            "DbdAddr=127.0.0.1",
            f"DbdPort={self._ports['slurmdbd']}",
            "SlurmUser=root",
            f"LogFile={self.path}/log/slurmdbd.log",
            f"PidFile={self.path}/run/slurmdbd.pid",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={self._ports['mariadb']}",
            "StorageUser=slurm",
            f"StoragePass={self._db_password}",
            "StorageLoc=slurm_acct_db",
            "",
        ]).encode(), 0o600)
        self._daemon("slurmdbd", [self._binary("slurmdbd"), "-D"], lambda: _listening(self._ports["slurmdbd"]))
        # the controller registers with the database only as a cluster the database knows
        self._setup_command("sacctmgr add cluster", [self._binary("sacctmgr"), "-i", "add", "cluster",
                                                     self.cluster_name])

    def _start_slurmctld(self) -> None:
        self._daemon("slurmctld", [self._binary("slurmctld"), "-D", "-f", os.fspath(self.conf)],
                     lambda: _listening(self._ports["slurmctld"]))

    def _start_slurmd(self, node: str) -> None:
        self._daemon(f"slurmd:{node}", [self._binary("slurmd"), "-D", "-f", os.fspath(self.conf), "-N", node],
                     lambda: _listening(self._ports[node]))

    def _wait_nodes_idle(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            states = self.node_states()
            if all(states.get(node) == "idle" for node in self.nodes):
                return
            # a node slurmctld refused (its configuration does not fit the machine) never comes back
            refused = [node for node, state in states.items() if state.rstrip("*~#!%$@^-") in ("inval", "drain")]
            if refused or time.monotonic() > deadline:
                reasons = self.run(["sinfo", "-h", "-R", "-o", "%N: %E"], check=False).stdout.strip()
                tails = "\n".join(f"--- {d.name}:\n{d.log_tail(1024)}" for d in self._daemons
                                  if d.name.startswith(("slurmctld", "slurmd")))
                what = f"refused {refused}" if refused else f"not idle within {self._startup_timeout_s:.0f} s"
                raise ServiceStartError(f"the nodes of the local Slurm cluster were {what} (sinfo: {states}; "
                                        f"reasons: {reasons or 'none'}); log tails:\n{tails}")
            time.sleep(POLL_INTERVAL_S)

    def _wait_registered(self) -> None:
        # the controller registers its address with slurmdbd after it starts: from then on jobs reach sacct
        deadline = time.monotonic() + self._startup_timeout_s
        port = str(self._ports["slurmctld"])
        while True:
            rows = self.run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster,controlport"],
                            check=False).stdout.split()
            if f"{self.cluster_name}|{port}" in rows:
                return
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"slurmctld did not register cluster {self.cluster_name} with slurmdbd within "
                    f"{self._startup_timeout_s:.0f} s (sacctmgr show cluster: {rows}); slurmdbd log tail:\n"
                    f"{self._daemons_by_name()['slurmdbd'].log_tail(1024)}")
            time.sleep(POLL_INTERVAL_S)

    def _daemons_by_name(self) -> dict[str, ManagedProcess]:
        return {daemon.name: daemon for daemon in self._daemons}

    def log_tail(self, daemon: str, max_bytes: int = OUTPUT_TAIL_BYTES) -> str:
        """The last ``max_bytes`` of a daemon's log (``slurmctld``, ``slurmd:n1``, ``slurmdbd``...).

        Raises:
            KeyError: no daemon of that name runs.
        """
        return self._daemons_by_name()[daemon].log_tail(max_bytes)

    # -- stop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every job and step process (``slurmstepd`` and what it started), stop the daemons and
        remove the directory. Idempotent.

        Raises:
            SlurmError: a process of the cluster survived SIGKILL (the rest is stopped and removed).
        """
        if self._path is None:
            return
        atexit.unregister(self.stop)
        survivors: list[psutil.Process] = []
        try:
            survivors += self._kill(self._job_processes())
        finally:
            for daemon in reversed(self._daemons):
                daemon.stop()
            self._daemons.clear()
            # what a step started while the daemons stopped, or that left its step's process tree
            survivors += self._kill(self._processes_of_cluster())
            shutil.rmtree(self._path, ignore_errors=True)
            self._path = None
        if survivors:
            raise SlurmError(f"processes of the local Slurm cluster survived SIGKILL: {survivors}")

    def _processes_of_cluster(self) -> list[psutil.Process]:
        """Every process started by this cluster or for it: a ``slurmstepd`` of its nodes (it works in
        the cluster's directory, where slurmd started it, with an empty environment) and everything
        below it, and every process that carries the cluster's ``SLURM_CONF`` (the daemons, the jobs,
        which ``slurmstepd`` gives it, and the programs tests start with :attr:`env`), wherever it
        moved out of its step's tree."""
        conf, home = os.fspath(self.conf), os.fspath(self.path)
        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter():
            if process.pid == os.getpid():
                continue
            with contextlib.suppress(psutil.Error):
                if process.name() == "slurmstepd" and process.cwd() == home:
                    found[process.pid] = process
                    found.update((child.pid, child) for child in process.children(recursive=True))
                elif process.environ().get("SLURM_CONF") == conf:
                    found[process.pid] = process
        return list(found.values())

    def _job_processes(self) -> list[psutil.Process]:
        daemons = {daemon.pid for daemon in self._daemons}
        return [process for process in self._processes_of_cluster() if process.pid not in daemons]

    @staticmethod
    def _kill(processes: list[psutil.Process]) -> list[psutil.Process]:
        """SIGKILL ``processes``; those still running after ``KILL_TIMEOUT_S``. A zombie counts as
        gone: a killed step's parent is init, which may reap it late."""
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while (alive := [process for process in processes if _running(process)]) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S / 5)
        return alive

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client commands -------------------------------------------------------------------------

    def run(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, input: str | None = None,
            cwd: str | os.PathLike[str] | None = None, timeout: float | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command (``sinfo``, ``srun ...``, ``scontrol ...``, or any program) against this cluster.

        Args:
            args: the command and its arguments.
            env: more environment variables, over :attr:`env`.
            input: text for its standard input.
            cwd: its working directory (default: :attr:`jobs_dir`).
            timeout: its deadline in seconds (default: the cluster's ``command_timeout_s``).
            check: raise on a non-zero exit code.

        Raises:
            SlurmCommandError: it exited with a non-zero code (with ``check``) or outlived its
                deadline; the message names the command and carries its output.
        """
        timeout = self._command_timeout_s if timeout is None else timeout
        try:
            result = subprocess.run(list(args), input=input, capture_output=True, text=True,
                                    env={**self.env, **(env or {})}, cwd=cwd or self.jobs_dir, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise SlurmCommandError(f"`{' '.join(args)}` did not finish within {timeout:.0f} s; output:\n"
                                    f"{_text(exc.stdout)}{_text(exc.stderr)}") from None
        if check and result.returncode != 0:
            raise SlurmCommandError(f"`{' '.join(args)}` exited with code {result.returncode}:\n"
                                    f"{result.stdout}{result.stderr}")
        return result

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` names it (``idle``, ``mix``, ``alloc``, ``down*``...)."""
        result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        return dict(line.split(None, 1) for line in result.stdout.splitlines() if " " in line)

    def sbatch(self, *options: str, script: str | None = None, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None) -> int:
        """Submit a batch job and return its id.

        Args:
            options: ``sbatch``'s options, and without ``script`` its script file and arguments (or
                ``--wrap=COMMAND``).
            script: the batch script's text (``#!/bin/bash`` and ``#SBATCH`` lines...), given on
                ``sbatch``'s standard input.
            env: more environment variables for ``sbatch``, which the job inherits.
            cwd: where ``sbatch`` runs, the job's working directory (default: :attr:`jobs_dir`,
                where ``slurm-<id>.out`` then lands).

        Raises:
            SlurmCommandError: ``sbatch`` refused the job.
        """
        result = self.run(["sbatch", "--parsable", *options], env=env, input=script, cwd=cwd)
        return int(result.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """The job's fields as ``scontrol show job`` gives them (``JobState``, ``Reason``, ``Restarts``,
        ``ExitCode``, ``NodeList``, ``StdOut``...).

        Raises:
            SlurmCommandError: the controller does not know the job (never submitted, or ended more
                than ``MinJobAge`` seconds ago: :meth:`sacct` still has it).
        """
        result = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        return parse_scontrol(result.stdout.splitlines()[0])

    def sacct(self, job_id: int, *, fields: Sequence[str] = SACCT_FIELDS,
              duplicates: bool = False) -> list[dict[str, str]]:
        """The accounting records of the job and its steps (``batch``, ``extern``, ``0``...), one dict each.

        Records reach the database a moment after the controller sees them, and not always in order
        (a short job's end can come before its start, and it is named ``allocation`` until then):
        poll (:meth:`wait_for` with ``source="sacct"``) rather than read once.

        Args:
            job_id: the job.
            fields: ``sacct``'s fields to read.
            duplicates: every run of a requeued job (``sacct --duplicates``), not only the newest.

        Raises:
            SlurmError: the cluster runs without accounting.
            SlurmCommandError: ``sacct`` failed.
        """
        if not self.accounting:
            raise SlurmError("this local Slurm cluster runs without accounting (accounting=False): no sacct")
        args = ["sacct", "-j", str(job_id), "--parsable2", "--noheader", f"--format={','.join(fields)}"]
        lines = self.run(args + (["--duplicates"] if duplicates else [])).stdout.splitlines()
        return [dict(zip(fields, line.split("|"), strict=True)) for line in lines if line]

    def output(self, job_id: int) -> str:
        """What the batch job wrote to its standard output file so far (``""`` before it starts): the
        file ``scontrol`` names, or once it forgot the job, ``slurm-<id>.out`` in :attr:`jobs_dir`."""
        try:
            named = self.job_info(job_id).get("StdOut")
        except SlurmCommandError:
            named = None
        path = Path(named or self.jobs_dir / f"slurm-{job_id}.out")
        return path.read_text(errors="replace") if path.is_file() else ""

    def wait_for_output(self, job_id: int, text: str, timeout: float = 120.0) -> str:
        """Poll the batch job's output until it holds ``text`` (a trap is set, a step reached...); return it.

        Args:
            job_id: the job.
            text: what to wait for.
            timeout: how long to wait, in seconds.

        Raises:
            SlurmJobError: the job ended without writing ``text``, or the deadline passed; the message
                names its state and the output's tail.
        """
        log.info("waiting up to %.0f s for job %d to write %r", timeout, job_id, text)
        deadline = time.monotonic() + timeout
        while True:
            output = self.output(job_id)
            if text in output:
                return output
            info = self._state(job_id, "scontrol")
            ended = info is not None and info["JobState"] in TERMINAL_STATES
            if ended or time.monotonic() > deadline:
                what = f"ended {self._describe(job_id, info)}" if ended else f"did not within {timeout:.0f} s"
                raise SlurmJobError(f"job {job_id} was to write {text!r} but {what}{self._output_tail(job_id)}")
            time.sleep(POLL_INTERVAL_S)

    def _state(self, job_id: int, source: str) -> dict[str, str] | None:
        """The job's fields with a plain ``JobState`` and its ``Restarts``; None while ``source`` does not
        know it yet."""
        if source == "scontrol":
            result = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
            if result.returncode == 0 and result.stdout.strip():
                return parse_scontrol(result.stdout.splitlines()[0])
            if not self.accounting or "Invalid job id" not in result.stderr:
                raise SlurmCommandError(f"`scontrol show job {job_id}` failed: {result.stderr.strip()}")
            # ended more than MinJobAge ago: only the database still has it
        # one record per run, oldest first: a job requeued twice has three
        runs = [row for row in self.sacct(job_id, duplicates=True) if row["JobID"] == str(job_id)]
        if not runs:
            return None
        # "CANCELLED by 0" -> CANCELLED
        return {**runs[-1], "JobState": runs[-1]["State"].split()[0], "Restarts": str(len(runs) - 1)}

    def wait_for(self, job_id: int, states: str | Collection[str], timeout: float = 120.0, *,
                 restarts: int | None = None, source: str = "scontrol") -> dict[str, str]:
        """Poll the job until it is in one of ``states``; return its fields then.

        Args:
            job_id: the job.
            states: ``RUNNING``, ``COMPLETED``, ``PENDING``... (Slurm's names).
            timeout: how long to wait, in seconds.
            restarts: also wait until the job has been requeued at least this many times
                (``Restarts`` in ``scontrol show job``, runs in ``sacct --duplicates``;
                ``SLURM_RESTART_COUNT`` in the job).
            source: ``"scontrol"`` (the controller, falling back to the database once it has
                forgotten the job) or ``"sacct"`` (the accounting database: wait until it has the
                record, for tests of what ``sacct`` shows).

        Raises:
            SlurmJobError: the job ended in a state not waited for (or before its ``restarts``), or
                the deadline passed; the message names the state, the reason and the output's tail.
            ValueError: an unknown ``source``.
        """
        if source not in ("scontrol", "sacct"):
            raise ValueError(f"source must be 'scontrol' or 'sacct', got {source!r}")
        wanted = {states} if isinstance(states, str) else set(states)
        waited_for = "/".join(sorted(wanted)) + (f" after {restarts} restart(s)" if restarts else "")
        log.info("waiting up to %.0f s for job %d to be %s (%s)", timeout, job_id, waited_for, source)
        deadline = time.monotonic() + timeout
        info: dict[str, str] | None = None
        while True:
            info = self._state(job_id, source)
            if info is not None:
                state = info["JobState"]
                restarted = restarts is None or int(info.get("Restarts", "0")) >= restarts
                if state in wanted and restarted:
                    return info
                if state in TERMINAL_STATES:
                    raise SlurmJobError(f"job {job_id} ended {self._describe(job_id, info)} while waiting for "
                                        f"{waited_for}{self._output_tail(job_id)}")
            if time.monotonic() > deadline:
                seen = self._describe(job_id, info) if info else (
                    "unknown to scontrol and sacct" if source == "scontrol" and self.accounting else f"unknown to {source}")
                raise SlurmJobError(f"job {job_id} was not {waited_for} within {timeout:.0f} s: it is {seen}"
                                    f"{self._output_tail(job_id)}")
            time.sleep(POLL_INTERVAL_S)

    @staticmethod
    def _describe(job_id: int, info: dict[str, str]) -> str:
        words = [info["JobState"]]
        for key in ("Reason", "ExitCode", "Restarts"):
            if info.get(key) not in (None, "", "None"):
                words.append(f"{key}={info[key]}")
        return " ".join(words)

    def _output_tail(self, job_id: int) -> str:
        with contextlib.suppress(SlurmError, OSError):
            text = self.output(job_id)
            if text:
                return f"; its output ends:\n{text[-OUTPUT_TAIL_BYTES:]}"
        return ""

    def requeue_now(self, job_id: int, timeout: float = 120.0, *, restarts: int = 1) -> None:
        """Let a requeued job start again now, instead of after Slurm's hold of about two minutes
        (``scontrol update JobId=<id> StartTime=now``).

        Waits until the job is pending after its ``restarts``-th requeue first: Slurm sets the hold
        once the previous run's processes have ended, over any earlier update. Then waits for the
        clock's next second: a node refuses a job credential issued in the second its previous run
        was killed, or earlier (what the hold is for), and Slurm would end the job as FAILED
        ("Job credential revoked").

        Args:
            job_id: the job (requeued by ``scontrol requeue``, or about to be, by the job itself).
            timeout: how long to wait for the requeue, in seconds.
            restarts: which requeue to wait for (``Restarts`` in ``scontrol show job``,
                ``SLURM_RESTART_COUNT`` in the next run): 1 for the first, 2 for the second...

        Raises:
            SlurmJobError: the job ended instead, or was not pending after that requeue within ``timeout``.
        """
        self.wait_for(job_id, "PENDING", timeout, restarts=restarts)
        pending_at = time.time()  # the previous run was killed no later than this
        time.sleep(math.floor(pending_at) + 1 - pending_at + CLOCK_MARGIN_S)
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def signal(self, job_id: int, sig: str = "USR1", *, batch: bool = True, full: bool = False) -> None:
        """Send the job a signal, as ``scancel --signal`` does.

        Args:
            job_id: the job.
            sig: the signal's name (``USR1``, ``TERM``...).
            batch: to the batch script's shell only (``--batch``), where its ``trap`` takes it; else to
                every step but the batch step.
            full: to the batch shell, its children and every step (``--full``).

        Raises:
            SlurmCommandError: ``scancel`` failed.
        """
        flags = ["--full"] if full else ["--batch"] if batch else []
        self.run(["scancel", f"--signal={sig}", *flags, str(job_id)])


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
