"""``torch.distributed.checkpoint`` storage on NVMe: torch's directory layout, FastPersist's I/O.

    dcp.save(state_dict, storage_writer=FastPersistStorageWriter("/mnt/nvme0/run/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistStorageReader("/mnt/nvme0/run/step-100"))

The checkpoint is what torch's ``FileSystemWriter`` writes: one file per rank whose items are
``torch.save`` blobs (pickled items raw) and a pickled ``.metadata``, so torch's ``FileSystemReader``
loads it, and :class:`FastPersistStorageReader` loads checkpoints torch wrote. What differs is the I/O:
each rank's file is streamed through the two halves of a page-locked staging buffer, each full half
going out as one large aligned O_DIRECT write through a FastPersist engine (DeepSpeed aio by default)
that checks the bytes every write put down; the file is fsynced and renamed into place. Loads read each
file with parallel aligned O_DIRECT reads into one page-aligned allocation.
"""

from __future__ import annotations

import errno
import io
import logging
import math
import os
import shutil
import threading
import uuid
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from fastpersist.buffers import split_halves
from fastpersist.engines import (
    IOEngine,
    OpenFile,
    PythonEngine,
    Transfer,
    create_engine,
    engine_for,
    io_error,
    open_file,
    preallocate,
)
from fastpersist.handles import (
    ALIGNMENT_BYTES,
    DEFAULT_BUFFER_MB,
    exclusive,
    get_default_pinned_buffer,
    get_pinned_buffer,
    huge_page_empty,
    release_pinned_buffer,
)
from fastpersist.reader import _unpickle
from lightning_storage_plugins.dcp import ShardedStorageReader, ShardedStorageWriter, StorageInfo

log = logging.getLogger(__name__)

__all__ = ["FastPersistStorageReader", "FastPersistStorageWriter"]

TEMP_SUFFIX = ".fastpersist.tmp"


def _directory(checkpoint_id: str | os.PathLike[str]) -> str:
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or "://" in text:
        raise ValueError(f"not a local directory: {checkpoint_id!r}")
    return os.path.abspath(text)


