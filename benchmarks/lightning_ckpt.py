"""Lightning checkpoint save/load benchmark: the Dataflux Lightning checkpoint benchmark, offline.

Trains Lightning's demo Transformer (``num_encoder_layers = num_decoder_layers = LAYERS``) for one
step, then times ``trainer.save_checkpoint`` STEPS times and the plugin's ``load_checkpoint`` STEPS
times for each checkpoint type, and prints the averages in the seed's words plus a table.

Configuration follows the seed's environment variables (``CKPT_DIR_PATH``, ``STEPS``, ``LAYERS``,
``PROJECT``, ``DATAFLUX_CKPT``, ``USE_TRANSFER_MANAGER``); command-line flags win over them. With no
``CKPT_DIR_PATH`` a local GCS emulator is started, a bucket created, and everything torn down after.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# gcsfs reads this once, at import: its bucket-type probe over gRPC stalls against an emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from benchmarks.report import PeakRSS, configure_logging, format_table, ratio, write_json  # noqa: E402

log = logging.getLogger("benchmarks.lightning_ckpt")

MB = 1e6
VOCAB_SIZE = 33278  # WikiText2's vocabulary, as in Lightning's demo
BLOCK_SIZE = 35
SYNTHETIC_TOKENS = 64 * BLOCK_SIZE
BASELINE_TYPE = "TorchCheckpointIO (gcsfs)"
HTTP_TIMEOUT_S = 300.0


class SyntheticTokens(Dataset):
    """Random token blocks shaped like ``lightning.pytorch.demos.WikiText2`` items (offline stand-in)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, block_size: int = BLOCK_SIZE, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (SYNTHETIC_TOKENS + 1,), generator=generator)
        self.block_size = block_size
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        return self.data[start : start + self.block_size], self.data[start + 1 : start + 1 + self.block_size]


def make_dataset(wikitext2_dir: str | None) -> Dataset:
    """WikiText2 from a local copy when given (the seed's data), synthetic tokens otherwise."""
    if wikitext2_dir:
        from lightning.pytorch.demos import WikiText2

        return WikiText2(data_dir=Path(wikitext2_dir), download=False)
    return SyntheticTokens()


def make_model(layers: int, vocab_size: int):
    """Lightning's demo Transformer with ``layers`` encoder and decoder layers, as the seed builds it."""
    from lightning.pytorch.demos import LightningTransformer, Transformer

    class BenchmarkLightningTransformer(LightningTransformer):
        def __init__(self) -> None:
            super().__init__(vocab_size=vocab_size)
            self.model = Transformer(vocab_size=vocab_size, nlayers=layers)

        def prepare_data(self) -> None:
            """Data comes from the DataLoader passed to ``fit``; the demo's download is skipped."""

    return BenchmarkLightningTransformer()


@dataclass
class Services:
    """Services and locations shared by every row of one run, started on first use."""

    args: argparse.Namespace
    stack: ExitStack
    _local_dir: str | None = None
    _gcs_dir: str | None = None
    _redis_address: str | None = None
    emulator: Any = None
    redis_prefix: str = field(default_factory=lambda: f"ckpts-{uuid.uuid4().hex[:8]}")

    def local_dir(self) -> str:
        if self._local_dir is None:
            if self.args.local_dir:
                Path(self.args.local_dir).mkdir(parents=True, exist_ok=True)
                self._local_dir = self.args.local_dir
            else:
                self._local_dir = self.stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-bench-"))
        return self._local_dir

    def gcs_dir(self) -> str:
        if self._gcs_dir is None:
            if self.args.ckpt_dir and is_gcs(self.args.ckpt_dir):
                self._gcs_dir = self.args.ckpt_dir.rstrip("/")
                if self.args.project:
                    import fsspec.config

                    fsspec.config.conf.setdefault("gcs", {})["project"] = self.args.project
            else:
                from dataflux_ckpt.emulator import FakeGcsServer

                root = None
                if self.args.gcs_emulator_backend == "filesystem":
                    root = self.stack.enter_context(tempfile.TemporaryDirectory(prefix="fake-gcs-"))
                self.emulator = self.stack.enter_context(FakeGcsServer(root=root))
                self.stack.enter_context(self.emulator.activated())
                bucket = f"bench-{uuid.uuid4().hex[:8]}"
                self.emulator.create_bucket(bucket)
                self._gcs_dir = f"gs://{bucket}/ckpts"
                log.info("started GCS emulator (%s backend) at %s, bucket %s",
                         self.args.gcs_emulator_backend, self.emulator.url, bucket)
        return self._gcs_dir

    def redis_address(self) -> str:
        if self._redis_address is None:
            from smartredis_io.server import RedisServer

            self._redis_address = self.stack.enter_context(RedisServer()).address
        return self._redis_address

    def directory(self, storage: str) -> str:
        if storage == "local":
            if self.args.ckpt_dir and not is_gcs(self.args.ckpt_dir):
                return self.args.ckpt_dir
            return self.local_dir()
        if storage == "gcs":
            return self.gcs_dir()
        if storage == "redis":
            self.redis_address()
            return self.redis_prefix
        raise ValueError(f"unknown storage {storage!r}")


