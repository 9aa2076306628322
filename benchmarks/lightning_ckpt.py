"""Lightning checkpoint save/load benchmark: the Dataflux Lightning checkpoint benchmark, offline.

Trains Lightning's demo Transformer (``num_encoder_layers = num_decoder_layers = LAYERS``) for one step,
then, for every row, times STEPS ``trainer.save_checkpoint`` calls and STEPS ``load_checkpoint`` calls of
the row's plugin. All rows checkpoint the same Trainer. The rows run interleaved, one save of each per
round (then one load of each), in an order that rotates every round, so a slow spell of the machine is
shared among them. Results are medians with their min-max spread, and ratios of medians from this run:
to TorchCheckpointIO through gcsfs (the baseline), to the published Dataflux package (the peer), and
to the ceiling of the row's upload path, measured in the same rounds with raw HTTP and the same bytes,
and of every load to the pure parallel download of those bytes. Below the tables, each row also gets
the Dataflux Lightning benchmark's two lines, "Average time to save (load) one checkpoint: X seconds".

A Tiered row (``TieredCheckpointIO``: a local tier on the local rows' disk, uploaded to GCS in the
background) times each save until the checkpoint is durable in GCS, with the time training was
blocked beside it, and loads each checkpoint twice: from its local tier, and from GCS through a
second plugin whose local tier is empty (a new node). Its bars compare it with what the same rounds
measure, which it brings along: FastPersist's save to the same disk, the direct Dataflux save and
load, and the raw parallel upload and raw parallel read of the local tier's file.

``--aa`` also runs an identical copy of every row and ceiling in the same rounds (an A/A control, with
its own plugin instance and its own paths). How far each copy's medians land from its original's is
this run's noise floor: a ratio that differs from its bar by less than that is not decided by one run.

With no ``CKPT_DIR_PATH`` the GCS rows run against a local fake-gcs-server, behind the XML multipart
server (GCS's parallel-upload API) and, with ``--network cloud``, behind a toxiproxy model of a cloud
network; everything is torn down at the end. Configuration follows the Dataflux Lightning benchmark's
environment variables (``CKPT_DIR_PATH``, ``STEPS``, ``LAYERS``, ``PROJECT``, ``DATAFLUX_CKPT``,
``USE_TRANSFER_MANAGER``); flags win over them. Without ``DATAFLUX_CKPT`` the run compares the
Dataflux Lightning benchmark's three rows and a Tiered row; ``DATAFLUX_CKPT=1`` (or 0) runs its single
row. MB is 10^6 bytes.
"""

from __future__ import annotations

import argparse
import gc
import logging
import mmap
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataflux_ckpt.emulator import configure_gcsfs_for_emulator

configure_gcsfs_for_emulator()  # before anything imports gcsfs

import torch  # noqa: E402

from benchmarks.lightning_model import fitted_trainer, quiet_lightning, save  # noqa: E402
from benchmarks.lightning_peer import (  # noqa: E402
    PEER_INSTALL_HINT,
    PEER_PATH_ENV,
    PEER_VARIANTS,
    PeerProcess,
    PeerUnavailableError,
    default_peer_path,
)
from benchmarks.network import NetworkModel, parse_network  # noqa: E402
from benchmarks.plugins import (  # noqa: E402
    BASELINE_KEY,
    EMULATOR_BACKENDS,
    PLUGINS,
    UPLOAD_MODES,
    Plugin,
    ServiceOptions,
    Services,
    fsspec_size,
    is_gcs,
)
from benchmarks.raw_gcs import MemoryReader, RawGcs  # noqa: E402
from benchmarks.report import (  # noqa: E402
    MB,
    CpuMeter,
    PeakRSS,
    bar_chart,
    format_markdown_table,
    format_table,
    per_second,
    quiet_self_printing_loggers,
    ratio,
    row_progress,
    split_choices,
    spread,
    write_json,
)
from dataflux_ckpt.checksums import crc32c_extend  # noqa: E402

log = logging.getLogger("benchmarks.lightning_ckpt")

PEER_KEY = "peer"
DEFAULT_JSON = "results/lightning_ckpt.json"
TIERED_KEY = "tiered"
FASTPERSIST_KEY = "fastpersist"
DIRECT_KEY = "dataflux-tm"
DEFAULT_ROWS = ("torch-gcsfs", "dataflux-no-tm", "dataflux-tm", TIERED_KEY)
# What a Tiered row's bars compare it with: these rows run in its rounds whenever it does.
TIERED_COMPARED = (DIRECT_KEY, FASTPERSIST_KEY)
ASYNC_SUFFIX = "-async"
TIER_FILE = "tier-file"
LOCAL_READ = "local-read"
AA_SUFFIX = "~aa"
DURABLE_POLL_S = 0.01
DURABLE_TIMEOUT_S = 1800.0


# Rows: what a run can measure ----------------------------------------------------------------------
@dataclass(frozen=True)
class RowSpec:
    """A row a run can ask for: an in-process plugin of :data:`PLUGINS` (possibly wrapped in
    Lightning's ``AsyncCheckpointIO``), or a variant of the peer package run by its worker."""

    key: str
    name: str
    plugin: Plugin | None = None
    asynchronous: bool = False
    peer_variant: str | None = None

    @property
    def storage(self) -> str:
        return self.plugin.storage if self.plugin else "gcs"

    def unavailable_reason(self) -> str | None:
        return self.plugin.unavailable_reason() if self.plugin else None


def _row_specs() -> dict[str, RowSpec]:
    specs = [RowSpec(p.key, p.name, plugin=p) for p in PLUGINS.values()]
    tm = PLUGINS["dataflux-tm"]
    specs.insert(specs.index(RowSpec(tm.key, tm.name, plugin=tm)) + 1,
                 RowSpec(tm.key + ASYNC_SUFFIX, "Dataflux async (Transfer Manager Enabled)", plugin=tm,
                         asynchronous=True))
    specs += [RowSpec(v.key, v.name, peer_variant=v.key) for v in PEER_VARIANTS.values()]
    return {s.key: s for s in specs}


ROW_SPECS = _row_specs()
# --compare runs these; the peer without multipart is there on request (--types peer-no-mpu).
COMPARE_ROWS = tuple(k for k in ROW_SPECS if k != "peer-no-mpu")


@dataclass
class Op:
    """One timed operation: seconds, the resident memory it added, (async saves) how long the caller
    was blocked before the save went on in the background, and the CPU seconds each process used."""

    seconds: float
    extra_rss_mb: float
    blocked_s: float | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Subject:
    """Something timed in the rounds: a row (save and load) or a ceiling (save or load)."""

    key: str
    name: str
    kind: str  # "row" | "ceiling"
    meter: CpuMeter
    upload: str | None = None  # rows: "single" | "xml" | "composite" | None; ceilings: what they bound
    saves: list[Op] = field(default_factory=list)
    loads: list[Op] = field(default_factory=list)
    size_bytes: int | None = None
    does_save: bool = True
    does_load: bool = True
    control_of: str | None = None  # an A/A control: the key of the subject it copies

    def save(self, step: int) -> Op:
        raise NotImplementedError

    def load(self, step: int) -> Op:
        raise NotImplementedError

    def remove(self, step: int) -> None:
        """Delete what ``step`` stored (untimed, between rounds)."""

    def close(self) -> None:
        """Release connections and workers."""