def _round_up(value: int) -> int:
    return -(-value // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Staging:
    """The staging buffer (allocated on first use, owned by its writer or reader) and the engine name."""

    def __init__(self, io_buffer_mb: int, engine: str | None, aio_handle: Any, pinned_buffer: torch.Tensor | None) -> None:
        if io_buffer_mb <= 0:
            raise ValueError(f"io_buffer_mb must be positive, not {io_buffer_mb}")
        self.io_buffer_mb, self.engine, self.aio_handle = io_buffer_mb, engine, aio_handle
        self._buffer, self._owned = pinned_buffer, False
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_buffer": None, "_owned": False, "_lock": None, "aio_handle": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def buffer(self) -> torch.Tensor:
        with self._lock:
            if self._buffer is None:
                if self.io_buffer_mb == DEFAULT_BUFFER_MB and self.aio_handle is None:
                    return get_default_pinned_buffer()  # as fastpersist_save: one per process
                self._buffer = get_pinned_buffer(self.io_buffer_mb, self.aio_handle)
                self._owned = True
            return self._buffer

    def release(self) -> None:
        with self._lock:
            if self._owned and self._buffer is not None:
                release_pinned_buffer(self._buffer, self.aio_handle)
            self._buffer, self._owned = None, False


class _ShardFile(io.RawIOBase):
    """A write-only file-like that ``torch.save`` writes into: its bytes are staged in the two halves of
    ``buffer``, and each full half goes out as one aligned write at the next offset while the other
    fills. :meth:`publish` pads the tail, waits, truncates, fsyncs and renames the temporary into place;
    :meth:`discard` removes it. Nothing appears under ``path`` unless complete."""

    def __init__(self, path: str, io_engine: IOEngine, buffer: torch.Tensor, expected_size: int) -> None:
        super().__init__()
        self.path = path
        directory, name = os.path.split(path)
        self._temp = os.path.join(directory, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
        self._halves = split_halves(buffer)
        self._file: OpenFile = open_file(self._temp, write=True)
        self._file.label = f"{path} (temporary {os.path.basename(self._temp)})"
        try:
            # Aligned O_DIRECT writes inside reserved blocks run in parallel (appends are serialized).
            preallocate(self._file, _round_up(expected_size))
        except BaseException:
            self.discard()
            raise
        self._engine = engine_for(io_engine, self._halves[0], self._file)
        self._views = [memoryview(half.numpy()) for half in self._halves]
        self._index = 0
        self._fill = 0
        self._offset = 0  # file offset of the current half
        self._size = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        capacity = self._views[0].nbytes
        done = 0
        while done < view.nbytes:
            take = min(capacity - self._fill, view.nbytes - done)
            self._views[self._index][self._fill : self._fill + take] = view[done : done + take]
            self._fill += take
            done += take
            if self._fill == capacity:
                self._drain(capacity)
        self._size += view.nbytes
        return view.nbytes

    def _drain(self, nbytes: int) -> None:
        self._engine.wait()  # the other half's write is done: it may be refilled after this submit
        half = self._halves[self._index].narrow(0, 0, nbytes)
        self._engine.submit(Transfer(self._file, half, self._offset, write=True))
        self._offset += nbytes
        self._index ^= 1
        self._fill = 0

    def publish(self) -> None:
        if self._fill:
            padded = _round_up(self._fill) if self._file.direct else self._fill
            self._halves[self._index].narrow(0, self._fill, padded - self._fill).zero_()
            self._drain(padded)
        self._engine.wait()
        if self._file.size() != self._size:
            os.ftruncate(self._file.fd, self._size)  # the tail's alignment padding
        if self._file.size() != self._size:
            raise io_error(errno.EIO, "write", self._file, self._file.size(),
                           f"file is {self._file.size()} bytes, expected {self._size}")
        os.fsync(self._file.fd)
        self._file.close()
        os.replace(self._temp, self.path)
        _fsync_dir(os.path.dirname(self.path))

    def discard(self) -> None:
        engine = getattr(self, "_engine", None)
        try:
            if engine is not None:
                engine.wait()
        except OSError:
            pass  # the write that failed is being reported already
        self._file.close()
        try:
            os.unlink(self._temp)
        except FileNotFoundError:
            pass


ITEM_OVERHEAD_BYTES = 64 * 1024  # zip records, pickle and padding of one torch.save'd tensor, at most


def _planned_bytes(item: WriteItem) -> int:
    """About how many bytes ``item`` takes in the file (reserved ahead; the file is cut to size after)."""
    data = item.tensor_data
    if data is None:
        return ITEM_OVERHEAD_BYTES
    return math.prod(data.size) * torch.empty((), dtype=data.properties.dtype).element_size() + ITEM_OVERHEAD_BYTES


def _tensor_to_save(tensor: torch.Tensor) -> torch.Tensor:
    """What ``FileSystemWriter`` stores for a tensor: itself on CPU, copied when it is a view of a
    larger storage (``torch.save`` would store the whole storage)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class FastPersistStorageWriter(ShardedStorageWriter):
    """A DCP ``StorageWriter`` that writes torch's checkpoint layout through FastPersist's engines.

    Args:
        path: the checkpoint directory (created if missing).
        io_buffer_mb: size of the page-locked staging buffer, allocated on first save (two halves).
        engine: ``"aio"`` (default), ``"python"`` or ``"gds"``; an unavailable one falls back with a warning.
        aio_handle: a DeepSpeed aio handle to use (default: the shared one).
        pinned_buffer: staging memory to use instead of allocating one.
        overwrite: ``False`` refuses to save where a checkpoint exists.
        cache_staged_state_dict: as for torch's ``FileSystemWriter`` (``dcp.async_save``).

    Raises:
        ValueError: ``path`` is not a local path, or ``io_buffer_mb`` is not positive.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        io_buffer_mb: int = DEFAULT_BUFFER_MB,
        engine: str | None = None,
        aio_handle: Any = None,
        pinned_buffer: torch.Tensor | None = None,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
    ) -> None:
        super().__init__(path, overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)
        self._staging = _Staging(io_buffer_mb, engine, aio_handle, pinned_buffer)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path (not a URL)."""
        try:
            _directory(checkpoint_id)
        except ValueError:
            return False
        return True

    def _normalize(self, checkpoint_id: str | os.PathLike[str]) -> str:
        return _directory(checkpoint_id)

    def _file(self, name: str) -> str:
        return os.path.join(self.checkpoint_id, name)

    def _prepare(self) -> None:
        os.makedirs(self.checkpoint_id, exist_ok=True)

    def _write_shard(self, name: str, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        buffer = self._staging.buffer()
        io_engine = create_engine(self._staging.engine, self._staging.aio_handle)
        results: list[WriteResult] = []
        ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)  # as torch orders them
        with exclusive(("buffer", buffer.data_ptr())), io_engine.session():
            expected = sum(_planned_bytes(item) for item in ordered)
            stream = _ShardFile(self._file(name), io_engine, buffer, expected)
            try:
                for item in ordered:
                    offset = stream.tell()
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        torch.save(_tensor_to_save(data), cast(Any, stream))
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=StorageInfo(name, offset, length)))
                stream.publish()
            except BaseException:
                stream.discard()
                raise
        return results

    def _publish(self, name: str, data: bytes) -> None:
        path = self._file(name)
        temp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        _fsync_dir(self.checkpoint_id)

    def _read(self, name: str) -> bytes | None:
        try:
            with open(self._file(name), "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def _list(self) -> list[str]:
        try:
            return os.listdir(self.checkpoint_id)
        except FileNotFoundError:
            return []

    def _size(self, name: str) -> int | None:
        try:
            return os.stat(self._file(name)).st_size
        except FileNotFoundError:
            return None

    def _delete(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                os.unlink(self._file(name))
            except FileNotFoundError:
                pass

    def _remove_location(self) -> None:
        shutil.rmtree(self.checkpoint_id, ignore_errors=True)

    def close(self) -> None:
        """Free the staging buffer this writer allocated (the next save allocates another)."""
        self._staging.release()


class _MemoryFile(io.RawIOBase):
    """A seekable read-only file-like over a memoryview (no copy until read)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, target: Any) -> int:  # type: ignore[override]
        out = memoryview(target).cast("B")
        end = min(self._pos + out.nbytes, self._view.nbytes)
        count = max(0, end - self._pos)
        out[:count] = self._view[self._pos : end]
        self._pos += count
        return count


