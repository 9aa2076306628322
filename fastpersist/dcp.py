"""``torch.distributed.checkpoint`` storage on NVMe: torch's directory layout, FastPersist's I/O.

    dcp.save(state_dict, storage_writer=FastPersistStorageWriter("/mnt/nvme0/run/step-100"))
    dcp.load(state_dict, storage_reader=FastPersistStorageReader("/mnt/nvme0/run/step-100"))

The checkpoint is what torch's ``FileSystemWriter`` writes: one file per rank whose items are
``torch.save`` blobs (pickled items raw) and a pickled ``.metadata``, so torch's ``FileSystemReader``
loads it, and :class:`FastPersistStorageReader` loads checkpoints torch wrote. What differs is the I/O:
each rank's file is streamed through the two halves of a page-locked staging buffer, each full half
going out as one large aligned O_DIRECT write through a FastPersist engine (DeepSpeed aio by default)
that checks the bytes every write put down; the file is fsynced and renamed into place. Loads read each
file in windows with parallel aligned O_DIRECT reads, the next window in flight while this one's tensors
(built on the bytes read, no copy) are copied into their targets.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

import torch
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

from fastpersist import _torch_compat
from fastpersist.buffers import DoubleBuffer
from fastpersist.context import DEFAULT_BUFFER_MB, FastPersistContext
from fastpersist.engines import OpenFile, Transfer, io_error, open_file
from fastpersist.memory import huge_page_empty, round_down, round_up
from fastpersist.writer import _fsync_dir, save_file, write_archive
from lightning_storage_plugins.dcp import ShardedStorageReader, ShardedStorageWriter, StorageInfo, narrow
from lightning_storage_plugins.memoryfile import MemoryFile

log = logging.getLogger(__name__)

__all__ = ["FastPersistStorageReader", "FastPersistStorageWriter"]

READ_WINDOW_BYTES = 64 * 2**20


def _directory(checkpoint_id: str | os.PathLike[str]) -> str:
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or "://" in text:
        raise ValueError(f"not a local directory: {checkpoint_id!r}")
    return os.path.abspath(text)


class _DirectoryCheckpoint:
    """What the writer and the reader share: a checkpoint is the files of one local directory."""

    checkpoint_id: str

    @staticmethod
    def _normalize(checkpoint_id: str | os.PathLike[str]) -> str:
        return _directory(checkpoint_id)

    def _file(self, name: str) -> str:
        return os.path.join(self.checkpoint_id, name)

    def _read(self, name: str) -> bytes | None:
        try:
            with open(self._file(name), "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            return None


def _tensor_to_save(tensor: torch.Tensor) -> torch.Tensor:
    """What ``FileSystemWriter`` stores for a tensor: itself, copied when it is a view of a larger
    storage (``torch.save`` would store the whole storage). A GPU tensor stays there: the staging
    buffer receives its bytes straight from the device."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