def _timed(fn: Callable[[], Any], meter: CpuMeter) -> Op:
    """``fn`` timed once. What it returns (a load's result) is freed after the clock stops: a load
    ends when the caller has the checkpoint, and freeing it is the caller's later cost."""
    gc.collect()
    cpu = meter.snapshot()
    with PeakRSS() as rss:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
        cpu_s = meter.since(cpu)
        del result
    return Op(seconds, rss.peak_mb - rss.start_mb, cpu_s=cpu_s)


class PluginRow(Subject):
    """A plugin of :data:`PLUGINS` in this process, saving through the shared Trainer."""

    def __init__(self, spec: RowSpec, upload_mode: str | None, services: Services, trainer: Any,
                 run_id: str, keep: bool, meter: CpuMeter) -> None:
        plugin = spec.plugin
        assert plugin is not None
        suffix = f" [{upload_mode}]" if upload_mode and plugin.follows_upload_mode else ""
        upload = upload_mode if plugin.follows_upload_mode else plugin.upload
        super().__init__(spec.key + (f"[{upload_mode}]" if suffix else ""), spec.name + suffix, "row", meter, upload)
        self.spec, self.plugin, self.trainer, self.keep = spec, plugin, trainer, keep
        self.inner = plugin.make(services, upload_mode if plugin.follows_upload_mode else "auto")
        self.io = self.inner
        if spec.asynchronous:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            self.io = AsyncCheckpointIO(self.inner)
        self.directory = f"{services.directory(plugin.storage)}/{run_id}/{self.key.replace('[', '-').strip(']')}"
        if plugin.storage == "local":
            Path(self.directory).mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> str:
        return f"{self.directory}/ckpt_{step}.ckpt"

    def save(self, step: int) -> Op:
        blocked: list[float] = []

        def run() -> None:
            start = time.perf_counter()
            save(self.trainer, self.io, self.path(step))
            blocked.append(time.perf_counter() - start)
            if self.spec.asynchronous:
                self.io.teardown()  # waits until the checkpoint is stored

        op = _timed(run, self.meter)
        op.blocked_s = blocked[0] if self.spec.asynchronous else None
        if self.plugin.settle is not None:
            self.plugin.settle(self.inner)  # its background housekeeping must not slow the next row
        if self.size_bytes is None:
            self.size_bytes = self.plugin.size(self.path(step), self.inner)
        return op

    def load(self, step: int) -> Op:
        return _timed(lambda: self.io.load_checkpoint(self.path(step)), self.meter)

    def remove(self, step: int) -> None:
        if not self.keep:
            self.inner.remove_checkpoint(self.path(step))

    def close(self) -> None:
        self.io.teardown()
        if self.io is not self.inner:
            self.inner.teardown()


def wait_until_durable(checkpoint_io: Any, path: str, uploads_done: int, timeout_s: float = DURABLE_TIMEOUT_S) -> None:
    """Wait until a ``TieredCheckpointIO`` has no upload pending, and check that it made ``path``
    durable (its ``uploads_done`` grew past ``uploads_done``).

    Raises:
        TimeoutError: uploads are still pending after ``timeout_s``.
        RuntimeError: the upload ended without publishing ``path`` (the plugin logged why).
    """
    end = time.monotonic() + timeout_s
    # stats() is the plugin's public view of its uploads; polling it adds at most DURABLE_POLL_S.
    while (stats := checkpoint_io.stats()).uploads_pending:
        if time.monotonic() > end:
            raise TimeoutError(f"waited {timeout_s:g} s for the upload of {path} to GCS; "
                               f"{stats.uploads_pending} upload(s) still pending")
        time.sleep(DURABLE_POLL_S)
    if stats.uploads_done <= uploads_done or stats.last_durable != path:
        raise RuntimeError(f"the upload of {path} to GCS ended without publishing it (the plugin's warnings say why)")


class TieredRow(PluginRow):
    """``TieredCheckpointIO``, as training sees it and as GCS does.

    A save is timed until the checkpoint is durable in GCS (its upload published); how long the
    caller was blocked, training's stall, is kept as for async rows, with the CPU seconds this process
    used meanwhile (:attr:`stall_cpu_s`). Each round loads the checkpoint twice: from the local tier
    (the row's load), and from GCS (:attr:`gcs_loads`) through another ``TieredCheckpointIO`` whose
    local tier is empty, as a new node resumes.
    """

    def __init__(self, spec: RowSpec, upload_mode: str | None, services: Services, trainer: Any,
                 run_id: str, keep: bool, meter: CpuMeter) -> None:
        super().__init__(spec, upload_mode, services, trainer, run_id, keep, meter)
        self.new_node = self.plugin.make(services, upload_mode or "auto")
        self.gcs_loads: list[Op] = []
        self.stall_cpu_s: list[float] = []

    def save(self, step: int) -> Op:
        path, blocked = self.path(step), []

        def run() -> None:
            uploads_done = self.inner.stats().uploads_done
            cpu = time.process_time()
            start = time.perf_counter()
            save(self.trainer, self.io, path)
            blocked.append(time.perf_counter() - start)
            self.stall_cpu_s.append(time.process_time() - cpu)
            wait_until_durable(self.inner, path, uploads_done)

        op = _timed(run, self.meter)
        op.blocked_s = blocked[0]
        if self.size_bytes is None:
            self.size_bytes = self.plugin.size(path, self.inner)
        return op

    def load(self, step: int) -> Op:
        local = super().load(step)
        self.gcs_loads.append(_timed(lambda: self.new_node.load_checkpoint(self.path(step)), self.meter))
        return local

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.new_node.teardown()


class PeerRow(Subject):
    """A variant of the peer package, run by its worker process on the same endpoint and data."""

    def __init__(self, spec: RowSpec, worker: PeerProcess, directory: str, run_id: str, keep: bool,
                 meter: CpuMeter) -> None:
        variant = PEER_VARIANTS[spec.peer_variant]
        super().__init__(spec.key, spec.name, "row", meter, "xml" if variant.multipart else "single")
        self.variant, self.worker, self.keep = variant, worker, keep
        self.directory = f"{directory}/{run_id}/{spec.key}"

    def path(self, step: int) -> str:
        return f"{self.directory}/ckpt_{step}.ckpt"

    def _call(self, op: str, step: int) -> Op:
        gc.collect()
        cpu = self.meter.snapshot()
        reply = self.worker.call(op, self.variant.key, self.path(step))
        blocked = reply["blocked_s"] if op == "save" and self.variant.asynchronous else None
        return Op(reply["seconds"], reply["extra_rss_mb"], blocked, self.meter.since(cpu))

    def save(self, step: int) -> Op:
        op = self._call("save", step)
        if self.size_bytes is None:
            self.size_bytes = fsspec_size(self.path(step), None)
        return op

    def load(self, step: int) -> Op:
        return self._call("load", step)

    def remove(self, step: int) -> None:
        if not self.keep:
            self.worker.call("remove", self.variant.key, self.path(step))


