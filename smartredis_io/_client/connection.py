"""One connection layer over a standalone Redis or a Redis Cluster, with the zero-copy tensor paths.

Everything goes through redis-py except the hot paths (see :mod:`smartredis_io._client._redispy`): a tensor
put is sent as the header followed by a memoryview of the caller's array, a tensor get reads the
reply body straight into the caller's array, and the run_model request/reply exchanges are sent and
read on a pooled connection without redis-py's pipeline machinery (``Database.exchange``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from lightning_storage_plugins.messages import plain_text, warn
from smartredis_io._client import _redispy
from smartredis_io._client._redispy import Command, ReadPlan
from smartredis_io.configoptions import ConfigOptions
from smartredis_io.error import RedisConnectionError

__all__ = ["Command", "ConnectionSettings", "Database", "ReadPlan", "detect_cluster", "parse_address", "plain_client"]

log = logging.getLogger(__name__)

# SmartRedis' names, units and defaults (doc/runtime.rst of SmartRedis 0.6).
DEFAULT_CONN_TIMEOUT_S = 100  # SR_CONN_TIMEOUT (seconds): how long to keep trying to connect
DEFAULT_CONN_INTERVAL_MS = 1000  # SR_CONN_INTERVAL (milliseconds): pause between connection attempts
DEFAULT_CMD_TIMEOUT_S = 100  # SR_CMD_TIMEOUT (seconds): deadline of each command and each public operation
URL_SCHEMES = ("redis://", "rediss://")
T = TypeVar("T")


def parse_address(address: str) -> list[tuple[str, int] | str]:
    """``host:port``, a comma (or semicolon) list of them, or ``unix:///path`` -> endpoints."""
    endpoints: list[tuple[str, int] | str] = []
    for part in strip_credentials(address).replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("unix://"):
            endpoints.append(part[len("unix://"):])
            continue
        part = part.removeprefix("tcp://")
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise RedisConnectionError(f"Invalid address {part!r}: expected host:port or unix:///path")
        endpoints.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not endpoints:
        raise RedisConnectionError(f"No address in {address!r}")
    return endpoints


def strip_credentials(address: str) -> str:
    """``address`` without a ``redis://user:password@`` (or ``rediss://``) prefix."""
    for scheme in URL_SCHEMES:
        if address.startswith(scheme):
            return address[len(scheme):].rpartition("@")[2].rstrip("/")
    return address


