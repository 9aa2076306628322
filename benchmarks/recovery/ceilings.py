"""Raw reads of a stored checkpoint at the machine's speed: the load part of a restart's ceiling.

Each reads the bytes a load of the checkpoint must read, and nothing else (no deserialization, no
integrity check), into memory allocated for them, as a load must return memory of its own:

* a local file or directory (a sharded checkpoint): every file read with ``O_DIRECT``, 16 MiB per call
  on 4 threads;
* ``gs://``: every object (the checkpoint, or each object under a sharded checkpoint's prefix, not its
  commit record at the prefix's own name) fetched with parallel ranged GETs
  (:class:`benchmarks.raw_gcs.RawGcs`, the plugin's part size and connection count), as
  ``benchmarks.lightning_ckpt``'s download ceiling;
* ``redis://``: the checkpoint's value and its chunks with plain redis-py ``GET`` s in one pipeline.

A sharded (DCP) checkpoint's load costs more than its bytes: DCP plans it, runs its collectives and
resolves every item into the model's and optimizers' state, whatever the storage.
:func:`dcp_load_seconds` measures that part, as ``benchmarks.distributed_ckpt`` measures DCP's own
cost: the loads a sharded strategy makes, through a storage reader that serves the checkpoint's
metadata and reads no byte. The job times it in its last start, warm (so it is a lower bound of a
restart's), and a sharded row's ceiling adds it to the raw read.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RAW_CHUNK_BYTES = 16 << 20
RAW_THREADS = 4
_ALIGNMENT = 4096


def read_local(path: str) -> int:
    """Read every file of ``path`` (a file, or a directory's files) with ``O_DIRECT`` into new memory;
    returns the bytes read."""
    files = [Path(path)] if os.path.isfile(path) else sorted(p for p in Path(path).rglob("*") if p.is_file())
    return sum(_read_file(file) for file in files)


def _read_file(path: Path) -> int:
    size = path.stat().st_size
    if size == 0:
        return 0
    buffer = mmap.mmap(-1, -(-size // _ALIGNMENT) * _ALIGNMENT)  # page-aligned, as O_DIRECT needs
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        def read(offset: int) -> int:
            piece = view[offset : offset + RAW_CHUNK_BYTES]
            done = 0
            while done < piece.nbytes:
                moved = os.preadv(fd, [piece[done:]], offset + done)
                if moved <= 0:  # end of file: the buffer's tail past it stays unread
                    break
                done += moved
            return done

        with ThreadPoolExecutor(RAW_THREADS) as pool:
            got = sum(pool.map(read, range(0, view.nbytes, RAW_CHUNK_BYTES)))
    finally:
        os.close(fd)
        view.release()
        buffer.close()
    if got != size:
        raise OSError(f"raw O_DIRECT read of {path}: {got} bytes of {size}")
    return got


class GcsReader:
    """The object ``url`` (``gs://bucket/name``), or every object under it as a prefix, listed once
    (untimed), and fetched raw with parallel ranged GETs from ``endpoint`` by :meth:`read`."""

    def __init__(self, url: str, endpoint: str, *, part_bytes: int, workers: int) -> None:
        from google.cloud import storage

        from benchmarks.raw_gcs import RawGcs

        bucket, _, name = url.removeprefix("gs://").partition("/")
        client = storage.Client()
        # A sharded checkpoint is its prefix's objects (the object at its own name is its commit record).
        objects = [(b.name, b.size) for b in client.list_blobs(bucket, prefix=name.rstrip("/") + "/")]
        if not objects:
            blob = client.bucket(bucket).get_blob(name)
            objects = [(name, blob.size)] if blob is not None else []
        if not objects:
            raise FileNotFoundError(f"no object at or under {url}")
        self.bucket, self.objects = bucket, objects
        self._raw = RawGcs(endpoint, workers=workers, part_bytes=part_bytes)

    def read(self) -> int:
        """Fetch every object into new memory; returns the bytes read."""
        total = 0
        for name, size in self.objects:
            self._raw.download(self.bucket, name, size).close()
            total += size
        return total

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> GcsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_redis(key: str, address: str) -> int:
    """``GET`` the checkpoint value at ``key`` and, when it is chunked, its chunks in one pipeline;
    returns the payload bytes read."""
    import redis

    from smartredis_io._client import wire

    host, port = address.rsplit(":", 1)
    with redis.Redis(host=host, port=int(port)) as db:
        first = db.get(key)
        if first is None:
            raise FileNotFoundError(f"no value at key {key!r} in the database at {address}")
        header = wire.decode_header(memoryview(first), key)
        if not header.chunks:
            return len(first) - header.size
        pipe = db.pipeline(transaction=False)
        for chunk in header.chunk_keys(key):
            pipe.get(chunk)
        return sum(len(value) for value in pipe.execute() if value is not None)


def dcp_load_seconds(strategy: Any, checkpoint: str) -> float:
    """Seconds DCP itself takes to load the sharded checkpoint ``checkpoint`` into ``strategy``'s model
    and optimizers (a Lightning ``FSDPStrategy`` with sharded state dicts, or a ``ModelParallelStrategy``,
    the plugins' or Lightning's own), with no byte read: the model's state, then each optimizer's, as
    the sharded strategies load them, each through a reader that serves the checkpoint's metadata
    (read once, untimed) and hands every tensor back to the planner as it is. Nothing is applied to the
    model or the optimizers."""
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.strategies import FSDPStrategy

    from benchmarks.distributed_ckpt import null_storage

    if hasattr(strategy, "storage_reader"):  # the plugins' strategies
        metadata = strategy.storage_reader(checkpoint).read_metadata()
    else:
        metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    _, null_reader = null_storage()
    reader = null_reader(metadata=metadata)
    model, optimizers = strategy.model, strategy.optimizers
    started = time.perf_counter()
    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp.load(state, storage_reader=reader)
            for index in range(len(optimizers)):
                load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key=f"optimizer_{index}",
                                                  storage_reader=reader)
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.load({"state_dict": get_model_state_dict(model)}, storage_reader=reader)
        for index, optimizer in enumerate(optimizers):
            dcp.load({f"optimizer_{index}": get_optimizer_state_dict(model, optimizer)}, storage_reader=reader)
    return time.perf_counter() - started