# Ceilings --------------------------------------------------------------------------------------------
CEILING_NAMES = {
    "single": "raw single-request upload",
    "xml": "raw parallel XML multipart upload",
    "composite": "raw parallel composite upload",
    "download": "raw parallel download",
    "download_crc32c": "raw parallel download + crc32c",
    "load": "raw parallel download + torch.load",
    f"xml-{TIER_FILE}": "raw parallel XML multipart upload of the local tier's file",
    f"composite-{TIER_FILE}": "raw parallel composite upload of the local tier's file",
    LOCAL_READ: "raw parallel read of the local tier's file",
}


class UploadCeiling(Subject):
    """The bytes of the checkpoint uploaded with raw HTTP: one request, XML multipart or composite.
    ``of`` names other bytes than ``torch.save``'s (``TIER_FILE``: the local tier's file)."""

    def __init__(self, mode: str, raw: RawGcs, bucket: str, data: mmap.mmap, run_id: str, meter: CpuMeter,
                 of: str | None = None) -> None:
        bound = f"{mode}-{of}" if of else mode
        super().__init__(f"ceiling-{bound}", f"ceiling: {CEILING_NAMES[bound]}", "ceiling", meter, bound,
                         does_load=False)
        self.raw, self.bucket, self.data, self.mode = raw, bucket, data, mode
        self.size_bytes = len(data)
        self.prefix = f"{run_id}/ceiling-{bound}"

    def save(self, step: int) -> Op:
        name = f"{self.prefix}/ckpt_{step}"
        parts: list[str] = []
        if self.mode == "single":
            op = _timed(lambda: self.raw.single_upload(self.bucket, name, self.data), self.meter)
        elif self.mode == "xml":
            op = _timed(lambda: self.raw.xml_multipart_upload(self.bucket, name, self.data), self.meter)
        else:
            op = _timed(lambda: parts.extend(self.raw.composite_upload(self.bucket, name, self.data)), self.meter)
        # As the plugin's composite uploads, the part objects are deleted after the upload is complete.
        self.raw.delete(self.bucket, parts)
        return op

    def remove(self, step: int) -> None:
        self.raw.delete(self.bucket, f"{self.prefix}/ckpt_{step}")


class DownloadCeiling(Subject):
    """The bounds of a load: the object fetched with raw parallel ranged GETs (the plugin's part size
    and connection count) into memory. ``mode`` "download" stops there: the pure download, with no
    deserialization and no integrity check, the ceiling of every GCS load. "download_crc32c" also
    checks the bytes' crc32c as they arrive, as every load of the plugin must (its like-for-like
    ceiling). "load" then runs ``torch.load`` from memory with its defaults: the serial bound of a
    load that does not overlap the two."""

    def __init__(self, mode: str, raw: RawGcs, bucket: str, data: mmap.mmap, run_id: str, meter: CpuMeter) -> None:
        if mode not in ("download", "download_crc32c", "load"):
            raise ValueError(f"a load ceiling is 'download', 'download_crc32c' or 'load', not {mode!r}")
        super().__init__(f"ceiling-{mode}", f"ceiling: {CEILING_NAMES[mode]}", "ceiling", meter, mode,
                         does_save=False)
        self.raw, self.bucket, self.mode = raw, bucket, mode
        self.size_bytes = len(data)
        self.crc32c = crc32c_extend(0, data) if mode == "download_crc32c" else None
        self.name_ = f"{run_id}/ceiling-{mode}/ckpt"
        raw.single_upload(bucket, self.name_, data)

    def load(self, step: int) -> Op:
        def run() -> Any:
            buffer = self.raw.download(self.bucket, self.name_, self.size_bytes, crc32c=self.crc32c)
            if self.mode != "load":
                return buffer  # unmapped once the clock has stopped, as a load's result is freed
            try:
                with MemoryReader(buffer) as reader:
                    return torch.load(reader)
            finally:
                buffer.close()

        return _timed(run, self.meter)

    def close(self) -> None:
        self.raw.delete(self.bucket, self.name_)


def raw_local_read(path: str, threads: int, range_bytes: int, block_bytes: int) -> mmap.mmap:
    """The bytes of the file at ``path`` read into one new anonymous mapping, as the local tier's
    reader reads them (``threads`` threads taking ``range_bytes`` at a time, ``block_bytes`` a
    call), and nothing else: no checksum, no unpickling."""
    size = os.path.getsize(path)
    buffer = mmap.mmap(-1, max(size, 1))
    view = memoryview(buffer)
    starts, lock = iter(range(0, size, range_bytes)), threading.Lock()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def lane() -> None:
        while True:
            with lock:
                start = next(starts, None)
            if start is None:
                return
            offset, end = start, min(start + range_bytes, size)
            while offset < end:
                got = os.preadv(fd, [view[offset : min(offset + block_bytes, end)]], offset)
                if not got:
                    raise EOFError(f"{path} ended at byte {offset} of {size}")
                offset += got

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="raw-local-read") as pool:
            for lane_done in [pool.submit(lane) for _ in range(threads)]:
                lane_done.result()
    finally:
        os.close(fd)
        view.release()
    return buffer


class LocalReadCeiling(Subject):
    """The local tier's file read into new memory, and nothing else: the bound of a load that reads
    the file (the tier's load maps it instead, and can beat this). The file is a FastPersist save of
    the same checkpoint on the same disk; it is read once before the rounds, so that the page cache
    holds it as it holds the tier's own file, which the tier checksums right after each save."""

    def __init__(self, path: str, meter: CpuMeter) -> None:
        from dataflux_ckpt.download import READ_BLOCK_BYTES
        from dataflux_ckpt.tiered import LOCAL_RANGE_BYTES, LOCAL_READ_THREADS

        super().__init__(f"ceiling-{LOCAL_READ}", f"ceiling: {CEILING_NAMES[LOCAL_READ]}", "ceiling", meter,
                         LOCAL_READ, does_save=False)
        self.file = path
        self.size_bytes = os.path.getsize(path)
        self.read = lambda: raw_local_read(path, LOCAL_READ_THREADS, LOCAL_RANGE_BYTES, READ_BLOCK_BYTES)
        self.read().close()

    def load(self, step: int) -> Op:
        return _timed(self.read, self.meter)  # unmapped once the clock has stopped


def tier_file(trainer: Any, directory: str, stack: ExitStack) -> str:
    """A FastPersist save of the Trainer's checkpoint, the file a TieredCheckpointIO save leaves on
    its local tier (the Tiered rows' ceilings move its bytes)."""
    from fastpersist import FastPersistCheckpointIO

    path = Path(directory) / f"ceiling-{uuid.uuid4().hex[:8]}-tier.ckpt"
    checkpoint_io = FastPersistCheckpointIO()
    try:
        save(trainer, checkpoint_io, str(path))
    finally:
        checkpoint_io.teardown()
    stack.callback(path.unlink, missing_ok=True)
    return str(path)


