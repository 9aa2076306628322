"""Execution workers: run the models and scripts that clients ask for with run_model / run_script.

``python -m smartredis_io.worker --address HOST:PORT [--device cpu|cuda:N] [--workers N] [--user NAME | --allow-root]``

Credentials, TLS and deadlines come from the environment as for a SmartRedis client (``SR_USERNAME``,
``SR_PASSWORD``, ``SR_TLS``..., ``SR_CMD_TIMEOUT``), or from a ``redis://user:password@`` address.

Each worker process blocks on the request list (BLMOVE into its in-flight list, no busy polling),
loads the model or script
named by the request (cached, reloaded when its manifest shows a new version), runs it on the input
tensors, writes the output tensors and pushes the reply the caller is blocked on. Requests for a
model set with ``batch_size > 0`` are batched as RedisAI does: up to ``batch_size`` rows, waiting at
most ``min_batch_timeout`` ms for ``min_batch_size``. A request whose deadline has passed is dropped
(its caller has already raised ``RedisTimeoutError``).

Only TorchScript that passes :mod:`smartredis_io.torchscript_policy` runs. A worker started as root
refuses to start unless it drops to ``--user`` once connected, or is told ``--allow-root``. Workers
keep a heartbeat (``models.HEARTBEAT_TTL_MS``); the request of a worker that dies runs once more
on another one.
"""

from __future__ import annotations

import argparse
import io
import logging
import multiprocessing
import os
import pwd
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch

from lightning_storage_plugins.services import die_with_parent
from smartredis_io import (
    _torch_export,
    _torchscript,
    devices,
    export_policy,
    models,
    torchscript_policy,
    wire,
)
from smartredis_io.connection import Command, ConnectionSettings, Database, detect_cluster
from smartredis_io.error import RedisConnectionError, RedisKeyError, RedisReplyError
from smartredis_io.models import Manifest, Request

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")

ERROR_BACKOFF_S = 0.1  # pause after a request that could not be handled (e.g. database unreachable)
POP_TIMEOUT_S = 1.0  # how often an idle worker wakes up (to look for dead workers)
REAP_INTERVAL_S = 2.0  # how often an idle worker looks for dead workers
UNREGISTER_TIMEOUT_S = 2.0  # deadline of each step of a stopping worker's unregistration
BATCH_POLL_INTERVAL_S = 0.001  # while a batch waits (at most min_batch_timeout) for min_batch_size
BATCH_SCAN_LIMIT = 1024  # queue entries looked at when gathering a batch
PIPELINED_OUTPUT_MAX_BYTES = 1 << 20  # outputs up to this size are sent with the reply (one round trip)
BATCH_LOCK_MARGIN_MS = 5_000  # a batching lock outlives min_batch_timeout by this (a dead holder's expires)


def _take_readonly_warning() -> None:
    """Take, silenced, the one warning torch gives per process about tensors on read-only arrays.

    Inputs are views of the (immutable) values read from Redis and inference does not write them;
    taking the warning once here spares ``_to_torch`` a ``catch_warnings`` per tensor.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


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


class RunError(Exception):
    """An error that goes back to the caller as the reply's message."""


class _Stopped(BaseException):
    """Raised by the signal handler to leave a wait (a BaseException: no model error handler takes it)."""


class _Heartbeat:
    """A thread that keeps this worker registered and its alive key from expiring, on its own connection.

    It runs while models run (torch releases the GIL), so a long request does not look like a dead
    worker; when the process dies, the key expires after ``models.HEARTBEAT_TTL_MS``.
    """

    def __init__(self, settings: ConnectionSettings, name: str) -> None:
        self._db = Database(settings)
        self._db.redis.ping()  # connected now, with the rights the process starts with
        self._name = name
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)

    def beat(self) -> None:
        self._db.exchange([
            ("SET", models.ALIVE_PREFIX + self._name, os.getpid(), "PX", models.HEARTBEAT_TTL_MS),
            ("HSET", models.WORKERS_KEY, self._name, os.getpid()),
        ])

    def start(self) -> None:
        self.beat()  # registered before the first request is taken
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(models.HEARTBEAT_INTERVAL_S):
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
            self._db.close()


