"""The execution worker: takes runs from the smartredis_io Redis module, runs them, answers.

A worker keeps one connection to every server of the database (every shard of a cluster), blocks
on ``SRIO.POP`` on all of them at once, and runs what it gets: the model or script named by the
request (cached, reloaded when its manifest shows a new version) on the input tensors the request
carries or the worker reads. Small outputs go back in ``SRIO.REPLY``, which stores them and answers
the caller in one step; large ones, and in a cluster those that live on another shard, are written
first. Requests for a model set with ``batch_size > 0`` are gathered with ``SRIO.TAKE`` as RedisAI
batches them. docs/smartredis.md describes the protocol.

Safety, per request:

- **Deadline.** A watchdog thread ends the process (exit status
  ``smartredis_io.worker.worker_protocol.EXIT_DEADLINE``) when a run outlives its request's deadline:
  TorchScript and ATen release the GIL while they compute, so the watchdog runs even inside a
  ``while True`` loop of a stored script, and per request it costs two attribute writes. The module has already answered the caller; the supervisor that started the
  worker starts a new one.
- **Signals.** SIGTERM / SIGINT while idle stop the worker at once; while busy the request is
  finished first and a second signal stops it anyway, even inside a long C++ call (the signal is
  read from ``signal.set_wakeup_fd`` by a thread): the module then runs the request elsewhere.
- **Isolation.** Memory a run leaves uninitialized (``torch.empty``, ``resize_``) is filled
  (torch's deterministic mode), so no output carries bytes of an earlier request; the random
  generators are reseeded from ``os.urandom`` before every run.

Only TorchScript that passes :mod:`smartredis_io._client.torchscript_policy` runs (and ``torch.export``
programs that pass :mod:`smartredis_io._client.export_policy`).
"""

from __future__ import annotations

import io
import logging
import os
import select
import signal
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch

from smartredis_io._client import _redispy, export_policy, protocol, torchscript_policy, wire
from smartredis_io._client.connection import (
    Command,
    ConnectionSettings,
    Database,
    parse_address,
    plain_client,
)
from smartredis_io._client.protocol import Manifest, Request
from smartredis_io.error import RedisConnectionError, RedisKeyError, RedisReplyError
from smartredis_io.worker import _torch_export, _torchscript, devices
from smartredis_io.worker.worker_protocol import EXIT_DEADLINE, EXIT_STOPPED, SECRET_ENV

log = logging.getLogger("smartredis_io.worker")

_CPU = torch.device("cpu")

POP_BLOCK_MS = 1000  # how long one SRIO.POP waits (a stopping worker is not held longer)
HEARTBEAT_INTERVAL_S = 1.0  # the module declares a worker silent for 3 s dead
UNREGISTER_TIMEOUT_S = 2.0  # deadline of each step of a stopping worker's unregistration
PIPELINED_OUTPUT_MAX_BYTES = 1 << 20  # outputs up to this size go in SRIO.REPLY (one round trip)
DEADLINE_GRACE_S = 0.1  # the module answers the caller at the deadline; the watchdog acts this much later
WATCHDOG_INTERVAL_S = 0.05
LOAD_BUDGET_S = 300.0  # loading a model or script is bounded by this or the request's deadline, the later
_NONDETERMINISTIC_WARNING = ".*does not have a deterministic implementation.*"