def checkpoint_bytes(trainer: Any, directory: str, stack: ExitStack) -> mmap.mmap:
    """The bytes a TorchCheckpointIO save of the Trainer writes (the ceilings move the same bytes),
    mapped from a local file: the page cache, not this process, holds them between uses."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    path = Path(directory) / f"ceiling-{uuid.uuid4().hex[:8]}.ckpt"
    save(trainer, TorchCheckpointIO(), str(path))
    stack.callback(path.unlink, missing_ok=True)
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    stack.callback(data.close)
    return data


# Selection -------------------------------------------------------------------------------------------
def _env_flag(name: str, default: bool | None) -> bool | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def select_rows(args: argparse.Namespace) -> list[RowSpec]:
    """The rows to run: ``--types``; else ``--compare`` (all available); else ``DATAFLUX_CKPT``'s
    single row, as in the Dataflux Lightning benchmark; else its three GCS rows."""
    if args.types:
        keys = split_choices(args.types, list(ROW_SPECS), "--types")
        return with_compared_rows([ROW_SPECS[k] for k in keys])
    if args.compare:
        return [ROW_SPECS[k] for k in COMPARE_ROWS]
    local = bool(args.ckpt_dir) and not is_gcs(args.ckpt_dir)
    if args.dataflux is True:
        return [ROW_SPECS["dataflux-tm" if args.use_transfer_manager else "dataflux-no-tm"]]
    if args.dataflux is False or local:
        return [ROW_SPECS["torch-local" if local else "torch-gcsfs"]]
    return with_compared_rows([ROW_SPECS[k] for k in DEFAULT_ROWS])


def with_compared_rows(specs: list[RowSpec]) -> list[RowSpec]:
    """``specs`` and, with a Tiered row among them, the rows its bars compare it with (the direct
    Dataflux save and load, FastPersist's save to the same disk), after it, unless asked for already."""
    if not any(spec.key == TIERED_KEY for spec in specs):
        return specs
    return specs + [ROW_SPECS[key] for key in TIERED_COMPARED if key not in {spec.key for spec in specs}]


def upload_modes(args: argparse.Namespace) -> list[str]:
    return list(UPLOAD_MODES) if args.upload_mode == "both" else [args.upload_mode]


# Results ---------------------------------------------------------------------------------------------
def _rates(size_bytes: int, ops: list[Op]) -> dict[str, float | None]:
    if not ops:
        return {"median_mbps": None, "min_mbps": None, "max_mbps": None, "mean_mbps": None,
                "median_s": None, "mean_s": None}
    seconds = spread([op.seconds for op in ops])
    mean_s = statistics.fmean(op.seconds for op in ops)
    return {"median_mbps": per_second(size_bytes, seconds["median"]), "min_mbps": per_second(size_bytes, seconds["max"]),
            "max_mbps": per_second(size_bytes, seconds["min"]), "mean_mbps": per_second(size_bytes, mean_s),
            "median_s": seconds["median"], "mean_s": mean_s}


def subject_row(subject: Subject, context: dict[str, Any]) -> dict[str, Any]:
    """The JSON row of one subject: sizes, per-step times, medians, spread, extra memory, and the CPU
    seconds of each process taking part (this one, the emulator, the XML server, toxiproxy, the peer's
    worker; medians over the steps, ``*_cpu_total_s`` their sum).

    ``save_s``/``load_s`` and ``save_mbps``/``load_mbps`` are means (the Dataflux Lightning benchmark reports averages);
    the ``*_median_*`` values are what the ratios use.
    """
    size = subject.size_bytes or 0
    row: dict[str, Any] = {"type": subject.name, "key": subject.key, "kind": subject.kind,
                           "upload": subject.upload, "size_mb": size / MB, "control_of": subject.control_of,
                           **context}
    for prefix, ops in (("save", subject.saves), ("load", subject.loads)):
        rates = _rates(size, ops)
        row.update({
            f"{prefix}_median_mbps": rates["median_mbps"], f"{prefix}_min_mbps": rates["min_mbps"],
            f"{prefix}_max_mbps": rates["max_mbps"], f"{prefix}_median_s": rates["median_s"],
            f"{prefix}_s": rates["mean_s"], f"{prefix}_mbps": rates["mean_mbps"],
            f"{prefix}_times_s": [op.seconds for op in ops],
            f"{prefix}_extra_rss_mb": max(op.extra_rss_mb for op in ops) if ops else None,
        })
        row.update(_cpu_fields(prefix, ops))
    blocked = [op.blocked_s for op in subject.saves if op.blocked_s is not None]
    row["save_blocked_median_s"] = statistics.median(blocked) if blocked else None
    row["tiered"] = isinstance(subject, TieredRow)
    if isinstance(subject, TieredRow):
        row.update(tiered_fields(size, blocked, subject.gcs_loads, subject.stall_cpu_s))
    row["average_time_lines"] = average_time_lines(row)
    return row


def tiered_fields(size: int, stalls: list[float], gcs_loads: list[Op], stall_cpu_s: list[float] | None = None,
                  ) -> dict[str, Any]:
    """A Tiered row's own measurements: the training stall of each save (``stall_*``; its ``save_*``
    are the times until durable, ``durable_median_s``), with the CPU seconds this process used in it
    (``stall_cpu_median_s``), and each load from GCS (``gcs_load_*``)."""
    fields: dict[str, Any] = {"stall_times_s": stalls, "stall_median_s": None, "stall_min_s": None,
                              "stall_max_s": None, "gcs_load_times_s": [op.seconds for op in gcs_loads],
                              "stall_cpu_median_s": statistics.median(stall_cpu_s) if stall_cpu_s else None}
    if stalls:
        stall = spread(stalls)
        fields.update(stall_median_s=stall["median"], stall_min_s=stall["min"], stall_max_s=stall["max"])
    rates = _rates(size, gcs_loads)
    fields.update({f"gcs_load_{name}": rates[name] for name in ("median_mbps", "min_mbps", "max_mbps", "median_s")})
    fields.update(_cpu_fields("gcs_load", gcs_loads))
    return fields


def _cpu_fields(prefix: str, ops: list[Op]) -> dict[str, Any]:
    """The median CPU seconds of each process in ``ops`` (``<prefix>_cpu_s``) and of them all (``_total_s``)."""
    return {f"{prefix}_cpu_s": {name: statistics.median(op.cpu_s.get(name, 0.0) for op in ops)
                                for name in sorted({n for op in ops for n in op.cpu_s})},
            f"{prefix}_cpu_total_s": statistics.median(sum(op.cpu_s.values()) for op in ops) if ops else None}


def average_time_lines(row: dict[str, Any]) -> list[str]:
    """The Dataflux Lightning benchmark's two result lines for this row, worded and formatted as it
    prints them (the mean over the timed steps, in seconds), for what it measured."""
    return [f"Average time to {op} one checkpoint: {row[f'{op}_s']} seconds"
            for op in ("save", "load") if row[f"{op}_s"] is not None]


def format_average_times(rows: list[dict[str, Any]]) -> str:
    """A block per row of the Dataflux Lightning benchmark's "Average time to ..." lines, each
    line prefixed by the row's name, so they compare with that benchmark's output."""
    return "\n\n".join("\n".join(f"{r['type']}: {line}" for line in r["average_time_lines"]) for r in rows)


def add_ratios(rows: list[dict[str, Any]], ceiling_rows: list[dict[str, Any]]) -> None:
    """Ratios of medians: to the baseline (gcsfs), to the peer, and to the ceiling of each row's path.

    Ceilings get their ratios to the baseline and the peer too: the most any row on that path could
    show against them in this run. Every GCS load, and the "download + torch.load" bound, gets its
    ratio to the pure parallel download (``load_vs_download``) and to that download with its crc32c
    checked (``load_vs_verified_download``).
    """
    baseline = next((r for r in rows if r["key"] == BASELINE_KEY), None)
    peer = next((r for r in rows if r["key"] == PEER_KEY), None)
    ceilings = {r["upload"]: r for r in ceiling_rows if not r["control_of"]}
    load_ceiling = ceilings.get("load")
    download = ceilings.get("download")
    download_mbps = download["load_median_mbps"] if download else None
    verified = ceilings.get("download_crc32c")
    verified_mbps = verified["load_median_mbps"] if verified else None
    for row in rows + ceiling_rows:
        for op in ("save", "load"):
            value = row[f"{op}_median_mbps"]
            row[f"{op}_vs_baseline"] = ratio(value, baseline and baseline[f"{op}_median_mbps"])
            row[f"{op}_vs_peer"] = ratio(value, peer and peer[f"{op}_median_mbps"])
    for row in rows:
        row["save_rss_vs_peer"] = ratio(row["save_extra_rss_mb"], peer and peer["save_extra_rss_mb"])
        save_ceiling = ceilings.get(row["upload"]) if row["upload"] else None
        row["save_ceiling"] = save_ceiling and save_ceiling["type"]
        row["save_ceiling_mbps"] = save_ceiling and save_ceiling["save_median_mbps"]
        row["save_vs_ceiling"] = ratio(row["save_median_mbps"], row["save_ceiling_mbps"])
        gcs_row = row["upload"] is not None and not row.get("tiered")  # a Tiered row's load is local
        row["load_ceiling_mbps"] = load_ceiling["load_median_mbps"] if load_ceiling and gcs_row else None
        row["load_vs_ceiling"] = ratio(row["load_median_mbps"], row["load_ceiling_mbps"])
        row["load_vs_download"] = ratio(row["load_median_mbps"], download_mbps) if gcs_row else None
        row["load_vs_verified_download"] = ratio(row["load_median_mbps"], verified_mbps) if gcs_row else None
    for row in ceiling_rows:
        bounded = row["upload"] in ("load", "download_crc32c")
        row["load_vs_download"] = ratio(row["load_median_mbps"], download_mbps) if bounded else None
        row["load_vs_verified_download"] = None
    add_tiered_ratios(rows, ceilings)
    add_aa_ratios(rows + ceiling_rows)


# A Tiered row's bars: (ratio, comparison, limit).
TIERED_BARS = {
    "stall_vs_fastpersist": ("<=", 1.15),
    "direct_save_vs_stall": (">=", 5.0),
    "durable_vs_ceiling": ("<=", 1.15),
    "local_load_vs_raw_read": (">=", 0.9),
}


def add_tiered_ratios(rows: list[dict[str, Any]], ceilings: dict[str, dict[str, Any]]) -> None:
    """Each Tiered row against what its bars name, from medians of this run, as time ratios:

    - ``stall_vs_fastpersist``: its training stall / FastPersist's save of the same checkpoint to the
      same disk (``stall_cpu_vs_fastpersist``: the same for the CPU seconds this process used);
    - ``direct_save_vs_stall``: the direct Dataflux save (same upload mode) / its stall;
    - ``durable_vs_ceiling``: its time until durable / (FastPersist's save + the raw parallel upload of
      the local tier's file, ``durable_ceiling_s``), which is also its save ceiling;
    - ``local_load_vs_raw_read``: the raw read of the local tier's file / its load from the local tier
      (its load ceiling);
    - ``gcs_load_vs_dataflux``: the direct Dataflux load / its load from GCS (as a new node).

    ``bars`` holds each bar's value, limit and whether it holds (``None``: not measured).
    """
    by_key = {row["key"]: row for row in rows}
    fastpersist_s = by_key.get(FASTPERSIST_KEY, {}).get("save_median_s")
    fastpersist_cpu_s = by_key.get(FASTPERSIST_KEY, {}).get("save_cpu_s", {}).get("benchmark")
    read = ceilings.get(LOCAL_READ)
    for row in rows:
        if not row.get("tiered") or row["control_of"]:
            continue
        direct = by_key.get(f"{DIRECT_KEY}[{row['upload']}]", {})
        upload = ceilings.get(f"{row['upload']}-{TIER_FILE}")
        ceiling_s = fastpersist_s + upload["save_median_s"] if fastpersist_s and upload else None
        row["stall_vs_fastpersist"] = ratio(row["stall_median_s"], fastpersist_s)
        row["stall_cpu_vs_fastpersist"] = ratio(row.get("stall_cpu_median_s"), fastpersist_cpu_s)
        row["direct_save_vs_stall"] = ratio(direct.get("save_median_s"), row["stall_median_s"])
        row["durable_median_s"] = row["save_median_s"]
        row["durable_ceiling_s"] = ceiling_s
        row["durable_vs_ceiling"] = ratio(row["save_median_s"], ceiling_s)
        row["save_ceiling"] = upload and f"FastPersist save + {upload['type'].removeprefix('ceiling: ')}"
        row["save_ceiling_mbps"] = per_second(row["size_mb"] * MB, ceiling_s) if ceiling_s else None
        row["save_vs_ceiling"] = ratio(row["save_median_mbps"], row["save_ceiling_mbps"])
        row["local_load_vs_raw_read"] = ratio(read and read["load_median_s"], row["load_median_s"])
        row["load_ceiling_mbps"] = read and read["load_median_mbps"]
        row["load_vs_ceiling"] = row["local_load_vs_raw_read"]
        row["gcs_load_vs_dataflux"] = ratio(direct.get("load_median_s"), row["gcs_load_median_s"])
        row["bars"] = {name: {"value": row[name], "bar": f"{op} {limit:g}",
                              "holds": None if row[name] is None else
                              (row[name] <= limit if op == "<=" else row[name] >= limit)}
                       for name, (op, limit) in TIERED_BARS.items()}


# What an A/A control is compared with its original on: the field of medians, and its name.
AA_MEASURES = {"save_median_s": "save", "load_median_s": "load", "stall_median_s": "stall"}


def add_aa_ratios(rows: list[dict[str, Any]]) -> None:
    """Each A/A control against the subject it copies, as ratios of medians of the same rounds:
    ``aa_<measure>_ratio``, the copy's / the original's, for its save, load and (Tiered rows) stall.
    Identical subjects would give 1; how far from 1 they land is this run's noise."""
    by_key = {row["key"]: row for row in rows}
    for row in rows:
        original = by_key.get(row["control_of"]) if row["control_of"] else None
        if original is not None:
            for median, measure in AA_MEASURES.items():
                row[f"aa_{measure}_ratio"] = ratio(row.get(median), original.get(median))


def widest_aa_gap(rows: list[dict[str, Any]]) -> tuple[float, str, str] | None:
    """The largest distance between an A/A control and its original in this run, as a fraction
    (``max(r, 1 / r) - 1`` of their ratio ``r``), with the control's name and the measure; ``None``
    without controls."""
    gaps = [(max(value, 1 / value) - 1, row["type"], measure) for row in rows for measure in AA_MEASURES.values()
            if (value := row.get(f"aa_{measure}_ratio"))]
    return max(gaps, default=None)


def format_aa(rows: list[dict[str, Any]]) -> str:
    """One line per A/A control and measure (the copy's median / the original's), then the widest
    gap: the distance within which this run cannot tell a ratio from its bar."""
    lines = [f"{row['type']}: {measure} / the original's = {row[f'aa_{measure}_ratio']:.3f}"
             for row in rows for measure in AA_MEASURES.values() if row.get(f"aa_{measure}_ratio") is not None]
    widest = widest_aa_gap(rows)
    if widest is not None:
        gap, name, measure = widest
        lines.append(f"A/A noise of this run: up to {gap:.1%} between identical subjects ({name}, {measure}); "
                     "a ratio closer than that to its bar is not decided by this run")
    return "\n".join(lines)


def as_controls(originals: Sequence[Subject], copies: Sequence[Subject]) -> list[Subject]:
    """``copies``, a second build of ``originals`` (own plugin instances, own paths), named as their
    A/A controls."""
    if [copy.key for copy in copies] != [original.key for original in originals]:
        raise RuntimeError("the A/A controls were not built as the subjects they copy")
    for original, copy in zip(originals, copies, strict=True):
        copy.key, copy.name, copy.control_of = original.key + AA_SUFFIX, f"{original.name} (A/A control)", original.key
    return list(copies)


def _range(row: dict[str, Any], op: str) -> str | None:
    low, high = row.get(f"{op}_min_mbps"), row.get(f"{op}_max_mbps")
    return f"{low:.0f}-{high:.0f}" if low is not None and high is not None else None


TABLE_COLUMNS = {
    "type": "Checkpoint Type",
    "size_mb": "Size (MB)",
    "save_median_mbps": "Save MB/s",
    "save_range": "(min-max)",
    "load_median_mbps": "Load MB/s",
    "load_range": "(min-max)",
    "save_extra_rss_mb": "Save +RSS MB",
    "load_extra_rss_mb": "Load +RSS MB",
    "save_cpu_total_s": "Save CPU s",
    "load_cpu_total_s": "Load CPU s",
    "save_blocked_median_s": "Blocked (s)",
}
RATIO_COLUMNS = {
    "type": "Checkpoint Type",
    "save_vs_baseline": "Save x gcsfs",
    "load_vs_baseline": "Load x gcsfs",
    "save_vs_peer": "Save x peer",
    "load_vs_peer": "Load x peer",
    "save_rss_vs_peer": "+RSS x peer",
    "save_vs_ceiling": "Save x ceil.",
    "load_vs_ceiling": "Load x ceil.",
    "load_vs_download": "Load x download",
    "load_vs_verified_download": "Load x download+crc32c",
    "upload": "Save ceiling",
}
TIERED_COLUMNS = {
    "type": "Tiered row",
    "stall_median_s": "Stall s",
    "stall_range": "(min-max)",
    "stall_vs_fastpersist": "Stall / FastPersist save (bar <= 1.15)",
    "stall_cpu_vs_fastpersist": "CPU: stall / FastPersist save",
    "direct_save_vs_stall": "Dataflux save / stall (bar >= 5)",
    "durable_median_s": "Durable s",
    "durable_ceiling_s": "FastPersist save + raw upload s",
    "durable_vs_ceiling": "Durable / that (bar <= 1.15)",
    "load_median_s": "Local load s",
    "local_load_vs_raw_read": "Local load x raw read (bar >= 0.9)",
    "gcs_load_median_s": "GCS load s",
    "gcs_load_vs_dataflux": "GCS load x Dataflux load",
}
CEILING_COLUMNS = {
    "type": "Ceiling",
    "save_median_mbps": "Save MB/s",
    "save_range": "(min-max)",
    "load_median_mbps": "Load MB/s",
    "load_range": "(min-max)",
    "save_cpu_total_s": "Save CPU s",
    "load_cpu_total_s": "Load CPU s",
    "save_vs_baseline": "Save x gcsfs",
    "load_vs_baseline": "Load x gcsfs",
    "save_vs_peer": "Save x peer",
    "load_vs_peer": "Load x peer",
    "load_vs_download": "Load x download",
}


def format_report(rows: list[dict[str, Any]], ceiling_rows: list[dict[str, Any]],
                  table: Callable[[Sequence[dict[str, Any]], dict[str, str]], str] = format_table) -> str:
    """The results, ratios and ceilings tables (``table`` formats one: plain text or Markdown)."""

    def ranged(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "save_range": _range(r, "save"), "load_range": _range(r, "load")} for r in items]

    def shown(items: list[dict[str, Any]], columns: dict[str, str]) -> str:
        # A column with no value in any row (no peer in this run, no async row...) is left out, and a
        # table left with its name column alone (no baseline, peer or ceiling in this run) with it.
        kept = {key: title for key, title in columns.items() if any(r.get(key) is not None for r in items)}
        return table(items, kept) if len(kept) > 1 else ""

    parts = [shown(ranged(rows), TABLE_COLUMNS), shown(rows, RATIO_COLUMNS)]
    tiered = [{**r, "stall_range": f"{r['stall_min_s']:.3f}-{r['stall_max_s']:.3f}" if r["stall_times_s"] else None}
              for r in rows if r.get("tiered")]
    if tiered:
        parts.append(shown(tiered, TIERED_COLUMNS))
    if ceiling_rows:
        parts.append(shown(ranged(ceiling_rows), CEILING_COLUMNS))
    return "\n\n".join(filter(None, parts))