def is_gcs(path: str) -> bool:
    return path.startswith(("gs://", "gcs://"))


def fsspec_size(path: str, checkpoint_io: Any) -> int:
    from lightning.fabric.utilities.cloud_io import get_filesystem

    return get_filesystem(path).size(path)


@dataclass(frozen=True)
class CheckpointType:
    """One row of the table: a CheckpointIO factory and where its checkpoints go."""

    key: str
    name: str
    storage: str  # "local" | "gcs" | "redis"
    make_io: Callable[[Services], Any]
    requires: str | None = None  # module whose absence makes the row unavailable
    size_bytes: Callable[[str, Any], int] = field(default=fsspec_size)

    def unavailable_reason(self) -> str | None:
        if self.requires is None:
            return None
        try:
            __import__(self.requires)
        except ImportError as err:
            return str(err)
        return None


def _torch_io(services: Services):
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    return TorchCheckpointIO()


def _dataflux_io(use_transfer_manager: bool) -> Callable[[Services], Any]:
    def make(services: Services):
        from dataflux_ckpt import DatafluxCheckpointIO

        return DatafluxCheckpointIO(
            project_name=services.args.project, use_transfer_manager=use_transfer_manager
        )

    return make


def _fastpersist_io(services: Services):
    from fastpersist import FastPersistCheckpointIO

    return FastPersistCheckpointIO()


def _smartredis_io(services: Services):
    from smartredis_io import SmartRedisCheckpointIO

    return SmartRedisCheckpointIO(address=services.redis_address())


def _smartredis_size(path: str, checkpoint_io: Any) -> int:
    return checkpoint_io.checkpoint_size(path)


CHECKPOINT_TYPES: dict[str, CheckpointType] = {
    t.key: t
    for t in [
        CheckpointType("torch-local", "TorchCheckpointIO (local)", "local", _torch_io),
        CheckpointType("torch-gcsfs", BASELINE_TYPE, "gcs", _torch_io, requires="gcsfs"),
        CheckpointType(
            "dataflux-tm", "Dataflux (Transfer Manager Enabled)", "gcs", _dataflux_io(True),
            requires="dataflux_ckpt.checkpoint_io",
        ),
        CheckpointType(
            "dataflux-no-tm", "Dataflux (Transfer Manager Disabled)", "gcs", _dataflux_io(False),
            requires="dataflux_ckpt.checkpoint_io",
        ),
        CheckpointType(
            "fastpersist", "FastPersistCheckpointIO (local)", "local", _fastpersist_io,
            requires="fastpersist.checkpoint_io",
        ),
        CheckpointType(
            "smartredis", "SmartRedisCheckpointIO (redis)", "redis", _smartredis_io,
            requires="smartredis_io.lightning", size_bytes=_smartredis_size,
        ),
    ]
}


def select_types(args: argparse.Namespace) -> list[CheckpointType]:
    """The rows to run: ``--types``, else ``--compare`` (all available), else the seed's selection."""
    if args.types:
        keys = [k.strip() for k in args.types.split(",") if k.strip()]
        unknown = [k for k in keys if k not in CHECKPOINT_TYPES]
        if unknown:
            raise SystemExit(f"unknown --types {unknown}; choose from {', '.join(CHECKPOINT_TYPES)}")
        return [CHECKPOINT_TYPES[k] for k in keys]
    if args.compare:
        selected = []
        for ctype in CHECKPOINT_TYPES.values():
            reason = ctype.unavailable_reason()
            if reason:
                log.warning("skipping %s: %s", ctype.name, reason)
            else:
                selected.append(ctype)
        return selected
    if args.dataflux:
        return [CHECKPOINT_TYPES["dataflux-tm" if args.use_transfer_manager else "dataflux-no-tm"]]
    if args.ckpt_dir:
        return [CHECKPOINT_TYPES["torch-gcsfs" if is_gcs(args.ckpt_dir) else "torch-local"]]
    return [CHECKPOINT_TYPES["torch-local"], CHECKPOINT_TYPES["torch-gcsfs"]]


