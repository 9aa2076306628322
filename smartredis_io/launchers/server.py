"""Embedded redis-server launchers: standalone, a real N-shard Redis Cluster, and an Orchestrator with workers.

Every launcher authenticates where asked to: a password for the default user, and ACL users with
roles (``client``: data commands and RedisAI's commands, writes only to its key patterns;
``worker``: what execution workers need; ``admin``: everything). A server that listens on anything but loopback must have one
or the other. Secrets go to the server in a configuration file only its owner can read, never on a
command line; TLS is used when ``tls`` files are given.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis

from lightning_storage_plugins.services import (
    ManagedProcess,
    ServiceStartError,
    find_binary,
    free_port,
    is_loopback,
)
from smartredis_io._client.connection import ConnectionSettings, plain_client
from smartredis_io.worker.worker_protocol import SECRET_ENV

__all__ = ["AclUser", "Orchestrator", "RedisCluster", "RedisServer", "TlsFiles"]

log = logging.getLogger(__name__)

BINARY_ENV_VAR = "REDIS_SERVER_BIN"
CLUSTER_READY_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 1.0
LAUNCHER_TIMEOUT_S = 10.0  # deadlines of the settings() a launcher hands out
INSTALL_HINT = (
    "Install Redis 7 or newer (Debian/Ubuntu: `apt-get install redis-server`; macOS: `brew install redis`), "
    f"or set ${BINARY_ENV_VAR} to the redis-server binary."
)
ROLES = ("client", "worker", "admin")
# Commands every role needs: data types, key checks, blocking pops, and the cluster topology reads
# redis-py makes. Nothing that changes the server or reads its configuration (@dangerous), and no
# server-side scripts (@scripting: EVAL, and FUNCTION LOAD, which @write would let through).
_DATA_COMMANDS = (
    "-@all +@read +@write +@keyspace +@connection +@transaction +@blocking -@dangerous -@scripting "
    "+cluster|slots +cluster|shards +cluster|nodes +cluster|info +cluster|myid +cluster|keyslot"
)
# RedisAI's data commands of the smartredis_io module (module commands are in no ACL category on
# Redis 7.0, so each is named; naming one the server does not have is an error, so only with the module)
_MODULE_DATA_COMMANDS = " ".join(f"+ai.{name}" for name in (
    "tensorset", "tensorget", "modelstore", "modelset", "modelget", "modeldel", "scriptset", "scriptstore",
    "scriptget", "scriptdel", "info", "config"))
# The module's commands that run models and scripts: clients send them, the module checks their ACL.
_MODULE_RUN_COMMANDS = "+ai.modelexecute +ai.scriptexecute +ai.scriptrun"
# The module commands execution workers take requests and answer them with; no client has them
# (and the module serves them only on connections that proved they know its worker secret).
_WORKER_MODULE_COMMANDS = (
    "+srio.hello +srio.pop +srio.take +srio.reply +srio.return +srio.pause +srio.heartbeat +srio.unregister"
)
WORKER_SECRET_FILE = "worker-secret"


def _module_arg(args: Sequence[str], name: str) -> str | None:
    """The value of the module argument ``name`` in ``args`` (NAME value pairs), or None."""
    return next((value for key, value in zip(args[0::2], args[1::2], strict=False) if key.upper() == name), None)


@dataclass(frozen=True)
class AclUser:
    """A Redis ACL user for a launcher.

    Args:
        name: the user name (clients set ``SR_USERNAME`` to it).
        password: its password (clients set ``SR_PASSWORD``).
        role: ``"client"``: reads every key, writes only ``write_keys``, runs models and scripts
            (RedisAI's commands; a run's outputs must be keys it may write); ``"worker"``: what
            execution workers need, on every key; ``"admin"``: every command on every key.
        write_keys: glob patterns of the keys a ``client`` may write, e.g. ``("sim1.*",)`` for a
            client writing with ``SSKEYOUT=sim1``; the chunk keys of a large value (``{key}...``)
            are allowed with their key.
    """

    name: str
    password: str = field(repr=False)
    role: str = "client"
    write_keys: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.name or any(c.isspace() for c in self.name) or self.name == "default":
            raise ValueError(f"invalid ACL user name {self.name!r}")
        if not self.password:
            raise ValueError(f"ACL user {self.name!r} needs a password")

    def rule(self, *, module: bool = False) -> list[str]:
        """The ACL rule of this user, as ``user`` directive tokens (``module``: the server loads the
        smartredis_io Redis module, whose commands the rule then names)."""
        head = [self.name, "reset", "on", f">{self.password}", "resetchannels"]
        module_commands = _MODULE_DATA_COMMANDS.split() if module else []
        if self.role == "admin":
            return head + ["~*", "&*", "+@all"]
        if self.role == "worker":
            return head + ["~*", *_DATA_COMMANDS.split(), *module_commands,
                           *(_WORKER_MODULE_COMMANDS.split() if module else [])]
        patterns = [*self.write_keys, *(f"{{{p}" for p in self.write_keys if not p.startswith("{"))]
        # A write key is readable and writable through one pattern: Redis grants a command that
        # reads and writes one key (SET ... GET, HSET after HGETALL in one MULTI) only when a
        # single pattern allows both; every key is readable anyway.
        keys = ["%R~*", *(f"~{p}" for p in patterns)]
        return head + keys + _DATA_COMMANDS.split() + module_commands + (_MODULE_RUN_COMMANDS.split() if module else [])


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS-only server: its certificate and key, and the CA that signed it."""

    cert_file: str
    key_file: str
    ca_cert_file: str