@dataclass(frozen=True)
class ConnectionSettings:
    """Where the database is and how to reach it: credentials, TLS, deadlines.

    ``from_options`` reads them the way a SmartRedis program configures a client: ``SSDB`` (which
    may also be a ``redis://user:password@host:port`` or ``rediss://`` URL), ``SR_DB_TYPE``,
    ``SR_USERNAME`` / ``SR_PASSWORD``, ``SR_TLS`` / ``SR_TLS_CA_CERT`` / ``SR_TLS_CERT`` /
    ``SR_TLS_KEY``, and SmartRedis' ``SR_CONN_TIMEOUT`` (s), ``SR_CONN_INTERVAL`` (ms) and
    ``SR_CMD_TIMEOUT`` (s); each from the environment or a ``ConfigOptions`` override.
    """

    address: str
    cluster: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_cert: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca_data: str | None = field(default=None, repr=False)  # the CA's PEM text, instead of tls_ca_cert
    connect_timeout_s: float = DEFAULT_CONN_TIMEOUT_S
    connect_interval_s: float = DEFAULT_CONN_INTERVAL_MS / 1000
    command_timeout_s: float = DEFAULT_CMD_TIMEOUT_S
    # Where the address came from, as messages name it ("SSDB"; empty: given by the caller).
    address_source: str = field(default="", compare=False)
    #: how str keys become bytes: ``"strict"`` UTF-8 for clients; workers use ``"surrogateescape"``,
    #: so that a key they received as bytes (not always UTF-8: a cluster's model copies, SmartRedis
    #: names) and decoded with it goes back unchanged
    encoding_errors: str = "strict"

    def __post_init__(self) -> None:
        for scheme in URL_SCHEMES:
            if self.address.startswith(scheme):
                userinfo = self.address[len(scheme):].rpartition("@")[0]
                parsed = urlsplit(f"{scheme}{userinfo}@x") if userinfo else None
                object.__setattr__(self, "address", strip_credentials(self.address))
                if scheme == "rediss://":
                    object.__setattr__(self, "tls", True)
                if parsed is not None:
                    if parsed.username and self.username is None:
                        object.__setattr__(self, "username", unquote(parsed.username))
                    if parsed.password is not None and self.password is None:
                        object.__setattr__(self, "password", unquote(parsed.password))
        for name in ("connect_timeout_s", "command_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_options(cls, options: ConfigOptions | None = None, *, address: str | None = None,
                     cluster: bool | None = None) -> ConnectionSettings:
        """Settings from ``options`` (default: the environment), with ``address`` / ``cluster`` overriding.

        :raises RedisConnectionError: if no address is given or configured
        """
        options = options or ConfigOptions.create_from_environment("")
        source = "" if address else "SSDB"
        address = address or options.string_or("SSDB", "")
        if not address:
            raise RedisConnectionError("Could not connect to database. $SSDB not set")
        if cluster is None:
            cluster = options.string_or("SR_DB_TYPE", "Standalone").lower() in ("clustered", "cluster")
        return cls(
            address, cluster,
            username=options.string_or("SR_USERNAME", "") or None,
            password=options.string_or("SR_PASSWORD", "") or None,
            tls=options.string_or("SR_TLS", "").lower() in ("1", "true", "yes", "on"),
            tls_ca_cert=options.string_or("SR_TLS_CA_CERT", "") or None,
            tls_cert=options.string_or("SR_TLS_CERT", "") or None,
            tls_key=options.string_or("SR_TLS_KEY", "") or None,
            connect_timeout_s=options.integer_or("SR_CONN_TIMEOUT", DEFAULT_CONN_TIMEOUT_S),
            connect_interval_s=options.integer_or("SR_CONN_INTERVAL", DEFAULT_CONN_INTERVAL_MS) / 1000,
            command_timeout_s=options.integer_or("SR_CMD_TIMEOUT", DEFAULT_CMD_TIMEOUT_S),
            address_source=source,
        )

    @property
    def target(self) -> str:
        """The address as messages name it, with where it came from: ``host:port (SSDB)``."""
        return f"{self.address} ({self.address_source})" if self.address_source else self.address

    def with_(self, **changes: Any) -> ConnectionSettings:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def redis_kwargs(self, socket_timeout_s: float | None = None) -> dict[str, Any]:
        """redis-py connection arguments: credentials, TLS, timeouts, no retries (deadlines are ours)."""
        timeout = self.command_timeout_s if socket_timeout_s is None else socket_timeout_s
        kwargs: dict[str, Any] = {
            "socket_connect_timeout": timeout, "socket_timeout": timeout, "socket_keepalive": True,
            "retry": Retry(NoBackoff(), 0), "username": self.username, "password": self.password,
            "encoding_errors": self.encoding_errors,
        }
        if self.tls:
            verify = bool(self.tls_ca_cert or self.tls_ca_data)
            kwargs.update(ssl=True, ssl_ca_certs=self.tls_ca_cert, ssl_ca_data=self.tls_ca_data,
                          ssl_certfile=self.tls_cert, ssl_keyfile=self.tls_key,
                          ssl_cert_reqs="required" if verify else "none", ssl_check_hostname=False)
        return kwargs


def plain_client(endpoint: tuple[str, int] | str, settings: ConnectionSettings, timeout_s: float) -> redis.Redis:
    """A redis-py client of one node (no cluster routing), every wait bounded by ``timeout_s``."""
    kwargs = settings.redis_kwargs(timeout_s)
    if isinstance(endpoint, str):
        kwargs.pop("ssl", None)
        for key in [k for k in kwargs if k.startswith("ssl_")]:
            kwargs.pop(key)
        return redis.Redis(unix_socket_path=endpoint, **kwargs)
    return redis.Redis(host=endpoint[0], port=endpoint[1], **kwargs)


