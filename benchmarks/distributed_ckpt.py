"""Sharded (torch.distributed.checkpoint) save and load on 1, 2 and 4 ranks, per storage layer.

    python -m benchmarks.distributed_ckpt --ranks 1 2 4 --size_mb 1024 [--json PATH]

Every rank holds its shard of ``--tensors`` float32 DTensors (``--size_mb`` MiB in total, split evenly
over the ranks, sharded along dim 0) in one gloo group; each row saves the whole state with
``dcp.save`` and loads it back in place with ``dcp.load``. Rows, in rounds (every row once per round,
in order, ``--repeat`` rounds, so compared rows interleave):

* local directory: ``FileSystemWriter(sync_files=True)`` / ``FileSystemReader`` (the baseline),
  ``FastPersistStorageWriter`` / ``Reader``, and the ceiling: raw O_DIRECT writes (fsynced) and reads of
  the same bytes from an aligned buffer;
* gs:// on a local fake-gcs-server (in-memory backend) behind the XML multipart server (real GCS with
  ``--gcs-root``):
  ``FsspecWriter`` / ``FsspecReader`` over gcsfs (the baseline), ``DatafluxStorageWriter`` / ``Reader``,
  gcs-torch-dataflux 1.4.0's ``GCSDistributedWriter`` / ``Reader`` (the peer, run by a worker process per
  rank with its own google-cloud-storage 2.x: ``--peer-path``), and the ceiling: one raw upload and one
  raw download of the same bytes per rank, all ranks at once; and the ceiling of the path
  ``DatafluxStorageWriter`` / ``Reader`` take: the same bytes as an XML API multipart upload and as
  parallel ranged GETs, in parts of the plugin's default ``chunk_size``, ``max_workers`` at a time, with
  nothing else on the client (``x path ceil``). Where the XML multipart server stands in front of
  fake-gcs-server, that path costs the server more than one request does: it receives and hashes the
  parts, then writes the whole object to fake-gcs-server when the upload completes;
* DCP's own cost: ``dcp.save`` / ``dcp.load`` over a storage layer that keeps nothing but the metadata
  (planning, collectives, metadata, resolving each item), which every storage layer pays on top of
  moving the bytes. ``x (ceil+DCP)`` compares a row with its ceiling plus that cost.

Times are per rank (from a barrier to the rank's return) and in total (barrier to barrier); loads of
local files start with the files evicted from the page cache. ``extra RSS`` is the most resident
memory a rank added during the operation. Ratios are of median totals, to the row's baseline, to the
peer, and to its storage's ceiling, all from the same run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from dataflux_ckpt.emulator import EMULATOR_PROJECT, configure_gcsfs_for_emulator  # noqa: E402

configure_gcsfs_for_emulator()  # before anything imports gcsfs

from benchmarks.lightning_peer import PEER_INSTALL_HINT, default_peer_path  # noqa: E402

log = logging.getLogger("benchmarks.distributed_ckpt")

MiB = 2**20
ALIGNMENT = 4096
RAW_CHUNK_BYTES = 16 * MiB
RAW_THREADS = 4
COLLECTIVE_TIMEOUT_S = 1800.0
HTTP_TIMEOUT_S = 600.0
RENDEZVOUS_HOST = "127.0.0.1"
CHECKOUT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    key: str
    name: str
    storage: str  # "local" or "gcs"
    baseline: str | None = None  # the row this one is compared with
    ceiling: bool = False
    path_ceiling: str | None = None  # the ceiling row of the transfer path this row takes
    peer: bool = False
    protocol: bool = False  # DCP's own cost, over storage that keeps nothing


ROWS = {row.key: row for row in [
    Row("filesystem", "FileSystemWriter/Reader (sync_files=True)", "local"),
    Row("fastpersist", "FastPersistStorageWriter/Reader", "local", baseline="filesystem"),
    Row("raw_local", "raw O_DIRECT write+fsync / read (ceiling)", "local", ceiling=True),
    Row("fsspec", "FsspecWriter/Reader (gcsfs)", "gcs"),
    Row("dataflux", "DatafluxStorageWriter/Reader", "gcs", baseline="fsspec", path_ceiling="raw_gcs_parts"),
    Row("peer", "GCSDistributedWriter/Reader (gcs-torch-dataflux 1.4.0)", "gcs", peer=True),
    Row("raw_gcs", "raw upload / download, one request per rank (ceiling)", "gcs", ceiling=True),
    Row("raw_gcs_parts", "raw XML multipart upload / ranged GETs, in parts (ceiling of the dataflux path)", "gcs",
        ceiling=True),
    Row("dcp_protocol", "dcp.save/load over storage that keeps nothing (DCP's own cost)", "local", protocol=True),
]}


def null_storage() -> tuple[type, type]:
    """A DCP ``StorageWriter`` that resolves every item and keeps only the metadata (a small file, as every
    storage layer writes one), and the ``StorageReader`` that serves it back and hands each tensor to the
    planner untouched: what ``dcp.save`` / ``dcp.load`` cost with no tensor bytes moved."""
    import pickle

    from torch.distributed.checkpoint import LoadPlan, SavePlan, StorageReader, StorageWriter
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    def done(value: Any) -> Future:
        future: Future = Future()
        future.set_result(value)
        return future

    class NullWriter(StorageWriter):
        def __init__(self, path: str) -> None:
            self.path = path

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            return plan

        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            return plans

        def write_data(self, plan: SavePlan, planner: Any) -> Future:
            results = []
            for item in plan.items:
                planner.resolve_data(item)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
            return done(results)

        def finish(self, metadata: Any, results: Any) -> None:
            os.makedirs(self.path, exist_ok=True)
            Path(self.path, ".metadata").write_bytes(pickle.dumps(metadata))

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def storage_meta(self) -> None:
            return None

    class NullReader(StorageReader):
        """Serves the metadata the writer kept at ``path``, or ``metadata`` as given (any storage's)."""

        def __init__(self, path: str | None = None, metadata: Any = None) -> None:
            self.path, self.metadata = path, metadata

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.metadata is None:
                self.metadata = pickle.loads(Path(self.path, ".metadata").read_bytes())
            return self.metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
            return plan

        def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
            return plans

        def read_data(self, plan: LoadPlan, planner: Any) -> Future:
            for item in plan.items:
                if item.type != LoadItemType.BYTE_IO:  # pickled items are skipped: there are no bytes
                    planner.commit_tensor(item, planner.resolve_tensor(item))
            return done(None)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

    return NullWriter, NullReader


# The state ----------------------------------------------------------------------------------------
def local_shards(rank: int, world: int, size_mb: int, tensors: int, *, zeros: bool = False) -> list[Any]:
    """This rank's shards: ``tensors`` float32 tensors of 1024 columns, ``size_mb / world`` MiB in all."""
    import torch

    rows = max(1, size_mb * MiB // world // tensors // 4096)
    generator = torch.Generator().manual_seed(1000 * rank + world)
    if zeros:
        return [torch.zeros(rows, 1024) for _ in range(tensors)]
    return [torch.randn(rows, 1024, generator=generator) for _ in range(tensors)]


def state_dict(shards: list[Any], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    return {f"layer{i}.weight": DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)
            for i, shard in enumerate(shards)}


def aligned_copy(shards: list[Any]) -> Any:
    """The shards' bytes, back to back, in one page-aligned buffer (what the ceilings move)."""
    import torch

    total = sum(s.numel() * 4 for s in shards)
    raw = torch.empty(total + ALIGNMENT, dtype=torch.uint8)
    buffer = raw.narrow(0, -raw.data_ptr() % ALIGNMENT, total)
    offset = 0
    for shard in shards:
        n = shard.numel() * 4
        buffer.narrow(0, offset, n).copy_(shard.reshape(-1).view(torch.uint8))
        offset += n
    return buffer


# Ceilings -----------------------------------------------------------------------------------------
def raw_local(path: str, buffer: Any, write: bool) -> None:
    """Move ``buffer`` to or from ``path`` with O_DIRECT, 16 MiB per call on 4 threads (fsync after writes)."""
    view = memoryview(buffer.numpy())
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o644)
    try:
        def move(offset: int) -> None:
            piece = view[offset : offset + RAW_CHUNK_BYTES]
            done = 0
            while done < piece.nbytes:
                call = os.pwritev if write else os.preadv
                moved = call(fd, [piece[done:]], offset + done)
                if moved <= 0:
                    raise OSError(f"short {'write' if write else 'read'} at {offset + done} of {path}")
                done += moved

        with ThreadPoolExecutor(RAW_THREADS) as pool:
            list(pool.map(move, range(0, view.nbytes, RAW_CHUNK_BYTES)))
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_gcs(endpoint: str, bucket: str, name: str, buffer: Any, upload: bool) -> None:
    """One raw upload (``uploadType=media``) or download of ``buffer`` as object ``name``."""
    url = urllib.parse.urlsplit(endpoint)
    view = memoryview(buffer.numpy())
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=HTTP_TIMEOUT_S)
    quoted = urllib.parse.quote(name, safe="")
    try:
        if upload:
            conn.request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quoted}", body=view,
                         headers={"Content-Type": "application/octet-stream", "Content-Length": str(view.nbytes)})
            response = conn.getresponse()
            response.read()
        else:
            conn.request("GET", f"/download/storage/v1/b/{bucket}/o/{quoted}?alt=media")
            response = conn.getresponse()
            got = 0
            while got < view.nbytes:
                n = response.readinto(view[got:])
                if not n:
                    break
                got += n
            response.read()
        if response.status != 200:
            raise OSError(f"raw {'upload' if upload else 'download'} of gs://{bucket}/{name}: HTTP {response.status}")
    finally:
        conn.close()