class FastPersistStorageReader(ShardedStorageReader):
    """A DCP ``StorageReader`` for checkpoint directories written by :class:`FastPersistStorageWriter`
    or torch's ``FileSystemWriter``, reading each file with parallel aligned O_DIRECT reads.

    Args:
        path: the checkpoint directory.
        weights_only: see :class:`~lightning_storage_plugins.dcp.ShardedStorageReader`.

    Raises:
        ValueError: ``path`` is not a local path.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, weights_only: bool | None = None) -> None:
        super().__init__(path, weights_only=weights_only)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a local path (not a URL)."""
        return FastPersistStorageWriter.validate_checkpoint_id(checkpoint_id)

    def _normalize(self, checkpoint_id: str | os.PathLike[str]) -> str:
        return _directory(checkpoint_id)

    def _read(self, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.checkpoint_id, name), "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            infos = [self.storage_data[item.storage_index] for item in items]
            start = min(info.offset for info in infos)
            end = max(info.offset + info.length for info in infos)
            data = _read_range(os.path.join(self.checkpoint_id, name), start, end)
            view = memoryview(data.numpy())
            for item, info in sorted(zip(items, infos, strict=True), key=lambda pair: pair[1].offset):
                first = info.offset - start
                storage = data.untyped_storage()[data.storage_offset() + first :
                                                 data.storage_offset() + first + info.length]
                self._use(item, view[first : first + info.length], storage, name, planner)

    def _use(self, item: ReadItem, data: memoryview, storage: torch.UntypedStorage, name: str,
             planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            self.check_bytes(data, item.storage_index)
            planner.load_bytes(item, io.BytesIO(data))
            return
        loaded = _load_tensor(data, storage, f"{self.checkpoint_id}/{name}")
        stored = narrow_tensor_by_index(loaded, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != stored.size():
            raise ValueError(f"{self.checkpoint_id}/{name}: item {item.storage_index.fqn} holds "
                             f"{tuple(stored.size())}, the target is {tuple(target.size())}")
        target.copy_(stored)
        planner.commit_tensor(item, target)


def _load_tensor(data: memoryview, storage: torch.UntypedStorage, where: str) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``data``, its storage a view of ``storage`` (the same bytes):
    no copy. Unpickled with ``weights_only=True``, as torch's FileSystemReader does."""
    reader = torch._C.PyTorchFileReader(_MemoryFile(data))
    tensor = _unpickle(reader, "cpu", True, where, overall_storage=storage)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: a tensor item holds a {type(tensor).__name__}")
    return tensor


def _read_range(path: str, start: int, end: int) -> torch.Tensor:
    """Bytes ``[start, end)`` of ``path``: the aligned part with parallel O_DIRECT reads straight into a
    page-aligned allocation, the unaligned ends with buffered reads."""
    file = open_file(path, write=False)
    try:
        size = file.size()
        if end > size:
            raise io_error(errno.EIO, "read", file, size, f"file is {size} bytes, the checkpoint needs {end}")
        first = start // ALIGNMENT_BYTES * ALIGNMENT_BYTES
        direct_end = min(_round_up(end), size // ALIGNMENT_BYTES * ALIGNMENT_BYTES) if file.direct else first
        whole = huge_page_empty(max(end, direct_end) - first)
        if direct_end > first:
            engine = PythonEngine()
            engine.submit(Transfer(file, whole.narrow(0, 0, direct_end - first), first, write=False))
            engine.wait()
        tail_start = max(direct_end, first)
        if end > tail_start:
            with open(path, "rb", buffering=0) as plain:
                target = memoryview(whole.narrow(0, tail_start - first, end - tail_start).numpy())
                got = os.preadv(plain.fileno(), [target], tail_start)
            if got != end - tail_start:
                raise io_error(errno.EIO, "read", file, tail_start + got, f"short read of {path}")
    finally:
        file.close()
    return whole.narrow(0, start - first, end - start)