def _output_heads(keys: Sequence[str]) -> list[Command]:
    """Commands reading the first bytes of every output key (to see what an output would replace)."""
    return [("GETRANGE", key, 0, len(models.MANIFEST_PREFIX) - 1) for key in keys]


def _check_outputs(keys: Sequence[str], heads: Sequence[Any] | None = None) -> None:
    """Refuse outputs that would overwrite a model, a script (``heads``: what the keys hold now), or
    a protocol or chunk key.

    The worker writes with its own rights; without this, a client allowed to run models but not
    to write models could have a worker replace one for it. Without ``heads``, what the keys hold
    is checked when they are written (``models.STORE_LUA``).
    """
    for key, head in zip(keys, heads or [None] * len(keys), strict=True):
        if models.is_internal_key(key):
            raise RunError(f"ERR output key {key!r} is reserved for stored values' parts and the run protocol")
        if isinstance(head, bytes) and head.startswith(models.MANIFEST_PREFIX):
            raise RunError(f"ERR output key {key!r} holds a model or script; a run does not replace it")


@dataclass
class _Job:
    request: Request
    inputs: list[torch.Tensor]


class Worker:
    """One execution worker on one database (standalone or cluster)."""

    def __init__(self, settings: ConnectionSettings, device: str = "cpu", name: str = "") -> None:
        _take_readonly_warning()
        self.db = Database(settings)
        self.db.redis.ping()  # the pooled connection is made now, with the rights the process starts with
        self.device = torch.device(device)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._ok_reply = models.ok_reply(self.name)
        self._cache: dict[str, tuple[str, Any]] = {}  # key -> (version, loaded model or script)
        self._devices: dict[str, torch.device] = {}  # key -> device its model or script runs on
        self._stats: dict[str, dict[str, int]] = {}  # key -> statistics not yet added to its stats hash
        self._manifests: dict[str, tuple[bytes, Manifest]] = {}  # key -> (raw manifest, parsed)
        self._take_batch = self.db.redis.register_script(models.TAKE_BATCH_LUA)
        self._handoff = self.db.redis.register_script(models.HANDOFF_LUA)
        self._release_batch = self.db.redis.register_script(models.RELEASE_BATCH_LUA)
        self._stop = False
        self._idle = False
        self._unregistering = False
        self._heartbeat = _Heartbeat(settings, self.name)
        self._inflight = models.inflight_key(self.name)

    # ---- life cycle -----------------------------------------------------------------------------

    def serve(self) -> None:
        """Take requests until SIGTERM / SIGINT.

        A signal while the worker waits for a request stops it at once; one while it runs a request
        lets that request finish, and a second one stops it anyway (the request is then run again
        by another worker, as if this one had died).
        """
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._heartbeat.start()
        log.info("worker %s serving on %s (device %s)", self.name, self.db.address, self.device)
        try:
            with torch.inference_mode():  # once for every request: entering it per call costs more than a tiny model
                self._take_requests()
        except _Stopped:
            log.info("worker %s stopping", self.name)
        finally:
            self._heartbeat.stop()
            self._unregister()

    def _take_requests(self) -> None:
        """Pop and run requests until asked to stop (the idle worker's part of reaping too)."""
        next_reap = 0.0
        while not self._stop:
            self._idle = True
            try:
                if self._stop:
                    break
                popped = self.db.exchange(
                    [("BLMOVE", models.QUEUE_KEY, self._inflight, "LEFT", "RIGHT", POP_TIMEOUT_S)],
                    block_s=POP_TIMEOUT_S,
                )[0]
            except redis.exceptions.ConnectionError:
                if self._stop:
                    break  # the database went first (launcher stopping everything)
                raise
            finally:
                self._idle = False
            if popped:
                try:
                    self.handle(popped)
                except (redis.exceptions.RedisError, ValueError, TypeError, KeyError):
                    # A malformed request, or the database went away mid-request: the caller
                    # times out at its deadline; this worker goes on with the next request.
                    log.exception("request could not be handled")
                    time.sleep(ERROR_BACKOFF_S)
                    self._forget_inflight()
            elif time.monotonic() >= next_reap:
                self._idle = True
                try:
                    self._reap()
                finally:
                    self._idle = False
                next_reap = time.monotonic() + REAP_INTERVAL_S

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop and not self._idle and not self._unregistering:
            self._unregistering = True
            raise _Stopped()  # a second signal while a request runs: stop now
        self._stop = True
        if self._idle:
            raise _Stopped()  # waiting for a request (or for a stopped database): nothing to finish

    def _reap(self) -> None:
        try:
            for name in models.reap_dead_workers(self.db):
                log.warning("worker %s stopped sending heartbeats: unregistered, its request requeued", name)
        except redis.exceptions.RedisError:
            log.exception("could not look for dead workers")

    def _unregister(self) -> None:
        """Leave the registry, handing a request in flight back to the queue; bounded by UNREGISTER_TIMEOUT_S."""
        self._unregistering = True
        quick = self.db.settings.with_(connect_timeout_s=UNREGISTER_TIMEOUT_S, connect_interval_s=0.1,
                                       command_timeout_s=UNREGISTER_TIMEOUT_S)
        try:
            self.db.close()
            db = Database(quick)
            try:
                db.redis.delete(models.ALIVE_PREFIX + self.name)
                models.reap_dead_workers(db)  # removes this worker; requeues what it was running
                db.redis.hdel(models.WORKERS_KEY, self.name)
            finally:
                db.close()
        except (redis.exceptions.RedisError, RedisConnectionError):
            # The database went first (launcher stopping everything), or does not answer: the
            # workers and callers still connected reap this worker once its heartbeat expires.
            log.warning("worker %s could not unregister", self.name)

    # ---- one request ----------------------------------------------------------------------------

    def handle(self, raw: bytes) -> None:
        """Run one queued request and reply to its caller (errors of the model go back as the reply)."""
        request = Request.decode(raw)
        if request.deadline < time.time():
            log.warning("dropping request %s for %s: its deadline passed", request.id, request.key)
            self._forget_inflight()
            return
        try:
            raw_manifest, raw_inputs = self._fetch(request)
            manifest, runnable = self._load(request.key, request.kind, raw_manifest)
            if request.kind == "model" and manifest.batch_size > 0:
                batch = self._gather(request, manifest)
                if not batch:  # handed over to the worker batching this model
                    self._forget_inflight()
                    return
                self._run_batched(batch, runnable, manifest)
            else:
                self._finish(request, self._call(runnable, request, self._inputs(request, raw_inputs)))
        except (RunError, RedisReplyError) as exc:
            self._reply(request, str(exc))
        except Exception as exc:  # noqa: BLE001 - any model failure goes back to the caller
            log.exception("request %s on %s failed", request.id, request.key)
            self._reply(request, f"{type(exc).__name__}: {exc}")

    def _fetch(self, request: Request, manifest: bool = True) -> tuple[Any, list[Any]]:
        """The raw manifest (if asked for) and inputs of ``request``: those it carries, the rest read
        in one round trip.

        A carried manifest is only used when it is the one this worker loaded its cached model
        from: the worker never loads a model from a manifest a client could have written into its
        request. In a cluster, what the outputs hold now is read in the same round trip and checked.
        """
        embedded = request.embedded or [None] * (1 + len(request.inputs))
        cached = self._manifests.get(request.key)
        raw_manifest = embedded[0] if cached is not None and embedded[0] == cached[0] else None
        raw_inputs: list[Any] = list(embedded[1:])
        missing = [i for i, value in enumerate(raw_inputs) if value is None]
        manifest = manifest and raw_manifest is None
        commands: list[Command] = [("GET", request.key)] if manifest else []
        commands += [("GET", request.inputs[i]) for i in missing]
        if self.db.cluster:
            commands += _output_heads(request.outputs)
        replies = self.db.exchange(commands, raise_on_error=False) if commands else []
        if manifest:
            raw_manifest, *replies = replies
        for i, value in zip(missing, replies, strict=False):
            raw_inputs[i] = value
        _check_outputs(request.outputs, replies[len(missing):] if self.db.cluster else None)
        return raw_manifest, raw_inputs

    def _forget_inflight(self) -> None:
        """Empty this worker's in-flight list (the request in it will not be run, or was answered)."""
        try:
            self.db.redis.delete(self._inflight)
        except redis.exceptions.RedisError as exc:
            log.warning("could not clear %s: %s", self._inflight, exc)

    def _reply(self, request: Request, error: str | None = None, outputs: Sequence[tuple[str, bytes]] = ()) -> None:
        """Answer the caller, storing ``outputs`` (key, value) in the same round trip.

        The outputs go through ``models.STORE_LUA``: what each one replaces is checked and written
        atomically with the reply (if one of them holds a model, the caller gets an error and
        nothing is stored).
        """
        body = self._ok_reply if error is None else models.error_reply(self.name, error)
        if error is not None and request.key in self._cache:
            self._pending_stats(request.key)["errors"] += 1
        keys = [key for key, _ in outputs]
        answer: list[Command] = [(
            "EVAL", models.STORE_LUA, len(outputs) + 1, *keys, request.reply_key, models.MANIFEST_PREFIX,
            wire.HEADER_MAX_BYTES, models.REPLY_TTL_MS, body, self.name, *(value for _, value in outputs),
        )] if outputs else [("RPUSH", request.reply_key, body), ("PEXPIRE", request.reply_key, models.REPLY_TTL_MS)]
        replies = self.db.exchange([
            *answer,
            ("DEL", self._inflight),
            *self._stats_commands(),  # after the reply: the caller does not wait for them
        ])
        if not outputs:
            return
        if replies[0] is None:  # an output holds a model: the caller got an error
            self._pending_stats(request.key)["errors"] += 1
            return
        for key, old in zip(keys, replies[0], strict=True):
            if old:
                wire.delete_replaced_chunks(self.db, key, old)

    def _finish(self, request: Request, outputs: Sequence[torch.Tensor]) -> None:
        """Store the outputs and reply; small outputs go in the reply's round trip."""
        if len(outputs) != len(request.outputs):
            raise RunError(
                f"ERR {request.key!r} produced {len(outputs)} outputs but {len(request.outputs)} were named"
            )
        inline: list[tuple[str, bytes]] = []
        large: list[tuple[str, np.ndarray]] = []
        for key, tensor in zip(request.outputs, outputs, strict=True):
            array = _to_numpy(tensor)
            value = wire.encode_inline(array) if array.nbytes <= PIPELINED_OUTPUT_MAX_BYTES else None
            if value is None:
                large.append((key, array))
            else:
                inline.append((key, value))
        if large and not self.db.cluster:  # every output, before any is written (in a cluster: before the run)
            _check_outputs(request.outputs, self.db.exchange(_output_heads(request.outputs), raise_on_error=False))
        for key, array in large:
            wire.put_array(self.db, key, array)  # large: zero-copy path, before the reply
        if not self.db.cluster:
            self._reply(request, outputs=inline)
            return
        # A cluster pipeline writes to every shard before reading any reply, so the reply could land
        # before an output on another shard: store the outputs first, then answer.
        stores: list[Command] = [
            command for key, value in inline
            for command in (("GETRANGE", key, 0, wire.HEADER_MAX_BYTES - 1), ("SET", key, value))
        ]
        replaced = self.db.exchange(stores)[0::2] if stores else []
        for (key, _), old in zip(inline, replaced, strict=True):
            if old:
                wire.delete_replaced_chunks(self.db, key, old)
        self._reply(request)

    def _load(self, key: str, kind: str, raw_manifest: bytes | None) -> tuple[Manifest, Any]:
        for attempt in range(wire.READ_RETRIES):
            if attempt == 0 and key in self._manifests and self._manifests[key][0] == raw_manifest:
                manifest = self._manifests[key][1]  # unchanged: skip parsing it again
            else:
                raw_manifest = raw_manifest if attempt == 0 else self.db.redis.get(key)
                manifest = None if isinstance(raw_manifest, Exception) else models.parse(raw_manifest)
                if manifest is not None:
                    self._manifests[key] = (raw_manifest, manifest)
            if manifest is None:
                raise RunError(f"ERR {kind} key {key!r} is empty")
            if manifest.kind != kind:
                raise RunError(f"ERR key {key!r} holds a {manifest.kind}, not a {kind}")
            cached = self._cache.get(key)
            if cached and cached[0] == manifest.version:
                return manifest, cached[1]
            try:
                blob = models.load_blob(self.db, key, manifest)
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

    def _inputs(self, request: Request, raw: Sequence[Any]) -> list[torch.Tensor]:
        """The request's input tensors, from their stored values (``raw``, as ``_fetch`` gives them)."""
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

    def _call(self, runnable: Any, request: Request, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        device = self._devices.get(request.key, _CPU)
        if device.type != "cpu":
            inputs = [tensor.to(device, non_blocking=True) for tensor in inputs]
        function = runnable
        if request.kind == "script":
            if not hasattr(runnable, request.fn):
                raise RunError(f"ERR function {request.fn!r} does not exist in script {request.key!r}")
            function = getattr(runnable, request.fn)
        start = time.perf_counter()
        if torch.is_inference_mode_enabled():  # serve() runs every request in inference mode
            outputs = _as_list(function(*inputs))
        else:
            with torch.inference_mode():
                outputs = _as_list(function(*inputs))
        pending = self._pending_stats(request.key)
        pending["duration"] += round((time.perf_counter() - start) * 1e6)
        pending["samples"] += inputs[0].shape[0] if inputs and inputs[0].dim() else 1
        pending["calls"] += 1
        return outputs

    def _pending_stats(self, key: str) -> dict[str, int]:
        """The statistics of ``key`` not yet written (they go with the next reply)."""
        pending = self._stats.get(key)
        if pending is None:
            pending = self._stats[key] = dict.fromkeys(models.STATS_FIELDS, 0)
        return pending

    def _stats_commands(self) -> list[Command]:
        """The commands that add the pending statistics to their stats hashes."""
        commands: list[Command] = [
            ("HINCRBY", models.stats_key(key), field, value)
            for key, pending in self._stats.items() for field, value in pending.items() if value
        ]
        self._stats.clear()
        return commands

    # ---- batching ------------------------------------------------------------------------------

    def _gather(self, first: Request, manifest: Manifest) -> list[Request]:
        """``first`` plus more requests for its model: up to batch_size, waiting for min_batch_size.

        One worker at a time gathers for a model (it holds the model's batching lock); the others
        hand their requests for that model over to it. Returns [] when ``first`` was handed over.
        """
        lock, handoff = models.batch_keys(first.key)
        lock_ms = manifest.min_batch_timeout + BATCH_LOCK_MARGIN_MS
        while not self.db.redis.set(lock, self.name, nx=True, px=lock_ms):
            if self._handoff(keys=[lock, handoff], args=[first.encode()]):
                return []
        taken = [first]
        deadline = time.monotonic() + manifest.min_batch_timeout / 1000
        while True:
            wanted = manifest.batch_size - len(taken)
            raw = self._take_batch(keys=[models.QUEUE_KEY],
                                   args=[models.queue_prefix(first.key), wanted, BATCH_SCAN_LIMIT])
            raw += self.db.redis.lpop(handoff, max(wanted - len(raw), 1)) or []
            taken += [Request.decode(r) for r in raw]
            if len(taken) >= max(manifest.min_batch_size, 1) or len(taken) >= manifest.batch_size:
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(BATCH_POLL_INTERVAL_S)
        return taken + [Request.decode(r) for r in self._release_batch(keys=[lock, handoff])]

    def _run_batched(self, requests: list[Request], runnable: Any, manifest: Manifest) -> None:
        jobs: list[_Job] = []
        for request in requests:
            if request.deadline < time.time():
                continue
            try:
                jobs.append(_Job(request, self._inputs(request, self._fetch(request, manifest=False)[1])))
            except RunError as exc:
                self._reply(request, str(exc))
        while jobs:
            batch, jobs = self._next_batch(jobs, manifest.batch_size)
            try:
                self._run_batch(batch, runnable)
            except Exception as exc:  # noqa: BLE001 - the batch's callers all get the error
                log.exception("batch of %d on %s failed", len(batch), batch[0].request.key)
                for job in batch:
                    self._reply(job.request, str(exc) if isinstance(exc, RunError) else f"{type(exc).__name__}: {exc}")

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
            self._finish(job.request, self._call(runnable, job.request, job.inputs))
            return
        sizes = [job.inputs[0].shape[0] for job in batch]
        stacked = [torch.cat(parts) for parts in zip(*(job.inputs for job in batch), strict=True)]
        outputs = self._call(runnable, batch[0].request, stacked)
        if any(out.dim() == 0 or out.shape[0] != sum(sizes) for out in outputs):
            raise RunError("ERR batched model outputs do not keep the batch dimension")
        split = [out.split(sizes) for out in outputs]
        log.debug("ran a batch of %d requests (%d rows) on %s", len(batch), sum(sizes), batch[0].request.key)
        for i, job in enumerate(batch):
            self._finish(job.request, [parts[i] for parts in split])


def _warm_up() -> None:
    """Load and compile once, so that every module these need is imported while files are readable."""
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Identity()), buffer)
    torch.jit.load(io.BytesIO(buffer.getvalue()))
    _torchscript.op_kinds(_torchscript.compile_script("def f(x):\n    return x\n"))
    _torch_export.warm_up()


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