def _take_readonly_warning() -> None:
    """Take, silenced, the one warning torch gives per process about tensors on read-only arrays.

    Inputs are views of the (immutable) values read from Redis and inference does not write them;
    taking the warning once here spares ``_to_torch`` a ``catch_warnings`` per tensor.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


def isolate_runs() -> None:
    """Make memory a run does not write read back as NaN / the type's largest value, not as bytes
    an earlier run left there (``torch.empty`` on a freed tensor of another user).

    torch fills uninitialized memory only in its deterministic mode; ``warn_only`` keeps the ops
    without a deterministic implementation running (their warning is silenced). Outputs of ordinary
    ops are unaffected: only explicitly uninitialized tensors are filled.
    """
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    warnings.filterwarnings("ignore", message=_NONDETERMINISTIC_WARNING)


def reseed(device: torch.device) -> None:
    """Reseed the generators a run on ``device`` can draw from, unpredictably (one user's
    ``torch.manual_seed`` does not make the next user's ``torch.rand`` predictable)."""
    torch.default_generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(int.from_bytes(os.urandom(8), "little"))


def _to_torch(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing ``array``'s memory (read-only inputs are not written by inference)."""
    if wire.is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(wire.bfloat16)
    return tensor.numpy()


def _as_list(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in result):
        return list(result)
    raise TypeError(f"the model returned {type(result).__name__}, not a tensor or a tuple of tensors")


def _error_text(exc: BaseException) -> str:
    """A reply error: redis error replies start with a code word."""
    text = str(exc)
    if isinstance(exc, (RunError, RedisReplyError)) and text[:4] in ("ERR ", "WRON", "NOPE", "TIME"):
        return text
    if isinstance(exc, (RunError, RedisReplyError)):
        return f"ERR {text}"
    return f"ERR {type(exc).__name__}: {text}"


class RunError(Exception):
    """An error that goes back to the caller as the reply's message."""


class ModuleMissingError(RedisConnectionError):
    """The database does not serve the worker commands: the module is not loaded."""


def _hello(secret: str | None, conn: Any) -> None:
    """Set up a new connection, then prove it is a worker's (``SRIO.HELLO``): the module serves the
    worker commands only on such connections. Without a secret (a module that asks for none) it
    says nothing."""
    conn.on_connect()
    if secret is None:
        return
    conn.send_command("SRIO.HELLO", secret)
    try:
        conn.read_response()
    except redis.exceptions.ResponseError as exc:
        conn.disconnect()
        if "unknown command" in str(exc).lower():
            raise ModuleMissingError(f"The database does not serve execution workers: {protocol.MODULE_HINT}") from None
        raise redis.exceptions.NoPermissionError(
            f"the Redis module refused this worker ({exc}): its secret ({SECRET_ENV}, or the worker command's "
            "--secret-file) must be the module's (WORKER_SECRET_FILE)") from None


def _worker_client(endpoint: tuple[str, int] | str, settings: ConnectionSettings, timeout_s: float) -> redis.Redis:
    """A client of one server whose every connection, and every reconnection, first says
    ``SRIO.HELLO`` with the worker secret (``$SRIO_WORKER_SECRET``)."""
    client = plain_client(endpoint, settings, timeout_s)
    secret = os.environ.get(SECRET_ENV)
    client.connection_pool.connection_kwargs["redis_connect_func"] = lambda conn: _hello(secret, conn)
    return client


class _Stopped(BaseException):
    """Raised by the signal handler to leave a wait (a BaseException: no model error handler takes it)."""


class _Watchdog:
    """Ends the process when the run it is armed for outlives its deadline (see the module docstring).

    Arming is an attribute write: the thread polls every ``WATCHDOG_INTERVAL_S``.
    """

    def __init__(self) -> None:
        self._armed: tuple[float, str] | None = None
        threading.Thread(target=self._run, name="deadline-watchdog", daemon=True).start()

    def arm(self, deadline: float, what: str) -> None:
        self._armed = (deadline, what)

    def disarm(self) -> None:
        self._armed = None

    def _run(self) -> None:
        while True:
            time.sleep(WATCHDOG_INTERVAL_S)
            armed = self._armed
            if armed is None or time.monotonic() < armed[0] + DEADLINE_GRACE_S or self._armed is not armed:
                continue
            log.error("%s ran past its deadline: stopping this worker (its supervisor starts a new one)", armed[1])
            logging.shutdown()
            os._exit(EXIT_DEADLINE)


class _Node:
    """One server of the database, as the worker talks to it: a connection for its pops and answers,
    and (in a cluster) one for pausing a waiting pop while the worker runs another shard's request."""

    def __init__(self, endpoint: tuple[str, int] | str, settings: ConnectionSettings) -> None:
        self.endpoint = endpoint
        self.name = endpoint if isinstance(endpoint, str) else f"{endpoint[0]}:{endpoint[1]}"
        self._settings = settings
        self._client = _worker_client(endpoint, settings, settings.command_timeout_s)
        self.conn = self._client.connection_pool.get_connection()
        self._side: Any = None
        self.pending = False  # an SRIO.POP was sent and its reply is not read yet
        self.paused = False  # an SRIO.PAUSE was sent on the side connection and its reply is not read yet

    def send(self, *command: Any) -> None:
        _redispy.send_commands(self.conn, [command])

    def read(self, timeout: float | None = None) -> Any:
        """The next reply on the main connection (an error reply is returned, not raised)."""
        return _redispy.read_reply(self.conn, timeout)

    def call(self, *command: Any, timeout: float | None = None) -> Any:
        self.send(*command)
        reply = self.read(timeout)
        if isinstance(reply, redis.exceptions.ResponseError):
            raise reply
        return reply

    def ready(self) -> bool:
        """Whether a reply can be read at once (buffered, or on the socket)."""
        return self.conn.can_read(timeout=0)

    def fileno(self) -> int:
        return _redispy.socket_of(self.conn).fileno()

    def pause(self, worker: str) -> None:
        if self._side is None:
            self._side = self._client.connection_pool.get_connection()
        _redispy.send_commands(self._side, [("SRIO.PAUSE", worker)])
        self.paused = True

    def end_pause(self) -> None:
        if self.paused:
            _redispy.read_reply(self._side)
            self.paused = False

    def close(self) -> None:
        for conn in (self.conn, self._side):
            if conn is not None:
                conn.disconnect()
        self._client.close()


def _endpoints(db: Database, own_server: bool = False) -> list[tuple[str, int] | str]:
    """The servers the worker takes requests from: every primary of a cluster, or with ``own_server``
    only the one at the database's (first) address, named as the cluster names it."""
    if not db.cluster:
        return parse_address(db.settings.address)[:1]
    if not own_server:
        return [(node.host, node.port) for node in db.redis.get_primaries()]
    first = parse_address(db.settings.address)[0]
    with plain_client(first, db.settings, db.settings.command_timeout_s) as client:
        nodes = client.execute_command("CLUSTER NODES")
    (myself,) = [address for address, node in nodes.items() if "myself" in node["flags"].split(",")]
    host, _, port = myself.rpartition(":")
    return [(host, int(port))]


class _Heartbeat:
    """A thread that keeps this worker registered on every server, on connections of its own.

    It runs while models run (torch releases the GIL), so a long request does not look like a dead
    worker; when the process dies, the module notices its closed connection at once, or its silence
    after 3 s (a stopped or unreachable worker).
    """

    def __init__(self, settings: ConnectionSettings, endpoints: Sequence[Any], name: str) -> None:
        self._clients = [_worker_client(e, settings, settings.command_timeout_s) for e in endpoints]
        # Connected now, with the rights the process starts with: a worker that drops to another user
        # may not open the server's Unix socket afterwards.
        for client in self._clients:
            client.ping()
        self._name = name
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)

    def beat(self) -> None:
        for client in self._clients:
            client.execute_command("SRIO.HEARTBEAT", self._name, os.getpid())

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.beat()
            except redis.exceptions.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        """Stop beating; a beat stuck on an unresponsive server is left behind (a daemon thread)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(UNREGISTER_TIMEOUT_S)
        if not self._thread.is_alive():
            for client in self._clients:
                client.close()


def _output_heads(keys: Sequence[str]) -> list[Command]:
    """Commands reading the first bytes of every output key (to see what an output would replace)."""
    return [("GETRANGE", key, 0, wire.HEADER_MAX_BYTES - 1) for key in keys]


def _check_outputs(keys: Sequence[str], heads: Sequence[Any]) -> None:
    """Refuse outputs that would overwrite a model or a script (``heads``: what the keys hold now).

    The worker writes with its own rights; without this, a client allowed to run models but not
    to write models could have a worker replace one for it. Outputs the module stores are checked
    by ``SRIO.REPLY`` itself.
    """
    for key, head in zip(keys, heads, strict=True):
        if isinstance(head, bytes) and head.startswith(protocol.MANIFEST_PREFIX):
            raise RunError(f"ERR output key {key!r} holds a model or script; a run does not replace it")


@dataclass
class _Job:
    request: Request
    inputs: list[torch.Tensor]


class Worker:
    """One execution worker on one database (standalone or cluster)."""

    def __init__(self, settings: ConnectionSettings, device: str = "cpu", name: str = "", *,
                 own_server: bool = False) -> None:
        """``own_server``: in a cluster, take requests only from the server at ``settings.address``
        (a Redis module's own workers serve their shard); inputs and outputs may live on any shard."""
        _take_readonly_warning()
        isolate_runs()
        settings = settings.with_(encoding_errors="surrogateescape")  # keys come back as they were received
        self.db = Database(settings)
        self.db.redis.ping()  # the pooled connection is made now, with the rights the process starts with
        self.device = torch.device(device)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._cache: dict[str, tuple[str, Any]] = {}  # key -> (version, loaded model or script)
        self._devices: dict[str, torch.device] = {}  # key -> device its model or script runs on
        self._manifests: dict[str, tuple[bytes, Manifest]] = {}  # key -> (raw manifest, parsed)
        self._takes_lists: dict[tuple[str, str, str], bool] = {}  # (key, version, fn) -> AI.SCRIPTEXECUTE's signature
        endpoints = _endpoints(self.db, own_server)
        self._nodes = [_Node(e, settings) for e in endpoints]
        self._by_endpoint = {node.endpoint: node for node in self._nodes}
        self._heartbeat = _Heartbeat(settings, endpoints, self.name)
        if self.db.exchange([("COMMAND", "INFO", "SRIO.POP")])[0] in ([None], None):
            raise ModuleMissingError(
                f"The database at {self.db.address} does not serve execution workers: {protocol.MODULE_HINT}"
            )
        self._watchdog = _Watchdog()
        self._stop = False
        self._idle = False
        self._signals = 0
        self._registered = False

    # ---- life cycle -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop before the next request (a stop signal that came while the worker was starting)."""
        self._stop = True

    def register(self) -> None:
        """Register on every server now, and keep the registration alive from now on (heartbeats).

        :meth:`serve` registers a worker that has not. Registered means ready to take requests
        (``INFO srio`` counts it, launchers wait for it): the module counts ``QUEUE_TIMEOUT`` only
        from a registered worker's first request for work, so a worker that registers before a
        slow step of its own does not get queued requests refused meanwhile.
        """
        if not self._registered:
            self._heartbeat.beat()
            self._heartbeat.start()
            self._registered = True

    def serve(self) -> None:
        """Take requests until SIGTERM / SIGINT.

        A signal while the worker waits for a request stops it at once; one while it runs a request
        lets that request finish, and a second one stops it anyway, also inside a long C++ call (the
        request is then run again by another worker, as if this one had died).
        """
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._watch_signals()
        self.register()
        log.info("worker %s serving on %s (device %s)", self.name, self.db.address, self.device)
        try:
            with torch.inference_mode():  # once for every request: entering it per call costs more than a tiny model
                self._take_requests()
        except _Stopped:
            log.info("worker %s stopping", self.name)
        finally:
            self._idle = True
            self._heartbeat.stop()
            self._unregister()

    def _watch_signals(self) -> None:
        """Count SIGTERM / SIGINT on a thread, from the wakeup fd the C signal handler writes: the
        Python handler runs only between bytecodes of the main thread, not inside a long C++ call."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

        def watch() -> None:
            while True:
                for number in os.read(read_end, 64):
                    if number not in (signal.SIGTERM, signal.SIGINT):
                        continue
                    self._signals += 1
                    self._stop = True
                    if self._idle:
                        continue  # the Python handler stops the wait
                    if self._signals == 1:
                        log.warning("worker %s: stop signal during a run: finishing it (a second signal stops "
                                    "the worker now)", self.name)
                        continue
                    log.warning("worker %s: second stop signal during a run: stopping now", self.name)
                    logging.shutdown()
                    os._exit(EXIT_STOPPED)

        threading.Thread(target=watch, name="signals", daemon=True).start()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop = True
        if self._idle:
            raise _Stopped()  # waiting for a request (or for a stopped database): nothing to finish

    def _take_requests(self) -> None:
        while not self._stop:
            try:
                popped = self._pop()
            except (redis.exceptions.ConnectionError, OSError):
                if self._stop:
                    break  # the database went first (launcher stopping everything)
                raise
            for node, reply in popped:
                self._handle_reply(node, reply)
            for node in self._nodes:
                node.end_pause()

    def _pop(self) -> list[tuple[_Node, Any]]:
        """Wait on every server for a request (``SRIO.POP``); the requests that came.

        Once one server hands over a request, the pops still waiting on the others are paused
        (answered with nil), so that a busy worker holds no other shard's request.
        """
        for node in self._nodes:
            if not node.pending:
                node.send("SRIO.POP", self.name, POP_BLOCK_MS)
                node.pending = True
        wait_s = POP_BLOCK_MS / 1000 + self.db.settings.command_timeout_s
        self._idle = True
        try:
            if self._stop:
                raise _Stopped()
            if len(self._nodes) == 1:
                ready = self._nodes
            else:
                ready = [node for node in self._nodes if node.ready()]
                if not ready:
                    readable, _, _ = select.select(self._nodes, [], [], wait_s)
                    if not readable:
                        raise redis.exceptions.TimeoutError(f"no server answered SRIO.POP within {wait_s:g} s")
                    ready = readable
            replies = [(node, node.read(wait_s)) for node in ready]
        finally:
            self._idle = False
        for node, _ in replies:
            node.pending = False
        popped = [(node, reply) for node, reply in replies if reply is not None]
        if popped:
            for node in self._nodes:
                if node.pending:
                    node.pause(self.name)
        for node, reply in replies:
            if isinstance(reply, redis.exceptions.ResponseError):
                if "unknown command" in str(reply).lower():
                    raise ModuleMissingError(f"{node.name} does not serve execution workers: {protocol.MODULE_HINT}")
                raise reply
        return popped

    def _unregister(self) -> None:
        """Leave every server; requests handed to this worker go back to their queues. Bounded by UNREGISTER_TIMEOUT_S."""
        quick = self.db.settings.with_(command_timeout_s=UNREGISTER_TIMEOUT_S)
        for node in self._nodes:
            try:
                node.close()  # a pop still waiting there is released, what it held requeued
                client = _worker_client(node.endpoint, quick, UNREGISTER_TIMEOUT_S)
                try:
                    client.execute_command("SRIO.UNREGISTER", self.name)
                finally:
                    client.close()
            except (redis.exceptions.RedisError, OSError, RedisConnectionError):
                # The database went first (launcher stopping everything), or does not answer: the
                # module notices the closed connections, or the silence of this worker.
                log.warning("worker %s could not unregister from %s", self.name, node.name)
        self.db.close()

    # ---- one request ----------------------------------------------------------------------------

    def _handle_reply(self, node: _Node, reply: Any) -> None:
        try:
            request = Request.from_reply(reply, node, time.monotonic())
        except (ValueError, TypeError) as exc:
            log.error("skipped a malformed request from %s: %s", node.name, exc)
            return
        self.handle(request)

    def handle(self, request: Request) -> None:
        """Run one request and answer it (errors of the model go back as the answer)."""
        if request.deadline <= time.monotonic():
            self._answer(request, "TIMEDOUT its deadline passed before a worker took it")  # the module drops it
            return
        try:
            manifest, runnable = self._load(request)
            self._watchdog.arm(request.deadline, request.what)
            reseed(self._devices.get(request.key, _CPU))
            if request.kind == "model" and manifest.batch_size > 1:
                self._run_batched(self._gather(request, manifest), runnable, manifest)
            else:
                self._finish(request, *self._call(runnable, request, self._inputs(request)))
        except (RunError, RedisReplyError) as exc:
            self._answer(request, _error_text(exc))
        except redis.exceptions.ConnectionError:
            raise
        except Exception as exc:  # noqa: BLE001 - any model failure goes back to the caller
            log.exception("request %s on %s failed", request.id, request.key)
            self._answer(request, _error_text(exc))
        finally:
            self._watchdog.disarm()

    def _answer(self, request: Request, error: str | None = None, outputs: Sequence[tuple[str, bytes]] = (),
                stats: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Answer ``request`` (``SRIO.REPLY``): ``error``, or success with ``outputs`` (key, value) stored by
        the module; then remove the chunks of chunked values the outputs replaced."""
        command: list[Any] = ["SRIO.REPLY", self.name, request.id, *stats]
        if error is not None:
            command += ["ERROR", error]
        else:
            command.append("OK")
            for key, value in outputs:
                command += [key, value]
        node: _Node = request.node
        node.send(*command)
        reply = node.read()
        if isinstance(reply, redis.exceptions.ResponseError):
            log.info("request %s on %s was refused: %s", request.id, request.key, reply)
            return
        if reply is None:
            log.info("request %s on %s no longer waited for its answer (timed out, or its caller left)",
                     request.id, request.key)
            return
        if isinstance(reply, list):
            for (key, _), old in zip(outputs, reply, strict=False):
                if old:
                    wire.delete_replaced_chunks(self.db, key, old)

    def _load(self, request: Request) -> tuple[Manifest, Any]:
        """The manifest and loaded model or script of ``request`` (cached while its version is current)."""
        key, kind = request.key, "model" if request.kind == "model" else "script"
        raw_manifest: Any = request.manifest
        for attempt in range(wire.READ_RETRIES):
            if attempt or raw_manifest is None:
                raw_manifest = self.db.redis.get(key)
            cached_manifest = self._manifests.get(key)
            if cached_manifest is not None and cached_manifest[0] == raw_manifest:
                manifest: Manifest | None = cached_manifest[1]  # unchanged: skip parsing it again
            else:
                manifest = protocol.parse(raw_manifest) if isinstance(raw_manifest, bytes) else None
                if manifest is not None:
                    self._manifests[key] = (raw_manifest, manifest)
            if manifest is None:
                raise RunError(f"ERR {kind} key {key!r} is empty")
            if manifest.kind != kind:
                raise RunError(f"WRONGTYPE key {key!r} holds a {manifest.kind}, not a {kind}")
            cached = self._cache.get(key)
            if cached and cached[0] == manifest.version:
                return manifest, cached[1]
            self._watchdog.arm(max(request.deadline, time.monotonic() + LOAD_BUDGET_S), f"loading {request.what}")
            try:
                blob = protocol.load_blob(self.db, key, manifest)
            except RedisKeyError:
                continue  # replaced while loading: read the new manifest
            with torch.inference_mode(False):  # loading builds modules, as outside a worker
                runnable = self._compile(blob, kind, key, manifest.device)
            self._cache[key] = (manifest.version, runnable)
            log.info("loaded %s %s version %s", kind, key, manifest.version)
            return manifest, runnable
        raise RunError(f"ERR {kind} {key!r} kept changing while being loaded")

    def _compile(self, blob: bytes, kind: str, key: str, device_name: str = "CPU") -> Any:
        """The runnable form of a stored model or script, after the checks of ``torchscript_policy``
        (and of ``export_policy`` for a torch.export program), on the device it was set for."""
        what = f"{kind} {key!r}"
        device, warning = devices.model_device(device_name, self.device)
        if warning:
            log.warning("%s: %s", what, warning)
        self._devices[key] = device
        if kind == "model" and export_policy.is_export_archive(blob):
            return _torch_export.load(blob, device, what)
        if kind == "script":
            source = blob.decode()
            torchscript_policy.check_source(source, what)
            runnable = _torchscript.compile_script(source)
        else:
            torchscript_policy.check_archive(blob, what)  # before loading: loading runs __setstate__
            runnable = torch.jit.load(io.BytesIO(blob), map_location=device)
            runnable.eval()
        torchscript_policy.check_ops(_torchscript.op_kinds(runnable), what)
        return runnable

    def _inputs(self, request: Request) -> list[torch.Tensor]:
        """The request's input tensors: the values it carries, the others read in one round trip."""
        raw: list[Any] = list(request.values)
        missing = [i for i, value in enumerate(raw) if value is None]
        if missing:
            replies = self.db.exchange([("GET", request.inputs[i]) for i in missing], raise_on_error=False)
            for i, value in zip(missing, replies, strict=True):
                raw[i] = value
        try:
            tensors = []
            for key, value in zip(request.inputs, raw, strict=True):
                if isinstance(value, Exception):
                    raise RunError(f"ERR reading tensor {key!r}: {value}")
                if value is None:
                    raise RedisKeyError(f"The tensor {key!r} does not exist")
                tensors.append(_to_torch(wire.decode_value(self.db, key, value)))
            return tensors
        except RedisKeyError as exc:
            raise RunError(f"ERR tensor key is empty: {exc}") from None

    def _function(self, runnable: Any, request: Request) -> Any:
        if request.kind == "model":
            return runnable
        if not hasattr(runnable, request.fn):
            raise RunError(f"ERR function {request.fn!r} does not exist in script {request.key!r}")
        return getattr(runnable, request.fn)

    def _arguments(self, function: Any, request: Request, inputs: list[torch.Tensor]) -> list[Any]:
        """How the function is called: the tensors in order; for AI.SCRIPTEXECUTE a function declared
        ``(tensors: List[Tensor], keys: List[str], args: List[str])`` gets the three lists, and
        AI.SCRIPTRUN's ``$`` passes the inputs from there on as one list."""
        if request.kind == "script-lists":
            version = self._cache[request.key][0]
            signature = (request.key, version, request.fn)
            takes_lists = self._takes_lists.get(signature)
            if takes_lists is None:
                takes_lists = self._takes_lists[signature] = _torchscript.takes_lists(function)
            if takes_lists:
                return [inputs, request.keys, request.args]
        if request.variadic >= 0:
            return [*inputs[:request.variadic], inputs[request.variadic:]]
        return inputs

    def _call(self, runnable: Any, request: Request, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple]:
        """The outputs of one run, and its statistics (microseconds, samples, calls)."""
        device = self._devices.get(request.key, _CPU)
        if device.type != "cpu":
            inputs = [tensor.to(device, non_blocking=True) for tensor in inputs]
        function = self._function(runnable, request)
        arguments = self._arguments(function, request, inputs)
        start = time.perf_counter()
        if torch.is_inference_mode_enabled():  # serve() runs every request in inference mode
            outputs = _as_list(function(*arguments))
        else:
            with torch.inference_mode():
                outputs = _as_list(function(*arguments))
        duration = round((time.perf_counter() - start) * 1e6)
        samples = inputs[0].shape[0] if inputs and inputs[0].dim() else 1
        return outputs, (duration, samples, 1)

    def _finish(self, request: Request, outputs: Sequence[torch.Tensor], stats: tuple = (0, 0, 0)) -> None:
        """Store the outputs and answer: those the module can store go in the answer, the others
        (large, or in a cluster on another shard) are written first."""
        if len(outputs) != len(request.outputs):
            raise RunError(f"ERR {request.what} produced {len(outputs)} outputs but {len(request.outputs)} were named")
        for key in request.outputs:
            if protocol.is_internal_key(key):
                raise RunError(f"ERR output key {key!r} is reserved for stored values' parts")
        answered: list[tuple[str, bytes]] = []
        direct: list[tuple[str, np.ndarray, bytes | None]] = []
        for key, tensor in zip(request.outputs, outputs, strict=True):
            array = _to_numpy(tensor)
            value = wire.encode_inline(array) if array.nbytes <= PIPELINED_OUTPUT_MAX_BYTES else None
            if value is not None and self._local(key, request.node):
                answered.append((key, value))
            else:
                direct.append((key, array, value))
        if direct:
            keys = [key for key, _, _ in direct]
            _check_outputs(keys, self.db.exchange(_output_heads(keys), raise_on_error=False))
            small = [(key, value) for key, _, value in direct if value is not None]
            for key, array, value in direct:
                if value is None:
                    wire.put_array(self.db, key, array)  # large: zero-copy path
            if small:
                commands: list[Command] = [
                    command for key, value in small
                    for command in (("GETRANGE", key, 0, wire.HEADER_MAX_BYTES - 1), ("SET", key, value))
                ]
                for (key, _), old in zip(small, self.db.exchange(commands)[0::2], strict=True):
                    if old:
                        wire.delete_replaced_chunks(self.db, key, old)
        self._answer(request, outputs=answered, stats=stats)

    def _local(self, key: str, node: _Node) -> bool:
        """Whether ``key`` lives on ``node`` (always, on a single server)."""
        return not self.db.cluster or _redispy.endpoint_of(self.db.redis, key) == node.endpoint

    # ---- batching ------------------------------------------------------------------------------

    def _gather(self, first: Request, manifest: Manifest) -> list[Request]:
        """``first`` plus more requests for its model, from the same server (``SRIO.TAKE``): up to
        batch_size requests, waiting at most min_batch_timeout ms for min_batch_size of them."""
        node: _Node = first.node
        taken = node.call("SRIO.TAKE", self.name, first.key, manifest.batch_size - 1,
                          max(manifest.min_batch_size - 1, 0), manifest.min_batch_timeout,
                          timeout=manifest.min_batch_timeout / 1000 + self.db.settings.command_timeout_s + 1)
        batch = [first]
        now = time.monotonic()
        for raw in taken or []:
            try:
                batch.append(Request.from_reply(raw, node, now))
            except (ValueError, TypeError) as exc:
                log.error("skipped a malformed request from %s: %s", node.name, exc)
        self._watchdog.arm(max(r.deadline for r in batch), first.what)
        return batch

    def _run_batched(self, requests: list[Request], runnable: Any, manifest: Manifest) -> None:
        jobs: list[_Job] = []
        for request in requests:
            if request.deadline <= time.monotonic():
                self._answer(request, "TIMEDOUT its deadline passed before it ran")
                continue
            try:
                jobs.append(_Job(request, self._inputs(request)))
            except RunError as exc:
                self._answer(request, _error_text(exc))
        while jobs:
            batch, jobs = self._next_batch(jobs, manifest.batch_size)
            try:
                self._run_batch(batch, runnable)
            except Exception as exc:  # noqa: BLE001 - the batch's callers all get the error
                if isinstance(exc, redis.exceptions.ConnectionError):
                    raise
                log.exception("batch of %d on %s failed", len(batch), batch[0].request.key)
                for job in batch:
                    self._answer(job.request, _error_text(exc))

    @staticmethod
    def _signature(job: _Job) -> tuple:
        return tuple((t.dtype, tuple(t.shape[1:])) for t in job.inputs)

    def _next_batch(self, jobs: list[_Job], batch_size: int) -> tuple[list[_Job], list[_Job]]:
        """The first job plus the compatible ones that fit in ``batch_size`` rows; and the rest."""
        first = jobs[0]
        batch, rest, rows = [first], [], (first.inputs[0].shape[0] if first.inputs and first.inputs[0].dim() else 1)
        for job in jobs[1:]:
            n = job.inputs[0].shape[0] if job.inputs and job.inputs[0].dim() else 0
            if n and self._signature(job) == self._signature(first) and rows + n <= batch_size:
                batch.append(job)
                rows += n
            else:
                rest.append(job)
        return batch, rest

    def _run_batch(self, batch: list[_Job], runnable: Any) -> None:
        if len(batch) == 1:
            job = batch[0]
            self._finish(job.request, *self._call(runnable, job.request, job.inputs))
            return
        sizes = [job.inputs[0].shape[0] for job in batch]
        stacked = [torch.cat(parts) for parts in zip(*(job.inputs for job in batch), strict=True)]
        outputs, stats = self._call(runnable, batch[0].request, stacked)
        if any(out.dim() == 0 or out.shape[0] != sum(sizes) for out in outputs):
            raise RunError("ERR batched model outputs do not keep the batch dimension")
        split = [out.split(sizes) for out in outputs]
        log.debug("ran a batch of %d requests (%d rows) on %s", len(batch), sum(sizes), batch[0].request.key)
        for i, job in enumerate(batch):
            self._finish(job.request, [parts[i] for parts in split], stats if i == 0 else (0, 0, 0))


def warm_up() -> None:
    """Load and compile once, so that every module these need is imported while files are readable."""
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Identity()), buffer)
    torch.jit.load(io.BytesIO(buffer.getvalue()))
    _torchscript.op_kinds(_torchscript.compile_script("def f(x):\n    return x\n"))
    _torch_export.warm_up()