class Database:
    """redis-py client (standalone or cluster) plus the raw tensor paths on its connections.

    Every socket wait is bounded by the settings' ``command_timeout_s``; a caller that spans
    several round trips makes them one operation with :meth:`operation`, whose deadline
    :meth:`check_deadline` enforces between them.
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self.address = settings.address
        self.cluster = settings.cluster
        self._local = threading.local()
        self._connections = _redispy.ConnectionCache()  # kept for the hot paths (no pool round trip)
        endpoints = parse_address(settings.address)
        self.redis = wait_for_server(settings, lambda deadline: self._connect(endpoints, settings, deadline))

    @staticmethod
    def _connect(endpoints: list, settings: ConnectionSettings, deadline: float) -> redis.Redis | RedisCluster:
        probe = plain_client(endpoints[0], settings, probe_timeout_s(settings, deadline))
        try:
            probe.ping()
        finally:
            probe.close()
        if settings.cluster:
            nodes = [ClusterNode(*e) for e in endpoints if isinstance(e, tuple)]
            return RedisCluster(startup_nodes=nodes, **settings.redis_kwargs())
        return plain_client(endpoints[0], settings, settings.command_timeout_s)

    @contextmanager
    def operation(self, timeout_s: float | None = None) -> Iterator[None]:
        """Make the calls inside one operation with one deadline (nested operations share the outer one)."""
        local = self._local
        if getattr(local, "deadline", None) is not None:
            yield
            return
        local.deadline = time.monotonic() + (self.settings.command_timeout_s if timeout_s is None else timeout_s)
        local.timeout_s = self.settings.command_timeout_s if timeout_s is None else timeout_s
        try:
            yield
        finally:
            local.deadline = None

    def time_left(self) -> float:
        """Seconds left to the current operation (``command_timeout_s`` outside one)."""
        deadline = getattr(self._local, "deadline", None)
        if deadline is None:
            return self.settings.command_timeout_s
        return max(deadline - time.monotonic(), 0.0)

    def check_deadline(self) -> None:
        """Raise ``redis.exceptions.TimeoutError`` once the current operation's deadline has passed."""
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise redis.exceptions.TimeoutError(
                f"the operation did not finish within {self._local.timeout_s:g} s (SR_CMD_TIMEOUT)"
            )

    def close(self) -> None:
        """Close every connection of the pool(s)."""
        self._connections.close()
        self.redis.close()

    def exchange(self, commands: Sequence[Command], raise_on_error: bool = True,
                 block_s: float | None = None, before_block: Callable[[list[Any]], None] | None = None) -> list[Any]:
        """Run ``commands`` in one round trip, as ``pipeline(transaction=False).execute(raise_on_error)``.

        ``block_s``: the commands may block (BLPOP) this long; their replies are awaited that much
        longer than other replies. ``before_block``: called with the replies of every command but
        the last (the one that blocks) as soon as they are read, before the last one's is awaited.

        The replies are the server's, without redis-py's response callbacks (``SET`` gives b"OK",
        ``BLPOP`` a list). On one node the commands are packed and read on a pooled connection; a
        command redirected by the cluster (MOVED / ASK) is run again through redis-py, alone (the
        others have run), and commands spanning cluster nodes go through redis-py's pipeline: those
        replies are redis-py's (``SET`` gives True).
        """
        self.check_deadline()
        commands = _redispy.encode_commands(commands, self.settings.encoding_errors)
        pool = _redispy.shared_pool(self.redis, [command[1] for command in commands])
        if pool is None:
            if before_block is None:
                return self._pipeline(commands, raise_on_error)
            replies = self._pipeline(commands[:-1], raise_on_error) if len(commands) > 1 else []
            before_block(replies)
            return [*replies, *self._pipeline(commands[-1:], raise_on_error)]
        wait = None if block_s is None else block_s + self.settings.command_timeout_s
        conn = self._connections.take(pool)
        try:
            _redispy.send_commands(conn, commands)
            if before_block is None:
                replies = self._redirected(commands, [_redispy.read_reply(conn, wait) for _ in commands])
            else:
                head = commands[:-1]
                replies = self._redirected(head, [_redispy.read_reply(conn, wait) for _ in head])
                before_block(replies)
                replies += self._redirected(commands[-1:], [_redispy.read_reply(conn, wait)])
        except BaseException:
            self._connections.discard(pool, conn)  # a reply may be half read
            raise
        self._connections.give(pool, conn)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, redis.exceptions.ResponseError):
                    raise reply
        return replies

    def transaction(self, key: str, watch: Sequence[str],
                    prepare: Callable[[Callable[[Sequence[Command]], list[Any]]], Sequence[Command]]) -> list[Any]:
        """An optimistic transaction on the node that serves ``key``, as redis-py's ``Redis.transaction``
        (every key it touches shares ``key``'s slot).

        WATCH ``watch``, then ``prepare(read)``: ``read(commands)`` runs commands at once on the
        watching connection and gives their replies (an error reply as its exception); ``prepare``
        returns the commands to run in MULTI/EXEC. When a watched key changed (or expired) before
        EXEC, nothing ran, and it starts again from WATCH. Returns EXEC's replies (the server's, no
        response callbacks); an error reply among them is raised. An exception from ``prepare`` ends
        the transaction with nothing run.
        """
        while True:
            self.check_deadline()
            pool = _redispy.node_pool(self.redis, key)
            conn = self._connections.take(pool)
            try:
                replies = self._watched(conn, watch, prepare)
            except _redispy.Redirected as exc:
                log.debug("transaction on %r redirected (%s): starting again where the slot lives", key, exc)
                self._connections.discard(pool, conn)  # closing the connection ends its WATCH
                self.redis.exists(key)  # redis-py follows the redirection and learns the new slot map
                continue
            except BaseException:
                self._connections.discard(pool, conn)
                raise
            self._connections.give(pool, conn)
            if replies is not None:
                return replies

    def _watched(self, conn: Any, watch: Sequence[str],
                 prepare: Callable[[Callable[[Sequence[Command]], list[Any]]], Sequence[Command]]) -> list[Any] | None:
        """One attempt of :meth:`transaction` on ``conn``: EXEC's replies, or None when a watched key changed."""
        def run(commands: Sequence[Command]) -> list[Any]:
            self.check_deadline()
            _redispy.send_commands(conn, commands)  # encoded as the connection's client says
            replies = [_redispy.read_reply(conn) for _ in commands]
            redirected = next((reply for reply in replies if _redispy.is_redirect(reply)), None)
            if redirected is not None:
                raise _redispy.Redirected(str(redirected))
            return replies

        (watched,) = run([("WATCH", *watch)])
        if isinstance(watched, Exception):
            raise watched
        writes = prepare(run)
        *queued, done = run([("MULTI",), *writes, ("EXEC",)])
        for reply in (*queued, done, *(done or ())):
            if isinstance(reply, Exception):
                raise reply
        return done

    def _redirected(self, commands: Sequence[Command], replies: list[Any]) -> list[Any]:
        """``replies``, those the cluster redirected replaced by the replies of their commands run again."""
        redirected = [i for i, reply in enumerate(replies) if _redispy.is_redirect(reply)]
        if redirected:
            for i, reply in zip(redirected, self._pipeline([commands[i] for i in redirected], False), strict=True):
                replies[i] = reply
        return replies

    def _pipeline(self, commands: Sequence[Command], raise_on_error: bool) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=raise_on_error)

    def set_parts(self, key: str, parts: Sequence[bytes | memoryview], peek: int, px_ms: int | None = None) -> bytes:
        """``SET key <parts joined> [PX px_ms]`` without joining them; returns the first ``peek`` bytes it replaced."""
        self.check_deadline()
        total = sum(memoryview(p).nbytes for p in parts)
        head, tail = _redispy.pack_getrange_and_set(key, total, peek, px_ms, self.settings.encoding_errors)
        pool = _redispy.node_pool(self.redis, key)
        conn = self._connections.take(pool)
        try:
            # one system call out (sendmsg: the parts are not joined), one in for both replies
            _redispy.send_buffers(conn, [head, *parts, tail])
            old, status = _redispy.read_replies(conn, 2, peek + 64)
        except BaseException:
            self._connections.discard(pool, conn)  # a reply may be half read
            raise
        self._connections.give(pool, conn)
        if _redispy.is_redirect(old) or _redispy.is_redirect(status):
            data = b"".join(bytes(p) for p in parts)  # rare path (cluster redirection): one join copy
            expiry = () if px_ms is None else ("PX", int(px_ms))
            old, status = self._pipeline([("GETRANGE", key, 0, peek - 1), ("SET", key, data, *expiry)], False)
        if isinstance(status, Exception):
            raise status
        return old if isinstance(old, bytes) else b""

    def get_into(self, key: str, plan: ReadPlan, peek: int) -> bool:
        """``GET key`` read straight into the buffer ``plan`` picks; False when the key does not exist."""
        self.check_deadline()
        pool = _redispy.node_pool(self.redis, key)
        conn = self._connections.take(pool)
        try:
            _redispy.send_buffers(conn, [_redispy.pack_get(key, self.settings.encoding_errors)])
            found = _redispy.read_bulk_into(conn, plan, peek)
        except (_redispy.Redirected, redis.exceptions.ResponseError) as exc:
            self._connections.give(pool, conn)  # the error reply was read whole
            if not isinstance(exc, _redispy.Redirected):
                raise
        except BaseException:
            self._connections.discard(pool, conn)  # a reply may be half read
            raise
        else:
            self._connections.give(pool, conn)
            return found
        value = self.redis.get(key)
        if value is None:
            return False
        view = memoryview(value)
        skip, dest = plan(view[:peek], len(value))
        dest[:] = view[skip:]  # rare path (cluster redirection): redis-py's copy plus this one
        return True