def _serve(settings: ConnectionSettings, device: str, name: str, threads: int, user: str | None,
           child: bool = False) -> None:
    if child:
        die_with_parent()  # a child worker stops when the worker that started it dies
    logging.basicConfig(level=os.environ.get("SRIO_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    dropping = bool(user) and os.geteuid() == 0
    if dropping and settings.tls_ca_cert:
        # Connections made after the drop must not need files only root can read.
        with open(settings.tls_ca_cert) as ca:
            settings = settings.with_(tls_ca_data=ca.read(), tls_ca_cert=None)
    worker = Worker(settings, device, name)
    if dropping:
        _warm_up()
        drop_privileges(user)
    worker.serve()
    if child:
        _exit(0)


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
    count = torch.cuda.device_count() if gpus is None else gpus
    return f"cuda:{index % count}" if count else "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m smartredis_io.worker`` command line; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m smartredis_io.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=os.environ.get("SSDB"), help="host:port[,host:port...] (default $SSDB)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda:N, or cuda (worker i on GPU i modulo the GPU count): where models set for "
                             "device GPU run; a model set for GPU:N runs on GPU N, one set for CPU on the CPU")
    parser.add_argument("--workers", type=int, default=1, help="worker processes sharing the request queue")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--name", default="", help="worker name prefix (default host:pid)")
    parser.add_argument("--user", default=None,
                        help="run models as this user: started as root, the worker connects, then drops to it")
    parser.add_argument("--allow-root", action="store_true",
                        help="run models as root (refused without this flag or --user when started as root)")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("--address or $SSDB is required")
    if os.geteuid() == 0 and not args.user and not args.allow_root:
        parser.error("refusing to run stored models as root: pass --user NAME (e.g. --user nobody) to drop to "
                     "an unprivileged user, or --allow-root if the database's writers are trusted with root")
    if args.user and os.geteuid() != 0 and args.user != pwd.getpwuid(os.geteuid()).pw_name:
        parser.error(f"--user {args.user}: only a worker started as root can change its user")
    settings = ConnectionSettings.from_options(address=args.address, cluster=False)
    settings = settings.with_(cluster=detect_cluster(settings))
    base = args.name or f"{socket.gethostname()}:{os.getpid()}"
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=_serve, args=(settings, worker_device(args.device, i), f"{base}.{i}", args.threads,
                                             args.user, True), daemon=True)
        for i in range(1, args.workers)
    ]
    for child in children:
        child.start()
    _serve(settings, worker_device(args.device, 0), f"{base}.0", args.threads, args.user)
    for child in children:
        child.terminate()
        child.join()
    return 0


if __name__ == "__main__":
    _exit(main())