def _quote(token: str) -> str:
    """A token of redis.conf, quoted so that any character survives."""
    escaped = token.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


class RedisServer:
    """One redis-server at a free port (loopback by default), without persistence unless asked.

    Args:
        host: the address to listen on; anything but loopback needs ``password`` or ``users``.
        port: the port (default: a free one).
        persistence: keep RDB snapshots and the AOF (off: a cache for one job).
        password: the default user's password (it has every right); with ``users`` and no
            ``password``, one is generated for the launcher's own use.
        users: ACL users (see :class:`AclUser`).
        tls: serve TLS only, with these files.
        extra_args: more redis-server arguments; with `--cluster-enabled` and no `--cluster-port`, the
            cluster bus gets a free port of its own.
        startup_timeout_s: how long to wait for the server to answer.
        module: load the smartredis_io Redis module (RedisAI's commands for SmartRedis clients;
            see :mod:`smartredis_io.launchers.redis_module`): ``True`` (default) the one of this package,
            a path for another build, ``False`` for a plain Redis.
        module_args: the module's arguments (``NAME value`` pairs, e.g. ``("MODEL_CHUNK_SIZE", "1048576")``).
            The module starts no execution worker of its own unless they name ``WORKERS``.
        worker_secret: what execution workers show the module (``SRIO.HELLO``); default: a random
            one, or the first line of the module's ``WORKER_SECRET_FILE`` when ``module_args`` names one.
            The launcher hands it to the module in a file only its owner can read.
        env: more environment variables for redis-server.

    Raises:
        ValueError: a non-loopback ``host`` without authentication, or two users of one name.
        smartredis_io.launchers.redis_module.RedisModuleNotFoundError: ``module=True`` and the module is not built.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        persistence: bool = False,
        password: str | None = None,
        users: Sequence[AclUser] = (),
        tls: TlsFiles | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 15.0,
        module: bool | str = True,
        module_args: Sequence[str] = (),
        worker_secret: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if not is_loopback(host) and not password and not users:
            raise ValueError(
                f"refusing to start redis-server on {host}: anyone who can reach it could read, change and run "
                "everything stored; pass password= or users= (or listen on 127.0.0.1)"
            )
        names = [user.name for user in users]
        if len(set(names)) != len(names):
            raise ValueError(f"ACL user names must be unique, got {names}")
        self.host = host
        self.port = port or free_port(host if is_loopback(host) else "127.0.0.1")
        self.users = tuple(users)
        self.tls = tls
        self._password = password or (secrets.token_urlsafe(24) if users else None)
        self._persistence = persistence
        self._extra_args = tuple(extra_args)
        if "--cluster-enabled" in self._extra_args and "--cluster-port" not in self._extra_args:
            # redis-server's default bus port is ours + 10000, which does not exist above port 55535
            self._extra_args += ("--cluster-port", str(free_port("127.0.0.1")))
        self._startup_timeout_s = startup_timeout_s
        self._binary = find_binary("redis-server", BINARY_ENV_VAR, install_hint=INSTALL_HINT)
        if module is True:
            # imported here: `python -m smartredis_io.redis_module` runs that module as __main__, which runpy
            # warns about when importing the package has already imported it
            from smartredis_io.launchers.redis_module import module_path

            module = module_path()
        self.module = os.fspath(module) if module else None
        self._module_args = tuple(module_args)
        self._secret_file = _module_arg(self._module_args, "WORKER_SECRET_FILE")
        self._worker_secret = worker_secret or (None if self._secret_file else secrets.token_hex(32))
        self._env = dict(env or {})
        self._workdir: Path | None = None
        self._process: ManagedProcess | None = None

    @property
    def address(self) -> str:
        """``host:port``, the form SmartRedis' ``SSDB`` takes (loopback when listening on every interface)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"{host}:{self.port}"

    @property
    def worker_secret(self) -> str | None:
        """What execution workers show the module (``SRIO.HELLO``); None without the module."""
        if not self.module:
            return None
        if self._secret_file:
            with open(self._secret_file) as f:
                return f.readline().strip()
        return self._worker_secret

    @property
    def pids(self) -> list[int]:
        """Process id of the running server (empty when stopped)."""
        return [self._process.pid] if self._process and self._process.pid else []

    def settings(self, user: str | None = None, *, cluster: bool = False) -> ConnectionSettings:
        """How to connect as ``user`` (default: the default user, with every right)."""
        if user is None:
            username, password = None, self._password
        else:
            match = [u for u in self.users if u.name == user]
            if not match:
                raise KeyError(f"no ACL user {user!r} on this server")
            username, password = user, match[0].password
        tls = {"tls": True, "tls_ca_cert": self.tls.ca_cert_file} if self.tls else {}
        return ConnectionSettings(self.address, cluster, username=username, password=password,
                                  connect_timeout_s=LAUNCHER_TIMEOUT_S, connect_interval_s=0.1,
                                  command_timeout_s=LAUNCHER_TIMEOUT_S, **tls)

    def _config(self) -> str:
        lines = [
            f"bind {self.host}",
            "protected-mode yes",
            "daemonize no",
            "loglevel warning",
            f"dir {_quote(str(self._workdir))}",
        ]
        if self.tls:
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {_quote(self.tls.cert_file)}",
                      f"tls-key-file {_quote(self.tls.key_file)}", f"tls-ca-cert-file {_quote(self.tls.ca_cert_file)}",
                      "tls-auth-clients optional", "tls-replication yes"]
        else:
            lines.append(f"port {self.port}")
        if not self._persistence:
            lines += ['save ""', "appendonly no"]
        if self._password:
            lines.append(f"requirepass {_quote(self._password)}")
        if self.module:
            args = list(self._module_args)
            if _module_arg(args, "WORKERS") is None and _module_arg(args, "THREADS_PER_QUEUE") is None:
                args += ["WORKERS", "0"]  # the launchers start workers themselves (Orchestrator)
            if not self._secret_file:
                args += ["WORKER_SECRET_FILE", str(self._workdir / WORKER_SECRET_FILE)]
            lines.append("loadmodule " + " ".join(_quote(token) for token in (self.module, *args)))
        lines += ["user " + " ".join(_quote(token) for token in user.rule(module=bool(self.module)))
                  for user in self.users]
        return "\n".join(lines) + "\n"

    def start(self) -> RedisServer:
        """Start the server and wait until it answers (authenticated); clean up if it does not."""
        self._workdir = Path(tempfile.mkdtemp(prefix="redis-"))
        try:
            config = self._workdir / "redis.conf"
            if self.module and not self._secret_file:
                fd = os.open(self._workdir / WORKER_SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(f"{self._worker_secret}\n")
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self._config())
            self._process = ManagedProcess(
                f"redis-server:{self.port}",
                [self._binary, str(config), *self._extra_args],
                ready=self._answers,
                startup_timeout_s=self._startup_timeout_s,
                env={**os.environ, **self._env} if self._env else None,
            )
            self._process.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        """True when the redis-server answering at our port is our process (not a squatter)."""
        settings = self.settings()
        client = plain_client(("127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host, self.port), settings,
                               PROBE_TIMEOUT_S)
        try:
            return client.info("server").get("process_id") == self._process.pid
        except redis.exceptions.AuthenticationError as exc:
            raise ServiceStartError(f"redis-server:{self.port} refused the launcher's credentials: {exc}") from None
        except redis.exceptions.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        if self._process is not None:
            self._process.stop()
            self._process = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster:
    """A Redis Cluster of ``shards`` primaries (no replicas), slots spread evenly.

    Takes ``host``, ``password``, ``users``, ``tls``, ``module``, ``module_args``, ``worker_secret`` and
    ``env`` as :class:`RedisServer` does (every node gets them; the cluster bus uses TLS too when
    ``tls`` is given).
    """

    def __init__(self, shards: int = 3, host: str = "127.0.0.1", *, password: str | None = None,
                 users: Sequence[AclUser] = (), tls: TlsFiles | None = None,
                 startup_timeout_s: float = 15.0, module: bool | str = True,
                 module_args: Sequence[str] = (), worker_secret: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        if shards < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 primaries, got shards={shards}")
        self.host = host
        password = password or (secrets.token_urlsafe(24) if users else None)
        worker_secret = worker_secret or secrets.token_hex(32)  # one for every node: a worker serves them all
        cluster_args: tuple[str, ...] = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                         "--cluster-node-timeout", "5000")
        if tls:
            cluster_args += ("--tls-cluster", "yes")
        self._nodes = [
            RedisServer(host, password=password, users=users, tls=tls,
                        extra_args=cluster_args,
                        startup_timeout_s=startup_timeout_s, module=module, module_args=module_args,
                        worker_secret=worker_secret, env=env)
            for _ in range(shards)
        ]

    @property
    def address(self) -> str:
        """Comma-separated ``host:port`` list of every primary, as ``SSDB`` takes it."""
        return ",".join(node.address for node in self._nodes)

    @property
    def ports(self) -> list[int]:
        """Port of every primary."""
        return [node.port for node in self._nodes]

    @property
    def pids(self) -> list[int]:
        """Process id of every running node."""
        return [pid for node in self._nodes for pid in node.pids]

    @property
    def users(self) -> tuple[AclUser, ...]:
        """The ACL users every node has."""
        return self._nodes[0].users

    @property
    def worker_secret(self) -> str | None:
        """What execution workers show every node's module (``SRIO.HELLO``); None without the module."""
        return self._nodes[0].worker_secret

    def settings(self, user: str | None = None) -> ConnectionSettings:
        """How to connect to the cluster as ``user`` (default: the default user)."""
        return self._nodes[0].settings(user, cluster=True).with_(address=self.address)

    def start(self) -> RedisCluster:
        """Start every node, create the cluster and wait until it serves every slot; clean up if it does not."""
        try:
            for node in self._nodes:
                node.start()
            self._create()
        except BaseException:
            self.stop()
            raise
        return self

    def _create(self) -> None:
        cli = find_binary("redis-cli", "REDIS_CLI_BIN", install_hint=INSTALL_HINT)
        settings = self._nodes[0].settings()
        env = {**os.environ, "REDISCLI_AUTH": settings.password} if settings.password else None
        tls = ["--tls", "--cacert", settings.tls_ca_cert] if settings.tls else []
        result = subprocess.run(
            [cli, *tls, "--cluster", "create", *(n.address for n in self._nodes), "--cluster-replicas", "0",
             "--cluster-yes"],
            capture_output=True, text=True, timeout=CLUSTER_READY_TIMEOUT_S, env=env,
        )
        if result.returncode != 0:
            raise ServiceStartError(f"redis-cli --cluster create failed:\n{result.stdout}{result.stderr}")
        deadline = time.monotonic() + CLUSTER_READY_TIMEOUT_S
        while not all(self._node_ok(node) for node in self._nodes):
            if time.monotonic() > deadline:
                raise ServiceStartError(f"Redis Cluster {self.address} did not reach cluster_state:ok")
            time.sleep(0.1)
        log.info("Redis Cluster up: %s", self.address)

    @staticmethod
    def _node_ok(node: RedisServer) -> bool:
        client = plain_client(("127.0.0.1" if node.host in ("0.0.0.0", "::") else node.host, node.port),
                               node.settings(), PROBE_TIMEOUT_S)
        try:
            return client.cluster("info").get("cluster_state") == "ok"
        finally:
            client.close()

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        for node in self._nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


WORKER_READY_TIMEOUT_S = 60.0  # a worker imports torch before it registers
DEFAULT_WORKER_USER = "nobody"


def _worker_privileges(user: str | None, allow_root: bool) -> list[str]:
    """The worker's command-line flags that say which user runs the models."""
    if user:
        return ["--user", user]
    if allow_root:
        return ["--allow-root"]
    return ["--user", DEFAULT_WORKER_USER] if os.geteuid() == 0 else []


def settings_env(settings: ConnectionSettings) -> dict[str, str]:
    """The environment variables that give a process these credentials and TLS settings."""
    env = {"SR_USERNAME": settings.username or "", "SR_PASSWORD": settings.password or ""}
    if settings.tls:
        env.update(SR_TLS="1", SR_TLS_CA_CERT=settings.tls_ca_cert or "", SR_TLS_CERT=settings.tls_cert or "",
                   SR_TLS_KEY=settings.tls_key or "")
    return env


class Orchestrator:
    """An embedded database plus execution workers on this machine, like SmartSim's Orchestrator.

    ``shards=1`` starts a standalone redis-server, ``shards>=3`` a real Redis Cluster; ``workers``
    worker processes (``python -m smartredis_io.worker``) serve run_model / run_script. Everything
    stops on exit. ``env`` holds the variables a SmartRedis client reads (``SSDB``, ``SR_DB_TYPE``);
    credentials are not in it (see :meth:`settings`).

    Workers run whatever models the database's writers store. Started by root, they drop to
    ``worker_user`` (default ``nobody``) once connected, unless ``allow_root_workers`` is set. They
    connect as the first ACL user of role ``worker`` if there is one, else as the default user.

    ``password``, ``users``, ``tls``, ``host``, ``module`` and ``module_args`` are those of
    :class:`RedisServer`: the database loads the smartredis_io Redis module, so that SmartRedis
    clients in C, C++, Fortran and Python use it too (its workers are these, the module starts
    none); ``server_env`` is more environment for redis-server (``RedisServer``'s ``env``).
    """

    def __init__(self, shards: int = 1, workers: int = 1, *, device: str = "cpu", threads: int = 1,
                 host: str = "127.0.0.1", worker_env: dict[str, str] | None = None,
                 worker_user: str | None = None, allow_root_workers: bool = False,
                 password: str | None = None, users: Sequence[AclUser] = (), tls: TlsFiles | None = None,
                 module: bool | str = True, module_args: Sequence[str] = (),
                 server_env: dict[str, str] | None = None) -> None:
        if shards not in (1,) and shards < 3:
            raise ValueError(f"shards must be 1 (standalone) or >= 3 (cluster), got {shards}")
        self.cluster = shards > 1
        auth = {"password": password, "users": users, "tls": tls, "module": module, "module_args": module_args,
                "env": server_env}
        self.database: RedisServer | RedisCluster = (
            RedisCluster(shards, host, **auth) if self.cluster else RedisServer(host, **auth)
        )
        self._device = device
        self._threads = threads
        self._worker_env = worker_env
        self._worker_privileges = _worker_privileges(worker_user, allow_root_workers)
        worker_users = [u.name for u in users if u.role == "worker"]
        self._worker_login = worker_users[0] if worker_users else None
        self._n_workers = workers
        self.workers: list[ManagedProcess] = []
        self._started = 0

    @property
    def address(self) -> str:
        """The database's address, as ``SSDB`` takes it."""
        return self.database.address

    @property
    def env(self) -> dict[str, str]:
        """``SSDB`` and ``SR_DB_TYPE`` for SmartRedis clients (credentials are not in it)."""
        return {"SSDB": self.address, "SR_DB_TYPE": "Clustered" if self.cluster else "Standalone"}

    def settings(self, user: str | None = None) -> ConnectionSettings:
        """How to connect as ``user`` (default: the default user, with every right)."""
        return self.database.settings(user)

    @property
    def worker_pids(self) -> list[int]:
        """Process id of every worker process started here that runs models now (a supervisor
        process per ``add_worker`` starts it, and starts a new one when it dies)."""
        prefix = f"orchestrator-{id(self):x}-"
        return [pid for name, pid in self._registry().items() if name.startswith(prefix)]

    def add_worker(self) -> ManagedProcess:
        """Start one more worker process and wait until it takes requests."""
        worker, name = self._spawn_worker()
        self._wait_registered([(worker, name)])
        return worker

    def _spawn_worker(self) -> tuple[ManagedProcess, str]:
        # Started from the calling thread, never a helper thread: the kernel's parent-death signal
        # (see lightning_storage_plugins.services) fires when the *thread* that forked the child exits.
        name = f"orchestrator-{id(self):x}-{self._started}"
        self._started += 1
        credentials = settings_env(self.settings(self._worker_login))  # in the environment, not on argv
        credentials[SECRET_ENV] = self.database.worker_secret or ""
        worker = ManagedProcess(
            f"smartredis-worker:{name}",
            [sys.executable, "-m", "smartredis_io.worker", "--address", self.address, "--device", self._device,
             "--threads", str(self._threads), "--name", name, *self._worker_privileges],
            ready=lambda: True,  # registration is awaited below, for all workers at once
            env={**os.environ, **(self._worker_env or {}), **credentials},
        )
        worker.start()
        self.workers.append(worker)
        return worker, f"{name}.0"

    def _registry(self) -> dict[str, int]:
        """Name -> pid of every worker registered on the database (``SRIO.WORKERS``; each registers on every server)."""
        host = "127.0.0.1" if self.database.host in ("0.0.0.0", "::") else self.database.host
        port = self.database.ports[0] if self.cluster else self.database.port
        with plain_client((host, port), self.settings(), LAUNCHER_TIMEOUT_S) as client:
            # one connection: the module answers SRIO.WORKERS only where SRIO.HELLO was said
            _, entries = (client.pipeline(transaction=False).execute_command("SRIO.HELLO", self.database.worker_secret)
                          .execute_command("SRIO.WORKERS").execute())
            return {name.decode(): int(pid) for name, pid, *_ in entries}

    def _registered(self, names: list[str]) -> bool:
        return set(names) <= set(self._registry())

    def _wait_registered(self, started: list[tuple[ManagedProcess, str]]) -> None:
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        names = [name for _, name in started]
        while not self._registered(names):
            for worker, _ in started:
                if not worker.is_running():
                    raise ServiceStartError(f"{worker.name} exited during start-up; log tail:\n{worker.log_tail()}")
            if time.monotonic() > deadline:
                raise ServiceStartError(f"workers {names} did not register within {WORKER_READY_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        log.info("%d execution worker(s) up on %s", len(started), self.address)

    def start(self) -> Orchestrator:
        """Start the database and the workers and wait until every worker takes requests."""
        try:
            self.database.start()
            self._wait_registered([self._spawn_worker() for _ in range(self._n_workers)])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the workers, then the database (idempotent)."""
        for worker in self.workers:
            worker.stop()
        self.workers.clear()
        self.database.stop()

    def __enter__(self) -> Orchestrator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