def format_bars(rows: list[dict[str, Any]]) -> str:
    """One line per bar of each Tiered row: its value, its limit, and whether it holds."""
    lines = []
    for row in rows:
        for name, bar in (row.get("bars") or {}).items():
            value = "not measured" if bar["value"] is None else f"{bar['value']:.3f}"
            verdict = "" if bar["holds"] is None else " (holds)" if bar["holds"] else " (does not hold)"
            lines.append(f"{row['type']}: {TIERED_COLUMNS[name].split(' (bar')[0]} = {value}, bar {bar['bar']}{verdict}")
    return "\n".join(lines)


def write_chart(path: str | os.PathLike[str], rows: list[dict[str, Any]], ceiling_rows: list[dict[str, Any]],
                title: str) -> Path:
    """Save and load median MB/s per row (min-max whiskers), the ceilings as lines; rows whose caller
    is blocked for less than the save (async, Tiered) also get that rate, and Tiered rows their load
    from GCS."""
    lines = [(r["type"].removeprefix("ceiling: "), r["save_median_mbps"], "save")
             for r in ceiling_rows if r["save_median_mbps"]]
    lines += [(r["type"].removeprefix("ceiling: "), r["load_median_mbps"], "load")
              for r in ceiling_rows if r["load_median_mbps"]]
    series = {"save": [r["save_median_mbps"] for r in rows], "load": [r["load_median_mbps"] for r in rows]}
    spreads = {op: [(r[f"{op}_min_mbps"], r[f"{op}_max_mbps"]) for r in rows] for op in ("save", "load")}
    if any(r["save_blocked_median_s"] for r in rows):
        series["save: caller blocked"] = [per_second(r["size_mb"] * MB, r["save_blocked_median_s"])
                                          if r["save_blocked_median_s"] else None for r in rows]
    if any(r.get("tiered") for r in rows):
        series["load from GCS (new node)"] = [r["gcs_load_median_mbps"] if r.get("tiered") else None for r in rows]
        spreads["load from GCS (new node)"] = [(r["gcs_load_min_mbps"], r["gcs_load_max_mbps"]) if r.get("tiered")
                                               else None for r in rows]
    return bar_chart(path, [r["type"] for r in rows], series, spreads=spreads, lines=lines, title=title,
                     xlabel="MB/s (median of the steps; whiskers: min-max)")