def raw_gcs_parts(raw: Any, bucket: str, name: str, buffer: Any, upload: bool) -> None:
    """``buffer`` as an XML multipart upload, or back with parallel ranged GETs, in ``raw``'s parts."""
    view = memoryview(buffer.numpy())
    if upload:
        raw.xml_multipart_upload(bucket, name, view)
    else:
        raw.download_into(bucket, name, view)


def drop_cache(directory: str) -> None:
    """Evict every file under ``directory`` from the page cache (O_DIRECT readers never use it)."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# The peer's worker (its own interpreter, its own google-cloud-storage) ------------------------------
class PeerClient:
    """A rank's handle on its gcs-torch-dataflux worker, which runs in its own gloo group."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([spec["peer_path"], str(CHECKOUT), env.get("PYTHONPATH", "")])
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.distributed_ckpt", "--peer-worker", json.dumps(spec), str(rank)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.versions = self._reply(HTTP_TIMEOUT_S)["versions"]

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            self._proc.kill()
            raise RuntimeError("the gcs-torch-dataflux worker died or did not answer")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"gcs-torch-dataflux worker: {reply.get('error')}")
        return reply

    def run(self, op: str, path: str, warmup: bool = False) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": op, "path": path, "warmup": warmup}) + "\n")
        self._proc.stdin.flush()
        return self._reply(COLLECTIVE_TIMEOUT_S)

    def close(self) -> None:
        if self._proc.poll() is None and self._proc.stdin is not None:
            self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self._proc.stdin.flush()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def peer_worker(spec: dict[str, Any], rank: int) -> int:
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.report import PeakRSS

    def send(reply: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()

    try:
        from importlib.metadata import version

        from dataflux_pytorch.dataflux_checkpoint import DatafluxCheckpointBuffer
        from dataflux_pytorch.lightning.gcs_filesystem import GCSDistributedReader, GCSDistributedWriter
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project=EMULATOR_PROJECT, credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": spec["endpoint"]}) if spec["endpoint"] else None
        versions = {"gcs-torch-dataflux": version("gcs-torch-dataflux"),
                    "google-cloud-storage": version("google-cloud-storage")}
    except ImportError as err:
        send({"ok": False, "error": f"{err}; {PEER_INSTALL_HINT}"})
        return 1
    _make_close_idempotent(DatafluxCheckpointBuffer)
    world = spec["world"]
    dist.init_process_group("gloo", store=_rendezvous(spec["peer_port"]), rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (world,))
    full = state_dict(local_shards(rank, world, spec["size_mb"], spec["tensors"]), mesh)
    full_target = state_dict(local_shards(rank, world, spec["size_mb"], spec["tensors"], zeros=True), mesh)
    small = state_dict(local_shards(rank, world, world, 1), mesh)
    small_target = state_dict(local_shards(rank, world, world, 1, zeros=True), mesh)
    send({"ok": True, "versions": versions})
    project = spec.get("project") or EMULATOR_PROJECT
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        dist.barrier()
        state, target = (small, small_target) if request.get("warmup") else (full, full_target)
        for shard in target.values():
            shard.to_local().zero_()
        with PeakRSS() as rss:
            start = time.perf_counter()
            if request["op"] == "save":
                dcp.save(state, storage_writer=GCSDistributedWriter(request["path"], project, storage_client=client))
            else:
                dcp.load(target, storage_reader=GCSDistributedReader(request["path"], project, storage_client=client))
            seconds = time.perf_counter() - start
        verified = all(torch.equal(state[k].to_local(), target[k].to_local()) for k in state)
        send({"ok": True, "seconds": seconds, "extra_rss_mb": (rss.peak_mb - rss.start_mb) * 1e6 / MiB,
              "verified": verified})
    dist.destroy_process_group()
    return 0


def _rendezvous(port: int) -> Any:
    """A client of the gloo group's store, which the parent serves on ``port`` (see :func:`run_world`)."""
    import torch.distributed as dist

    return dist.TCPStore(RENDEZVOUS_HOST, port, is_master=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _make_close_idempotent(buffer_class: type) -> None:
    """Newer torch's FileSystemWriter closes each stream inside its ``with`` block, so 1.4.0's upload-on-
    close buffer is closed twice and fails the second time; a second close does nothing here."""
    upload_and_close = buffer_class.close

    def close(self: Any) -> None:
        if not self.closed:
            upload_and_close(self)

    buffer_class.close = close


# One rank -------------------------------------------------------------------------------------------
def rank_worker(spec: dict[str, Any], rank: int) -> int:
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.report import PeakRSS

    world, rows = spec["world"], [ROWS[key] for key in spec["rows"]]
    dist.init_process_group("gloo", store=_rendezvous(spec["port"]), rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (world,))
    shards = local_shards(rank, world, spec["size_mb"], spec["tensors"])
    targets = local_shards(rank, world, spec["size_mb"], spec["tensors"], zeros=True)
    state, target = state_dict(shards, mesh), state_dict(targets, mesh)
    needs_raw = any(row.ceiling for row in rows)
    buffer = aligned_copy(shards) if needs_raw else None
    peer = PeerClient(spec, rank) if any(row.peer for row in rows) else None
    raw_parts = None
    if any(row.key == "raw_gcs_parts" for row in rows):
        from benchmarks.raw_gcs import RawGcs
        from dataflux_ckpt.options import CHUNK_SIZE_BYTES, MAX_WORKERS

        raw_parts = RawGcs(spec["endpoint"], workers=MAX_WORKERS, part_bytes=CHUNK_SIZE_BYTES)
    from fastpersist import FastPersistContext

    fastpersist_context = FastPersistContext()  # handle and staging buffer kept across saves, as a trainer would
    null_writer, null_reader = null_storage()
    gcs_root, local_root = spec["gcs_root"], spec["local_root"]
    bucket, _, prefix = gcs_root.removeprefix("gs://").partition("/")
    results: dict[str, Any] = {"rank": rank, "rows": {row.key: {"save": [], "load": []} for row in rows},
                               "verified": {}, "peer_versions": peer.versions if peer else None}

    def path(row: Row, round_index: int) -> str:
        root = gcs_root if row.storage == "gcs" else local_root
        return f"{root}/{row.key}-{spec['world']}r-{round_index}"

    def operation(row: Row, op: str, where: str, warmup: bool = False) -> Callable[[], dict[str, Any] | None]:
        try:
            from torch.distributed.checkpoint import FsspecReader, FsspecWriter
        except ImportError:  # torch < 2.7 keeps them in a private module
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        from dataflux_ckpt import DatafluxStorageReader, DatafluxStorageWriter
        from fastpersist import FastPersistStorageReader, FastPersistStorageWriter

        writers: dict[str, Callable[[], Any]] = {
            "dcp_protocol": lambda: null_writer(where),
            "filesystem": lambda: dcp.FileSystemWriter(where, sync_files=True),
            "fastpersist": lambda: FastPersistStorageWriter(where, context=fastpersist_context),
            "fsspec": lambda: FsspecWriter(where, sync_files=False),
            "dataflux": lambda: DatafluxStorageWriter(where),
        }
        readers: dict[str, Callable[[], Any]] = {
            "dcp_protocol": lambda: null_reader(where),
            "filesystem": lambda: dcp.FileSystemReader(where),
            "fastpersist": lambda: FastPersistStorageReader(where, context=fastpersist_context),
            "fsspec": lambda: FsspecReader(where),
            "dataflux": lambda: DatafluxStorageReader(where),
        }
        if row.peer:
            assert peer is not None
            return lambda: peer.run(op, where, warmup)
        if row.key == "raw_local":
            os.makedirs(where, exist_ok=True)
            return lambda: raw_local(f"{where}/rank{rank}.bin", buffer, op == "save")
        if row.key == "raw_gcs":
            name = f"{prefix}/{os.path.basename(where)}/rank{rank}.bin".lstrip("/")
            return lambda: raw_gcs(spec["endpoint"], bucket, name, buffer, op == "save")
        if row.key == "raw_gcs_parts":
            name = f"{prefix}/{os.path.basename(where)}/rank{rank}.bin".lstrip("/")
            return lambda: raw_gcs_parts(raw_parts, bucket, name, buffer, op == "save")
        saved, loaded = (small, small_target) if warmup else (state, target)
        if op == "save":
            return lambda: dcp.save(saved, storage_writer=writers[row.key]())
        return lambda: dcp.load(loaded, storage_reader=readers[row.key]())

    def measure(row: Row, op: str, where: str) -> dict[str, float]:
        run = operation(row, op, where)
        if op == "load" and row.storage == "local" and rank == 0:
            drop_cache(where)
        dist.barrier()
        with PeakRSS() as rss:
            start = time.perf_counter()
            reply = run()
            seconds = time.perf_counter() - start
        extra = (rss.peak_mb - rss.start_mb) * 1e6 / MiB
        measured = {"seconds": seconds, "extra_rss_mb": extra}
        if isinstance(reply, dict):  # the peer measured itself in its own process
            measured = {key: reply[key] for key in ("seconds", "extra_rss_mb", "verified")}
        dist.barrier()
        return {**measured, "total_seconds": time.perf_counter() - start}

    # One untimed save and load of a small state per row first: clients, aio handles and staging
    # buffers are set up once in a training job, not per checkpoint.
    small = state_dict(local_shards(rank, world, world, 1), mesh)
    small_target = state_dict(local_shards(rank, world, world, 1, zeros=True), mesh)
    try:
        for row in rows:
            if not row.ceiling:
                where = path(row, -1)
                for op in ("save", "load"):
                    dist.barrier()
                    operation(row, op, where, warmup=True)()
                dist.barrier()
                if rank == 0:
                    remove(where)
        for round_index in range(spec["repeat"]):
            for row in rows:
                where = path(row, round_index)
                for shard in targets:
                    shard.zero_()
                results["rows"][row.key]["save"].append(measure(row, "save", where))
                if row.ceiling:
                    buffer.zero_()  # the load must bring the bytes back
                results["rows"][row.key]["load"].append(measure(row, "load", where))
                if round_index == 0:
                    if row.peer:
                        results["verified"][row.key] = results["rows"][row.key]["load"][-1]["verified"]
                    elif row.ceiling:
                        results["verified"][row.key] = bool(torch.equal(buffer, aligned_copy(shards)))
                    elif row.protocol:
                        results["verified"][row.key] = None  # it moves no bytes: nothing to check
                    else:
                        results["verified"][row.key] = all(torch.equal(a, b) for a, b in zip(shards, targets, strict=True))
                dist.barrier()
                if rank == 0:
                    remove(where)
                dist.barrier()
    finally:
        fastpersist_context.close()
        if raw_parts is not None:
            raw_parts.close()
        if peer is not None:
            peer.close()
    Path(spec["results"][rank]).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


def remove(where: str) -> None:
    """Delete a checkpoint (a directory, or every object under a gs:// prefix and the one at its name,
    a sharded checkpoint's commit record)."""
    if not where.startswith("gs://"):
        shutil.rmtree(where, ignore_errors=True)
        return
    from google.cloud import storage

    from dataflux_ckpt.gcs import make_client

    bucket, _, prefix = where.removeprefix("gs://").partition("/")
    client: storage.Client = make_client()
    for blob in client.list_blobs(bucket, prefix=prefix):
        if blob.name == prefix or blob.name.startswith(prefix + "/"):
            blob.delete()


# The parent ---------------------------------------------------------------------------------------
def run_world(world: int, args: argparse.Namespace, rows: list[str], endpoint: str | None,
              gcs_root: str, local_root: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from lightning_storage_plugins.services import die_with_parent

    # The ranks' and their peers' gloo groups meet at stores served here, on ports bound now: a port
    # picked for rank 0 to bind could be taken by another process while the ranks import torch.
    store, peer_store = (dist.TCPStore(RENDEZVOUS_HOST, 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)) for _ in range(2))
    workdir = Path(tempfile.mkdtemp(prefix="dcp-bench-"))
    spec = {"world": world, "rows": rows, "size_mb": args.size_mb, "tensors": args.tensors, "repeat": args.repeat,
            "port": store.port, "peer_port": peer_store.port, "endpoint": endpoint, "gcs_root": gcs_root,
            "local_root": local_root, "peer_path": args.peer_path or "", "project": args.project,
            "results": [str(workdir / f"rank{rank}.json") for rank in range(world)]}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.distributed_ckpt", "--rank-worker",
                               json.dumps(spec), str(rank)], env=env, preexec_fn=die_with_parent)
             for rank in range(world)]
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(codes):
        raise SystemExit(f"a rank of the {world}-rank run failed (exit codes {codes})")
    results = [json.loads(Path(path).read_text()) for path in spec["results"]]
    shutil.rmtree(workdir, ignore_errors=True)
    return summarize(world, rows, args, results)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def summarize(world: int, keys: list[str], args: argparse.Namespace, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    summary = []
    rows_per_rank = max(1, args.size_mb * MiB // world // args.tensors // 4096)
    size_mib = rows_per_rank * 4096 * args.tensors * world / MiB
    for key in keys:
        row = ROWS[key]
        entry: dict[str, Any] = {"row": key, "name": row.name, "storage": row.storage, "ranks": world,
                                 "size_mib": size_mib, "verified": None if row.protocol else
                                 all(r["verified"].get(key) for r in results)}
        for op in ("save", "load"):
            totals = [max(r["rows"][key][op][i]["total_seconds"] for r in results) for i in range(args.repeat)]
            per_rank = [statistics.median(m["seconds"] for m in r["rows"][key][op]) for r in results]
            entry[f"{op}_s"] = statistics.median(totals)
            entry[f"{op}_spread_s"] = _spread(totals)
            entry[f"{op}_mibps"] = size_mib / entry[f"{op}_s"]
            entry[f"{op}_per_rank_s"] = per_rank
            entry[f"{op}_all_s"] = totals
            entry[f"{op}_extra_rss_mib"] = max(m["extra_rss_mb"] for r in results for m in r["rows"][key][op])
        if results[0].get("peer_versions") and row.peer:
            entry["versions"] = results[0]["peer_versions"]
        summary.append(entry)
    by_key = {entry["row"]: entry for entry in summary}
    protocol = by_key.get("dcp_protocol")
    for entry in summary:
        row = ROWS[entry["row"]]
        ceiling = None if row.protocol else next(
            (e for e in summary if ROWS[e["row"]].ceiling and ROWS[e["row"]].storage == row.storage), None)
        peer = by_key.get("peer") if row.storage == "gcs" else None
        base = by_key.get(row.baseline) if row.baseline else None
        for op in ("save", "load"):
            entry[f"{op}_vs_baseline"] = base[f"{op}_s"] / entry[f"{op}_s"] if base else None
            entry[f"{op}_vs_peer"] = peer[f"{op}_s"] / entry[f"{op}_s"] if peer and not row.peer else None
            entry[f"{op}_vs_ceiling"] = ceiling[f"{op}_s"] / entry[f"{op}_s"] if ceiling else None
            path_ceiling = by_key.get(row.path_ceiling) if row.path_ceiling else None
            entry[f"{op}_vs_path_ceiling"] = path_ceiling[f"{op}_s"] / entry[f"{op}_s"] if path_ceiling else None
            entry[f"{op}_vs_ceiling_dcp"] = ((ceiling[f"{op}_s"] + protocol[f"{op}_s"]) / entry[f"{op}_s"]
                                             if ceiling and protocol and not (row.ceiling or row.protocol) else None)
    return summary


COLUMNS = {
    "ranks": "ranks", "name": "row", "save_s": "save s", "save_spread_s": "save range", "save_mibps": "save MiB/s",
    "load_s": "load s", "load_spread_s": "load range", "load_mibps": "load MiB/s",
    "save_vs_baseline": "save x base", "load_vs_baseline": "load x base", "save_vs_peer": "save x peer",
    "load_vs_peer": "load x peer", "save_vs_ceiling": "save x ceil", "load_vs_ceiling": "load x ceil",
    "save_vs_path_ceiling": "save x path ceil", "load_vs_path_ceiling": "load x path ceil",
    "save_vs_ceiling_dcp": "save x (ceil+DCP)", "load_vs_ceiling_dcp": "load x (ceil+DCP)",
    "save_extra_rss_mib": "save +RSS MiB/rank", "load_extra_rss_mib": "load +RSS MiB/rank", "verified": "ok",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed_ckpt",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes to run")
    parser.add_argument("--size_mb", type=int, default=1024, help="MiB of state in total (split over the ranks)")
    parser.add_argument("--tensors", type=int, default=16, help="tensors in the state")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (every row once per round)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="rows to run")
    parser.add_argument("--folder", default=None, help="directory for the local rows (default: a temporary one)")
    parser.add_argument("--gcs-root", default=None,
                        help="gs://bucket/prefix on real GCS (default: a local fake-gcs-server behind the XML server)")
    parser.add_argument("--project", default=None, help="GCS project (real GCS)")
    parser.add_argument("--peer-path", default=default_peer_path(),
                        help="directory holding gcs-torch-dataflux 1.4.0 and its google-cloud-storage 2.x "
                             "(default: $DATAFLUX_PEER_PATH, else .tools/gcs-torch-dataflux after `make setup`)")
    parser.add_argument("--json", default=None, help="write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if "peer" in args.rows and not args.peer_path:
        log.warning("no --peer-path: skipping the gcs-torch-dataflux rows (%s)", PEER_INSTALL_HINT)
        args.rows = [row for row in args.rows if row != "peer"]
    return args


def _not_the_emulators_missing_move_api(record: logging.LogRecord) -> bool:
    """fake-gcs-server does not serve GCS's moveTo API; gcsfs then logs the refusal (400, "Metadata in
    the request couldn't decode") with its traceback and falls back to copy + delete, as it does on
    buckets without the API. Only those records are dropped; every other gcsfs record still shows."""
    message = record.getMessage()
    return not ("moveTo" in message or "Metadata in the request couldn't decode" in message)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from benchmarks.report import configure_logging, format_table, write_json

    if argv and argv[0] in ("--rank-worker", "--peer-worker"):
        configure_logging(logging.WARNING)
        logging.getLogger("gcsfs").addFilter(_not_the_emulators_missing_move_api)
        worker = rank_worker if argv[0] == "--rank-worker" else peer_worker
        return worker(json.loads(argv[1]), int(argv[2]))

    configure_logging()
    args = parse_args(argv)
    summary: list[dict[str, Any]] = []
    with ExitStack() as stack:
        local_root = args.folder or stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-bench-local-"))
        local_root = os.path.join(local_root, f"run-{uuid.uuid4().hex[:6]}")
        os.makedirs(local_root, exist_ok=True)
        endpoint = None
        gcs_root = args.gcs_root
        if gcs_root is None and any(ROWS[key].storage == "gcs" for key in args.rows):
            from dataflux_ckpt.testing import FakeGcsServer, XmlMultipartServer

            # The in-memory backend: the filesystem one stores each object as a file named by the
            # object, so it cannot hold a sharded checkpoint's commit record (an object at the
            # checkpoint's own name) beside the objects under that name (HTTP 500, "file exists").
            emulator = stack.enter_context(FakeGcsServer())
            server = stack.enter_context(XmlMultipartServer(emulator))
            stack.enter_context(server.activated())
            server.create_bucket("dcp-bench")
            endpoint, gcs_root = server.url, "gs://dcp-bench/run"
        for world in args.ranks:
            log.info("%d rank(s), %d MiB in %d tensors, %d rounds of %s", world, args.size_mb, args.tensors,
                     args.repeat, ", ".join(args.rows))
            rows = run_world(world, args, args.rows, endpoint, gcs_root or "", local_root)
            summary += rows
            print(format_table(rows, COLUMNS), flush=True)
        shutil.rmtree(local_root, ignore_errors=True)
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
