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

A sharded (DCP) checkpoint's load costs more than its bytes, whatever the storage: DCP plans it, runs
its collectives and resolves every item, and the strategy puts the state into the model and the
optimizers (Lightning's FSDP strategy flattens each optimizer's state with collectives per parameter).
:func:`sharded_load_seconds` measures that part: Lightning's own strategy loading the same state from
``/dev/shm``, where every read is a copy from memory. The job times it in its last start, and a
sharded row's ceiling adds the fastest timing to the raw read. It is about what a restart's own load
costs, not a strict lower bound: a process that has trained loads no faster than a fresh one.
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


def sharded_load_seconds(strategy: Any, checkpoint: dict[str, Any]) -> float:
    """Seconds Lightning's own sharded strategy takes to load ``checkpoint`` (a checkpoint dict of the
    job's current state, as the strategy's ``save_checkpoint`` receives it) when its bytes are in memory.

    ``strategy`` is a Lightning ``FSDPStrategy`` with sharded state dicts or a ``ModelParallelStrategy``
    (the plugins' subclasses or Lightning's own). The checkpoint is saved (untimed) by Lightning's own
    class of that strategy, DCP's ``FileSystemWriter``, into ``/dev/shm``, a file system in memory; then
    that class's ``load_checkpoint`` is timed. It is the whole sharded load but the storage: DCP plans
    the load, runs its collectives and resolves every item, each read is a copy from memory, and the
    strategy puts the state into the model and the optimizers (FSDP flattens each optimizer's state
    with collectives per parameter). The loaded state is the model's own, so training is unchanged.
    Collective: every rank calls it. The temporary copy is removed.
    """
    import shutil
    import tempfile

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    base = next(cls for cls in type(strategy).__mro__ if cls in (FSDPStrategy, ModelParallelStrategy))
    made = tempfile.mkdtemp(prefix="recovery-ceiling-", dir="/dev/shm") if strategy.global_rank == 0 else None
    path = strategy.broadcast(made)
    try:
        base.save_checkpoint(strategy, dict(checkpoint), path)  # it pops the states from the dict it is given
        strategy.barrier("sharded-load-ceiling-saved")
        started = time.perf_counter()
        base.load_checkpoint(strategy, path)
        elapsed = time.perf_counter() - started
        strategy.barrier("sharded-load-ceiling-loaded")
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    return elapsed