# The run ---------------------------------------------------------------------------------------------
def run_rounds(subjects: Sequence[Subject], steps: int, stop: threading.Event | None = None) -> None:
    """``steps`` rounds: one save of every subject, then one load of every subject, then clean-up;
    the order rotates by one each round. Once ``stop`` is set, the next operation raises
    ``KeyboardInterrupt`` instead of starting."""

    def check() -> None:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt("stopped between operations")

    bars = row_progress([s.name for s in subjects],
                        [steps * (int(s.does_save) + int(s.does_load)) for s in subjects])
    try:
        for step in range(steps):
            order = list(range(len(subjects)))
            order = order[step % len(order):] + order[: step % len(order)]
            for i in order:
                if subjects[i].does_save:
                    check()
                    subjects[i].saves.append(subjects[i].save(step))
                    bars[i].update()
            for i in order:
                if subjects[i].does_load:
                    check()
                    subjects[i].loads.append(subjects[i].load(step))
                    bars[i].update()
            for i in order:
                check()
                subjects[i].remove(step)
    finally:
        for bar in bars:
            bar.close()


def build_subjects(specs: Sequence[RowSpec], args: argparse.Namespace, services: Services, trainer: Any,
                   stack: ExitStack, run_id: str) -> list[Subject]:
    """The rows (peer rows share one worker) and, on the local emulator, the ceilings of their paths."""
    subjects: list[Subject] = []
    worker: PeerProcess | None = None
    peer_missing: str | None = None
    meter = CpuMeter()
    meter.watch("benchmark", os.getpid())
    for name, pid in (services.endpoint.pids.items() if services.endpoint else ()):
        meter.watch(name, pid)
    for spec in specs:
        reason = spec.unavailable_reason() or (peer_missing if spec.peer_variant else None)
        if reason:
            if args.types:
                raise SystemExit(f"{spec.name} is not available: {reason}")
            log.warning("skipping %s: %s", spec.name, reason)
            continue
        if spec.plugin is not None:
            modes = upload_modes(args) if spec.plugin.follows_upload_mode else [None]
            row = TieredRow if spec.key == TIERED_KEY else PluginRow
            subjects += [row(spec, mode, services, trainer, run_id, args.keep, meter) for mode in modes]
            continue
        if worker is None:
            try:
                worker = stack.enter_context(PeerProcess(
                    endpoint=services.endpoint.url if services.endpoint else None, layers=args.layers,
                    peer_path=args.peer_path, project=args.project, wikitext2_dir=args.wikitext2_dir))
                meter.watch("peer worker", worker.pid)
            except PeerUnavailableError as err:
                peer_missing = f"{err}; {PEER_INSTALL_HINT}"
                if args.types:
                    raise SystemExit(f"{spec.name} is not available: {peer_missing}") from err
                log.warning("skipping %s: %s", spec.name, peer_missing)
                continue
        subjects.append(PeerRow(spec, worker, services.gcs_dir(), run_id, args.keep, meter))
    endpoint = services.endpoint
    if endpoint is not None and any(s.upload for s in subjects):
        bucket = services.gcs_dir().split("/")[2]
        data = checkpoint_bytes(trainer, services.local_dir(), stack)
        from dataflux_ckpt import CHUNK_SIZE_BYTES, MAX_WORKERS

        raw = RawGcs(endpoint.url, workers=MAX_WORKERS, part_bytes=CHUNK_SIZE_BYTES)
        stack.callback(raw.close)
        needed = {s.upload for s in subjects if s.upload}
        for mode in ("single", "xml", "composite"):
            if mode in needed:
                subjects.append(UploadCeiling(mode, raw, bucket, data, run_id, meter))
        subjects += [DownloadCeiling(mode, raw, bucket, data, run_id, meter)
                     for mode in ("download", "download_crc32c", "load")]
    tiered_modes = sorted({s.upload for s in subjects if isinstance(s, TieredRow)})
    if tiered_modes:
        path = tier_file(trainer, services.local_dir(), stack)
        if endpoint is not None:
            with open(path, "rb") as f:
                tier_data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            stack.callback(tier_data.close)
            subjects += [UploadCeiling(mode, raw, bucket, tier_data, run_id, meter, of=TIER_FILE)
                         for mode in tiered_modes]
        subjects.append(LocalReadCeiling(path, meter))
    return subjects