def probe_timeout_s(settings: ConnectionSettings, deadline: float) -> float:
    """How long one connection attempt may wait for an answer: a stopped server accepts TCP
    connections (the kernel does) but never answers, so an attempt ends by the deadline, and soon
    enough (an interval, at least a second) that the wait is announced early and tried again."""
    remaining = max(deadline - time.monotonic(), 0.05)
    return min(remaining, settings.command_timeout_s, max(settings.connect_interval_s, 1.0))


def wait_for_server(settings: ConnectionSettings, attempt: Callable[[float], T]) -> T:
    """``attempt(deadline)`` until it succeeds, every ``SR_CONN_INTERVAL`` until ``SR_CONN_TIMEOUT``.

    The first failure is logged with what is awaited and until when (a missing server is not waited
    for in silence); a last attempt is made at the deadline, and the error follows it.

    :raises RedisConnectionError: the server did not answer within ``SR_CONN_TIMEOUT`` (the message
        names the address, where it came from, and the timeout), or refused the credentials
    """
    start = time.monotonic()
    deadline = start + settings.connect_timeout_s
    waiting = False
    while True:
        try:
            result = attempt(deadline)
        except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as exc:
            raise _refusal(settings, exc) from None
        except (redis.exceptions.RedisError, OSError) as exc:
            now = time.monotonic()
            if now >= deadline:
                raise RedisConnectionError(
                    f"Could not connect to the database at {settings.target} within "
                    f"{settings.connect_timeout_s:g} s (SR_CONN_TIMEOUT): {plain_text(str(exc))}"
                ) from None
            if not waiting:
                waiting = True
                warn(log, "No answer from the database at %s yet (%s); trying again every %g s until %g s have "
                     "passed (SR_CONN_TIMEOUT)", settings.target, plain_text(str(exc)), settings.connect_interval_s,
                     settings.connect_timeout_s)
            time.sleep(max(min(settings.connect_interval_s, deadline - now), 0.0))
            continue
        if waiting:
            log.info("connected to the database at %s after %.1f s", settings.target, time.monotonic() - start)
        return result