def _progress(iterable: Sequence[str], desc: str) -> Iterator[str]:
    from tqdm import tqdm

    return iter(tqdm(iterable, desc=desc, unit="ckpt", leave=False, file=sys.stderr))


def run_type(ctype: CheckpointType, services: Services, model, dataloader, args) -> dict[str, Any]:
    """Fit one step with ``ctype``'s plugin, then time STEPS saves and STEPS loads."""
    from lightning.pytorch import Trainer

    checkpoint_io = ctype.make_io(services)
    directory = services.directory(ctype.storage)
    trainer = Trainer(
        plugins=[checkpoint_io],
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=services.local_dir(),
    )
    trainer.fit(model, dataloader)
    paths = [f"{directory}/ckpt_{i}.ckpt" for i in range(args.steps)]
    save_times, load_times = [], []
    with PeakRSS() as save_rss:
        for path in _progress(paths, f"save {ctype.name}"):
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            save_times.append(time.perf_counter() - start)
    with PeakRSS() as load_rss:
        for path in _progress(paths, f"load {ctype.name}"):
            start = time.perf_counter()
            checkpoint_io.load_checkpoint(path)
            load_times.append(time.perf_counter() - start)
    size_bytes = ctype.size_bytes(paths[0], checkpoint_io)
    if not args.keep:
        for path in paths:
            checkpoint_io.remove_checkpoint(path)
    checkpoint_io.teardown()

    save_s, load_s = statistics.fmean(save_times), statistics.fmean(load_times)
    print(f"== {ctype.name}, {args.layers} layers ==")
    print(f"Average time to save one checkpoint: {save_s} seconds")
    print(f"Average time to load one checkpoint: {load_s} seconds", flush=True)
    size_mb = size_bytes / MB
    return {
        "type": ctype.name,
        "layers": args.layers,
        "size_mb": size_mb,
        "save_s": save_s,
        "save_mbps": size_mb / save_s,
        "load_s": load_s,
        "load_mbps": size_mb / load_s,
        "save_median_s": statistics.median(save_times),
        "load_median_s": statistics.median(load_times),
        "save_times_s": save_times,
        "load_times_s": load_times,
        "peak_rss_mb": max(save_rss.peak_mb, load_rss.peak_mb),
        # What the saves added on top of the process, which already holds the model and optimizer.
        "save_extra_rss_mb": save_rss.peak_mb - save_rss.start_mb,
        "load_extra_rss_mb": load_rss.peak_mb - load_rss.start_mb,
        "steps": args.steps,
        "location": directory if ctype.storage != "redis" else services.redis_address(),
    }