class FastPersistStorageWriter(_DirectoryCheckpoint, ShardedStorageWriter):
    """A DCP ``StorageWriter`` that writes torch's checkpoint layout through FastPersist's engines.

    Args:
        path: the checkpoint directory (created if missing).
        context: the aio handle, staging buffer and lock to use, kept across saves (pass one when
            saving repeatedly); without one, each save creates and frees its own.
        engine: ``"aio"`` (default), ``"python"`` or ``"gds"``; an unavailable one falls back with a warning.
        io_buffer_mb: size of the staging buffer of a context this writer creates.
        overwrite: ``False`` refuses to save where a checkpoint exists.
        cache_staged_state_dict: as for torch's ``FileSystemWriter`` (``dcp.async_save``).

    Raises:
        ValueError: ``path`` is not a local path.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        context: FastPersistContext | None = None,
        engine: str | None = None,
        io_buffer_mb: float = DEFAULT_BUFFER_MB,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
    ) -> None:
        super().__init__(path, overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)
        self.context, self.engine, self.io_buffer_mb = context, engine, io_buffer_mb

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "context": None}  # handles and pinned memory stay in their process

    def _prepare(self) -> None:
        os.makedirs(self.checkpoint_id, exist_ok=True)

    def _write_shard(self, name: str, items: Sequence[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        results: list[WriteResult] = []
        ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)  # as torch orders them

        def content(stage: DoubleBuffer) -> int:
            storages = 0
            for item in ordered:
                start = stage.position
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stage.put(bytes(data.getbuffer()))
                else:  # the archive torch.save would write for the tensor, offsets relative to its start
                    storages += write_archive(_tensor_to_save(data), stage.put,
                                              lambda base=start: stage.position - base)
                length = stage.position - start
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=StorageInfo(name, start, length)))
            return storages

        context = self.context or FastPersistContext(engine=self.engine, io_buffer_mb=self.io_buffer_mb)
        try:
            save_file(self._file(name), content, engine=self.engine, context=context)
        finally:
            if self.context is None:
                context.close()
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


class FastPersistStorageReader(_DirectoryCheckpoint, ShardedStorageReader):
    """A DCP ``StorageReader`` for checkpoint directories written by :class:`FastPersistStorageWriter`
    or torch's ``FileSystemWriter``, reading each file with parallel aligned O_DIRECT reads.

    Args:
        path: the checkpoint directory.
        context: whose reading threads to use (default: a context made and closed for each load).
        weights_only: see :class:`~lightning_storage_plugins.dcp.ShardedStorageReader`.

    Raises:
        ValueError: ``path`` is not a local path.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, context: FastPersistContext | None = None,
                 weights_only: bool | None = None) -> None:
        super().__init__(path, weights_only=weights_only)
        self.context = context

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "context": None}

    def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        context = self.context or FastPersistContext()
        try:
            for name, items in per_file.items():
                self._read_file(name, items, context, planner)
        finally:
            if self.context is None:
                context.close()

    def _read_file(self, name: str, items: list[ReadItem], context: FastPersistContext, planner: LoadPlanner) -> None:
        """Read the items of one file in windows of about ``READ_WINDOW_BYTES``: the next window's reads
        are in flight while the items of this one are copied into their targets."""
        pairs = sorted(((item, self.storage_data[item.storage_index]) for item in items), key=lambda p: p[1].offset)
        windows: list[list[tuple[ReadItem, Any]]] = [[]]
        for pair in pairs:
            window = windows[-1]
            if window and pair[1].offset + pair[1].length - window[0][1].offset > READ_WINDOW_BYTES:
                windows.append([])
            windows[-1].append(pair)
        path = self._file(name)
        with context.lock:
            file = open_file(path, write=False)
            try:
                reads = [_RangeRead(file, windows[0], context)]
                for index, window in enumerate(windows):
                    read = reads.pop()
                    if index + 1 < len(windows):
                        reads.append(_RangeRead(file, windows[index + 1], context))
                    data = read.result()
                    view = memoryview(data.numpy())
                    for item, info in window:
                        first = info.offset - read.start
                        offset = data.storage_offset() + first
                        storage = data.untyped_storage()[offset : offset + info.length]
                        self._use(item, view[first : first + info.length], storage, name, planner)
            finally:
                for read in reads:
                    read.abandon()
                file.close()

    def _use(self, item: ReadItem, data: memoryview, storage: torch.UntypedStorage, name: str,
             planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            self.check_bytes(data, item.storage_index)
            planner.load_bytes(item, io.BytesIO(data))
            return
        loaded = _load_tensor(data, storage, f"{self.checkpoint_id}/{name}")
        stored = narrow(loaded, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != stored.size():
            raise ValueError(f"{self.checkpoint_id}/{name}: item {item.storage_index.fqn} holds "
                             f"{tuple(stored.size())}, the target is {tuple(target.size())}")
        target.copy_(stored)
        planner.commit_tensor(item, target)


def _load_tensor(data: memoryview, storage: torch.UntypedStorage, where: str) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``data``, its storage a view of ``storage`` (the same bytes):
    no copy. Unpickled with ``weights_only=True``, as torch's FileSystemReader does."""
    reader = torch._C.PyTorchFileReader(MemoryFile(data))
    tensor = _torch_compat.unpickle(reader, "cpu", True, where, overall_storage=storage)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: a tensor item holds a {type(tensor).__name__}")
    return tensor


class _RangeRead:
    """Bytes ``[start, end)`` of a file (the span of ``window``'s items) on their way into one page-aligned
    allocation: the aligned part with parallel O_DIRECT reads (started here), the unaligned end with a
    buffered read (in :meth:`result`)."""

    def __init__(self, file: OpenFile, window: list[tuple[ReadItem, Any]], context: FastPersistContext) -> None:
        self.file = file
        self.start = window[0][1].offset
        self.end = max(info.offset + info.length for _, info in window)
        size = file.size()
        if self.end > size:
            raise io_error(errno.EIO, "read", file, size, f"file is {size} bytes, the checkpoint needs {self.end}")
        self.first = round_down(self.start)
        aligned_size = round_down(size)
        self.direct_end = max(self.first, min(round_up(self.end), aligned_size)) if file.direct else self.first
        self.whole = huge_page_empty(max(self.end, self.direct_end) - self.first)
        self.engine = None
        if self.direct_end > self.first:
            self.engine = context.python_engine()
            span = self.whole.narrow(0, 0, self.direct_end - self.first)
            self.engine.submit(Transfer(file, span, self.first, write=False))

    def result(self) -> torch.Tensor:
        """The bytes, once every read has completed (and its byte count was checked)."""
        if self.engine is not None:
            self.engine.wait()
            self.engine = None
        tail = max(self.direct_end, self.first)
        if self.end > tail:
            with open(self.file.path, "rb", buffering=0) as plain:
                target = memoryview(self.whole.narrow(0, tail - self.first, self.end - tail).numpy())
                got = os.preadv(plain.fileno(), [target], tail)
            if got != self.end - tail:
                raise io_error(errno.EIO, "read", self.file, tail + got, f"short read of {self.file.path}")
        return self.whole.narrow(0, self.start - self.first, self.end - self.start)

    def abandon(self) -> None:
        """Wait for reads still in flight (their buffer must outlive them); errors are not reported."""
        if self.engine is not None:
            try:
                self.engine.wait()
            except OSError:
                pass