def _refusal(settings: ConnectionSettings, exc: redis.exceptions.RedisError) -> RedisConnectionError:
    """The error for a server that answered but refused the connection (credentials, ACL)."""
    if not isinstance(exc, redis.exceptions.AuthenticationError) and "NOAUTH" not in str(exc):
        return RedisConnectionError(f"The database at {settings.target} refused the connection: {exc}")
    if settings.password is None:
        return RedisConnectionError(
            f"The database at {settings.target} requires a password: set SR_PASSWORD (and SR_USERNAME "
            "for an ACL user), or use a redis://user:password@host:port address")
    user = settings.username or "default"
    return RedisConnectionError(f"Could not authenticate as user {user!r} at {settings.target}: {exc}")


def detect_cluster(settings: ConnectionSettings | str, timeout_s: float = 10.0) -> bool:
    """Whether the first node of the database runs in cluster mode (``CLUSTER INFO`` answers); a
    server not yet answering is waited for as a connection is (``SR_CONN_TIMEOUT``).

    :raises RedisConnectionError: as for :func:`wait_for_server`
    """
    if isinstance(settings, str):
        settings = ConnectionSettings(settings)
    endpoint = parse_address(settings.address)[0]

    def ask(deadline: float) -> bool:
        client = plain_client(endpoint, settings, min(probe_timeout_s(settings, deadline), timeout_s))
        try:
            client.execute_command("CLUSTER", "INFO")
            return True
        except redis.exceptions.ResponseError as exc:
            if "cluster support disabled" in str(exc):
                return False
            raise
        finally:
            client.close()

    return wait_for_server(settings, ask)