def _emulator_request(url: str, method: str, target: str, body: bytes | memoryview | None = None,
                      content_type: str = "application/octet-stream") -> bytes:
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=HTTP_TIMEOUT_S)
    try:
        headers = {"Content-Type": content_type} if body is not None else {}
        conn.request(method, target, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        if response.status >= 300:
            raise RuntimeError(f"{method} {url}{target} -> {response.status}: {data[:200]!r}")
        return data
    finally:
        conn.close()


def _upload_target(bucket: str, name: str) -> str:
    return f"/upload/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode({"uploadType": "media", "name": name})


def _object_target(bucket: str, name: str) -> str:
    return f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"


def _raw_composite_upload(emulator_url: str, bucket: str, name: str, data: bytes) -> list[str]:
    """A parallel composite upload with no GCS client library in the way: parts of the plugin's
    default size (at most 32 of them, so that one compose suffices) sent on parallel connections,
    then one compose. Returns the part objects, left for the caller to delete: like the plugin,
    which deletes them in the background, the upload is complete once the compose is."""
    from dataflux_ckpt import CHUNK_SIZE_BYTES, MAX_WORKERS
    from dataflux_ckpt.upload import MAX_COMPOSE_SOURCES

    part_bytes = max(CHUNK_SIZE_BYTES, -(-len(data) // MAX_COMPOSE_SOURCES))
    view = memoryview(data)
    parts = {f"{name}.part{i:03d}": view[start : start + part_bytes]
             for i, start in enumerate(range(0, len(data), part_bytes))}

    def upload(part: str) -> None:
        _emulator_request(emulator_url, "POST", _upload_target(bucket, part), parts[part])

    with ThreadPoolExecutor(MAX_WORKERS) as executor:
        list(executor.map(upload, parts))
    body = json.dumps({"sourceObjects": [{"name": part} for part in parts],
                       "destination": {"contentType": "application/octet-stream"}})
    target = f"{_object_target(bucket, name)}/compose"
    _emulator_request(emulator_url, "POST", target, body.encode(), content_type="application/json")
    return list(parts)


def _delete_objects(emulator_url: str, bucket: str, names: Sequence[str]) -> None:
    for stored in names:
        _emulator_request(emulator_url, "DELETE", _object_target(bucket, stored))


def measure_gcs_ceilings(emulator_url: str, bucket: str, data: bytes, repeats: int) -> dict[str, float]:
    """The emulator's ceilings for ``data``, with no GCS client library in the way.

    ``ceiling_save_mbps``: one raw single-request HTTP upload. ``ceiling_composite_save_mbps``: a
    raw parallel composite upload (parts and compose; the parts are deleted after the clock
    stops), the best any composite upload can do on this server. ``ceiling_load_mbps``: the serial
    bound of one raw HTTP download followed by ``torch.load`` of those bytes from memory.
    """
    name = f"ceiling-{uuid.uuid4().hex[:8]}"
    upload = _upload_target(bucket, name)
    download = f"{_object_target(bucket, name)}?alt=media"
    save_times, composite_times, load_times = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        _emulator_request(emulator_url, "POST", upload, data)
        save_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        parts = _raw_composite_upload(emulator_url, bucket, f"{name}-composite", data)
        composite_times.append(time.perf_counter() - start)
        _delete_objects(emulator_url, bucket, parts)
        start = time.perf_counter()
        fetched = _emulator_request(emulator_url, "GET", download)
        # torch.load's own defaults, as every row's load_checkpoint(path) gets them.
        torch.load(io.BytesIO(fetched))
        load_times.append(time.perf_counter() - start)
        del fetched
    _delete_objects(emulator_url, bucket, [name, f"{name}-composite"])
    size_mb = len(data) / MB
    return {
        "ceiling_save_mbps": size_mb / statistics.median(save_times),
        "ceiling_composite_save_mbps": size_mb / statistics.median(composite_times),
        "ceiling_load_mbps": size_mb / statistics.median(load_times),
    }


def checkpoint_bytes(trainer_model, dataloader, services: Services) -> bytes:
    """The bytes a TorchCheckpointIO save of this model writes (the ceilings move the same bytes)."""
    path = Path(services.local_dir()) / f"ceiling-{uuid.uuid4().hex[:8]}.ckpt"
    from lightning.pytorch import Trainer

    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=services.local_dir(),
    )
    trainer.fit(trainer_model, dataloader)
    trainer.save_checkpoint(path)
    try:
        return path.read_bytes()
    finally:
        path.unlink()


def add_ratios(rows: list[dict[str, Any]], ceilings: dict[str, float] | None) -> None:
    """Ratios of median rates (the ceilings are medians too), so one slow step does not skew them."""
    baseline = next((r for r in rows if r["type"] == BASELINE_TYPE), None)
    for row in rows:
        row["save_median_mbps"] = row["size_mb"] / row["save_median_s"]
        row["load_median_mbps"] = row["size_mb"] / row["load_median_s"]
    for row in rows:
        row["save_vs_baseline"] = ratio(row["save_median_mbps"], baseline and baseline["save_median_mbps"])
        row["load_vs_baseline"] = ratio(row["load_median_mbps"], baseline and baseline["load_median_mbps"])
        gcs_row = ceilings is not None and row["location"].startswith(("gs://", "gcs://"))
        for key in ("ceiling_save_mbps", "ceiling_composite_save_mbps", "ceiling_load_mbps"):
            row[key] = ceilings[key] if gcs_row else None
        row["save_vs_ceiling"] = ratio(row["save_median_mbps"], row["ceiling_save_mbps"])
        row["save_vs_composite_ceiling"] = ratio(row["save_median_mbps"], row["ceiling_composite_save_mbps"])
        row["load_vs_ceiling"] = ratio(row["load_median_mbps"], row["ceiling_load_mbps"])


TABLE_COLUMNS = {
    "type": "Checkpoint Type",
    "layers": "Layers",
    "size_mb": "Size (MB)",
    "save_s": "Avg Save (s)",
    "save_mbps": "Write MB/s",
    "load_s": "Avg Load (s)",
    "load_mbps": "Read MB/s",
    "peak_rss_mb": "Peak RSS MB",
    "save_extra_rss_mb": "Save +RSS MB",
}
RATIO_COLUMNS = {
    "type": "Checkpoint Type",
    "save_median_mbps": "Med. save MB/s",
    "load_median_mbps": "Med. load MB/s",
    "save_vs_baseline": "Save x gcsfs",
    "load_vs_baseline": "Load x gcsfs",
    "ceiling_save_mbps": "Ceil. save MB/s",
    "save_vs_ceiling": "Save x ceil.",
    "ceiling_composite_save_mbps": "Comp. ceil. MB/s",
    "save_vs_composite_ceiling": "Save x comp.",
    "ceiling_load_mbps": "Ceil. load MB/s",
    "load_vs_ceiling": "Load x ceil.",
}


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lightning_ckpt",
        description=__doc__.split("\n\n")[0],
        epilog="Checkpoint types for --types: " + ", ".join(
            f"{t.key} = {t.name}" for t in CHECKPOINT_TYPES.values()
        ),
    )
    parser.add_argument("--ckpt-dir", default=env.get("CKPT_DIR_PATH"),
                        help="where checkpoints go: gs://bucket/prefix or a local directory "
                             "(env CKPT_DIR_PATH; default: a local emulator bucket and a temp dir)")
    parser.add_argument("--steps", type=int, default=int(env.get("STEPS", 5)),
                        help="saves and loads per checkpoint type (env STEPS, default 5)")
    parser.add_argument("--layers", type=int, default=int(env.get("LAYERS", 100)),
                        help="encoder and decoder layers of the demo Transformer (env LAYERS, default 100)")
    parser.add_argument("--project", default=env.get("PROJECT"), help="GCP project (env PROJECT)")
    parser.add_argument("--dataflux", action=argparse.BooleanOptionalAction,
                        default=_env_flag("DATAFLUX_CKPT", False),
                        help="benchmark DatafluxCheckpointIO instead of TorchCheckpointIO (env DATAFLUX_CKPT=1)")
    parser.add_argument("--use-transfer-manager", action=argparse.BooleanOptionalAction,
                        default=_env_flag("USE_TRANSFER_MANAGER", True),
                        help="Dataflux parallel multipart upload/download (env USE_TRANSFER_MANAGER, default on)")
    parser.add_argument("--compare", action="store_true",
                        help="run every available checkpoint type in one run, with the GCS ceilings")
    parser.add_argument("--types", help="comma-separated checkpoint types to run (see below)")
    parser.add_argument("--gcs-emulator-backend", choices=("filesystem", "memory"), default="filesystem",
                        help="storage of the embedded fake-gcs-server: objects on disk in a temporary directory, "
                             "like a real object store (default), or all in the emulator's memory")
    parser.add_argument("--local-dir", help="directory for local rows (default: a temporary directory)")
    parser.add_argument("--wikitext2-dir", help="train on WikiText2 from this directory instead of synthetic tokens")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints instead of removing them")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.layers < 1:
        parser.error("--steps and --layers must be positive")
    return args


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the services started below are stopped in order.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    types = select_types(args)
    dataset = make_dataset(args.wikitext2_dir)
    dataloader = DataLoader(dataset, batch_size=1)
    model = make_model(args.layers, dataset.vocab_size)
    rows: list[dict[str, Any]] = []
    try:
        with ExitStack() as stack:
            services = Services(args, stack)
            for ctype in types:
                reason = ctype.unavailable_reason()
                if reason:
                    raise SystemExit(f"{ctype.name} is not available: {reason}")
                services.directory(ctype.storage)  # start every service up front
            for ctype in types:
                rows.append(run_type(ctype, services, model, dataloader, args))
            ceilings = None
            if services.emulator is not None and args.compare:
                bucket = services.gcs_dir().split("/")[2]
                data = checkpoint_bytes(model, dataloader, services)
                ceilings = measure_gcs_ceilings(services.emulator.url, bucket, data, args.steps)
            add_ratios(rows, ceilings)
    except KeyboardInterrupt:
        print("interrupted; services stopped", file=sys.stderr)
        return 130
    print()
    print(format_table(rows, TABLE_COLUMNS))
    if len(rows) > 1 or any(r["ceiling_save_mbps"] for r in rows):
        print()
        print(format_table(rows, RATIO_COLUMNS))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