def describe(args: argparse.Namespace, services: Services, network: NetworkModel) -> str:
    if services.endpoint is None:
        where = f"GCS at {args.ckpt_dir}" if args.ckpt_dir and is_gcs(args.ckpt_dir) else "no GCS"
    else:
        where = (f"fake-gcs-server ({args.gcs_emulator_backend} backend) behind the XML multipart server; "
                 f"network: {network.describe()}")
    return f"Lightning checkpoints, LAYERS={args.layers}, STEPS={args.steps}; {where}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lightning_ckpt",
        description=__doc__.split("\n\n")[0],
        epilog="Checkpoint types for --types: " + ", ".join(f"{s.key} = {s.name}" for s in ROW_SPECS.values()),
    )
    parser.add_argument("--ckpt-dir", default=env.get("CKPT_DIR_PATH"),
                        help="where checkpoints go: gs://bucket/prefix or a local directory "
                             "(env CKPT_DIR_PATH; default: a local emulator bucket and a temp dir)")
    parser.add_argument("--steps", type=int, default=int(env.get("STEPS") or 5),
                        help="saves and loads per row (env STEPS, default 5)")
    parser.add_argument("--layers", type=int, default=int(env.get("LAYERS") or 100),
                        help="encoder and decoder layers of the demo Transformer (env LAYERS, default 100)")
    parser.add_argument("--project", default=env.get("PROJECT"), help="GCP project (env PROJECT)")
    parser.add_argument("--dataflux", action=argparse.BooleanOptionalAction, default=_env_flag("DATAFLUX_CKPT", None),
                        help="run only DatafluxCheckpointIO (env DATAFLUX_CKPT=1) or only TorchCheckpointIO "
                             "(DATAFLUX_CKPT=0); default: compare the Dataflux Lightning benchmark's three GCS rows and "
                             "a Tiered row")
    parser.add_argument("--use-transfer-manager", action=argparse.BooleanOptionalAction,
                        default=_env_flag("USE_TRANSFER_MANAGER", True),
                        help="with DATAFLUX_CKPT=1: parallel part uploads and ranged downloads "
                             "(env USE_TRANSFER_MANAGER, default on)")
    parser.add_argument("--compare", action="store_true",
                        help="run every available row: local, GCS, Redis, and the peer package")
    parser.add_argument("--types", help="comma-separated rows to run (see below); a Tiered row brings the rows "
                                        "its bars compare it with")
    parser.add_argument("--upload-mode", choices=(*UPLOAD_MODES, "both"), default="xml",
                        help="parallel uploads by XML multipart (GCS's API; default), by composite objects, or "
                             "a row of each; each mode's raw ceiling is measured in the same run")
    parser.add_argument("--network", type=_network_arg, default=parse_network("loopback"),
                        metavar="loopback|cloud[:MBPS,RTT_MS]",
                        help="loopback (default), or every GCS client connection through a toxiproxy model: "
                             "MBPS per connection in each direction and a round trip of RTT_MS "
                             "(cloud alone: 100 MB/s, 4 ms)")
    parser.add_argument("--peer-path", default=default_peer_path(),
                        help=f"directory holding gcs-torch-dataflux 1.4.0 and its google-cloud-storage 2.x "
                             f"for the peer rows (default: ${PEER_PATH_ENV}, else .tools/gcs-torch-dataflux "
                             f"after `make setup`, else this environment)")
    parser.add_argument("--gcs-emulator-backend", choices=EMULATOR_BACKENDS, default="filesystem",
                        help="storage of the embedded fake-gcs-server: objects on disk in a temporary "
                             "directory, like a real object store (default), or in the emulator's memory")
    parser.add_argument("--local-dir", help="directory for local rows (default: a temporary directory)")
    parser.add_argument("--wikitext2-dir", help="train on WikiText2 from this directory instead of synthetic tokens")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints instead of removing them")
    parser.add_argument("--aa", action="store_true",
                        help="also run an identical copy (an A/A control) of every row and ceiling in the same "
                             "rounds, and report how far each copy's medians land from its original's: the "
                             "run's noise floor, within which a ratio cannot be told from its bar")
    parser.add_argument("--json", metavar="PATH", default=DEFAULT_JSON,
                        help="write the rows as a JSON list here, the tables as Markdown (.md) and the chart "
                             "(.png) next to it (default %(default)s)")
    parser.add_argument("--chart", metavar="PATH",
                        help="write the PNG chart here (default: the JSON path with .png)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the services and plugins do")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.layers < 1:
        parser.error("--steps and --layers must be positive")
    if not args.network.is_loopback and args.ckpt_dir and is_gcs(args.ckpt_dir):
        parser.error("--network models the network to the local emulator; it does not apply to real GCS")
    return args


def _network_arg(text: str) -> NetworkModel:
    try:
        return parse_network(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def configure_console(verbose: bool) -> None:
    """Warnings only, unless ``verbose``: the console shows the progress bars and the tables (and
    DeepSpeed, which the FastPersist row loads, only its errors)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    quiet_lightning()
    if not verbose:
        quiet_self_printing_loggers()


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_after_this_operation(stop: threading.Event) -> Callable[[int, object], None]:
    """A SIGINT handler: the first Ctrl-C lets the running save or load finish (an interrupt inside a
    library call can leave its connections and buffers half used), a second one stops at once."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt(f"signal {signum}")
        stop.set()
        print("stopping after the running operation (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    return handler


def _interrupted(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was raised while handling, a KeyboardInterrupt (a clean-up failing
    during the unwinding replaces it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_console(args.verbose)
    # SIGTERM unwinds like Ctrl-C, so the services started below are stopped in order.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    specs = select_rows(args)
    options = ServiceOptions(ckpt_dir=args.ckpt_dir, local_dir=args.local_dir, project=args.project,
                             emulator_backend=args.gcs_emulator_backend, network=args.network)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    try:
        with Services(options) as services, ExitStack() as stack:
            for spec in specs:
                if not spec.unavailable_reason():
                    services.directory(spec.storage)  # start every service up front
            trainer = fitted_trainer(args.layers, args.wikitext2_dir, services.local_dir())
            subjects = build_subjects(specs, args, services, trainer, stack, run_id)
            if args.aa:
                subjects += as_controls(subjects, build_subjects(specs, args, services, trainer, stack, f"{run_id}-aa"))
            for subject in subjects:
                stack.callback(subject.close)
            if not subjects:
                raise SystemExit("no row can run here")
            header = describe(args, services, args.network)
            stop = threading.Event()
            signal.signal(signal.SIGINT, _stop_after_this_operation(stop))
            print(header, flush=True)
            run_rounds(subjects, args.steps, stop)
            context = {"layers": args.layers, "steps": args.steps, "network": args.network.name,
                       "network_mbps": args.network.mbps, "network_rtt_ms": args.network.rtt_ms}
            rows = [subject_row(s, context) for s in subjects if s.kind == "row"]
            ceiling_rows = [subject_row(s, context) for s in subjects if s.kind == "ceiling"]
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        print("interrupted; services stopped", file=sys.stderr)
        return 130
    add_ratios(rows, ceiling_rows)
    print()
    print(format_report(rows, ceiling_rows))
    bars = "\n\n".join(filter(None, (format_bars(rows), format_aa(rows + ceiling_rows))))
    if bars:
        print()
        print(bars)
    print()
    print(format_average_times(rows))
    write_json(args.json, rows + ceiling_rows)
    markdown = Path(args.json).with_suffix(".md")
    markdown.write_text(f"{header}\n\n{format_report(rows, ceiling_rows, format_markdown_table)}\n"
                        + (f"\n{bars}\n" if bars else ""))
    chart = write_chart(args.chart or Path(args.json).with_suffix(".png"), rows, ceiling_rows, header)
    print(f"\nrows: {args.json} (tables as Markdown: {markdown}); chart: {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
