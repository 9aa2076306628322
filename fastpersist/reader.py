"""``fastpersist_load``: read any torch.save file with large aligned reads, unpickling as torch.load.

Two read paths, chosen by engine:

- ``"python"`` (default, *direct*): one page-aligned host allocation the size of the storage span; it
  is read straight in with parallel O_DIRECT ``preadv`` calls, and each storage is a slice of it (as
  with ``torch.load(mmap=True)``). No staging copy: on a small machine the copy out of a pinned buffer
  into freshly faulted memory costs more than the read itself. Records are found from their local
  headers as those land, and unpickling runs while the rest is read; the load returns only once
  every read has completed and every record was checked.
- ``"aio"`` (*staged*): DeepSpeed aio reads into the two halves of the staging buffer (one half is
  read while the other is scattered into separately allocated storages, which can be freed one by one).

A host load takes the direct path unless the call itself asks for ``engine="aio"``: a context's
engine (``FastPersistContext(engine="aio")``, ``FastPersistCheckpointIO(engine="aio")``) is how it
saves, and the direct path reads as fast without page-locking a staging buffer first (in a new
process, locking the default 256 MiB took longer than a 16 MiB load). Loads onto a GPU stage through
host memory with the context's engine (GPUDirect Storage reads straight to the device).

Either way torch's own unpickling rules (``weights_only``, ``map_location``, shared storages, byte
order) then run over those bytes. Files in torch's legacy (pre-zip) format and TorchScript archives
go to ``torch.load``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from fastpersist import _torch_compat
from fastpersist.buffers import split_halves
from fastpersist.context import FastPersistContext
from fastpersist.engines import IOEngine, OpenFile, PythonEngine, Transfer, io_error, open_file
from fastpersist.memory import aligned_empty, round_down, round_up
from lightning_storage_plugins.collector import collector_paused
from lightning_storage_plugins.ziparchive import ZIP_MAGIC, read_directory

log = logging.getLogger(__name__)

PICKLE_PROTOCOL_OPCODE = 0x80  # torch's legacy format is a pickle stream (protocol 2+)
DEFAULT_LOAD_ENGINE = "python"
Record = tuple[int, int, str]  # (file offset, size, record name)


class CheckpointFormatError(ValueError):
    """The file is not a checkpoint this torch can read; the message names the path and the reason."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot load {path}: {reason}")
        self.path = path
        self.reason = reason


def fastpersist_load(
    file_path: str | os.PathLike[str],
    map_location: Any = None,
    weights_only: bool | None = None,
    aio_handle: Any = None,
    pinned_buffer: torch.Tensor | None = None,
    *,
    engine: str | None = None,
    context: FastPersistContext | None = None,
) -> Any:
    """Return what ``torch.load(file_path, map_location, weights_only=weights_only)`` would.

    Args:
        file_path: a file written by ``torch.save`` or ``fastpersist_save``.
        map_location: as for ``torch.load``.
        weights_only: as for ``torch.load``; ``None`` means torch's default (``True`` since torch 2.6,
            overridable with torch's ``TORCH_FORCE_*WEIGHTS_ONLY_LOAD`` environment variables).
        aio_handle: DeepSpeed aio handle for the staged path (ignored when ``context`` is given).
        pinned_buffer: page-locked staging memory for the staged path (ignored when ``context`` is given).
        engine: ``"python"`` (default: direct reads into the tensors' memory) or ``"aio"`` (staged);
            the engine of ``context`` does not choose it (see the module).
        context: handle, buffer and lock to use; without one, this call creates and frees its own.

    Raises:
        FileNotFoundError / IsADirectoryError: ``file_path`` does not exist / is a directory.
        CheckpointFormatError: ``file_path`` is a FIFO, device or socket; or the file is empty,
            truncated, not a torch checkpoint, written by a newer torch, or has a storage record whose
            size is not its tensor's (the message says which).
        OSError: a read failed (path and offset in the message).
        pickle.UnpicklingError: ``weights_only`` refused something in the file.
        ContextInUseError: ``context`` is saving or loading on this thread (this load was asked for
            from a signal handler or a callback that interrupted that).
    """
    with collector_paused():
        return _load(file_path, map_location, weights_only, aio_handle, pinned_buffer, engine, context)


def _load(
    file_path: str | os.PathLike[str],
    map_location: Any,
    weights_only: bool | None,
    aio_handle: Any,
    pinned_buffer: torch.Tensor | None,
    engine: str | None,
    context: FastPersistContext | None,
) -> Any:
    path = os.fspath(file_path)
    _require_regular_file(os.stat(path).st_mode, path)
    weights_only = _torch_compat.resolve_weights_only(weights_only)
    kind = _sniff(path)
    if kind == "legacy":
        log.info("%s is in torch's legacy (pre-zip) format: using torch.load", path)
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    try:
        reader = _torch_compat.open_reader(path)
    except RuntimeError as err:
        raise CheckpointFormatError(path, _torch_compat.describe_reader_error(err)) from None
    if _torch_compat.is_torchscript(reader):
        log.info("%s is a TorchScript archive: using torch.load", path)
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    if "data.pkl" not in reader.get_all_records():
        raise CheckpointFormatError(path, "zip archive without data.pkl (not written by torch.save)")
    try:
        entries, following = _data_directory(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointFormatError(path, f"damaged zip directory ({err})") from None
    owned = context is None and any(size for _, size in entries.values())
    ctx = (
        FastPersistContext(engine=engine, aio_handle=aio_handle, pinned_buffer=pinned_buffer)
        if owned
        else context
    )
    try:
        with ctx.operation(f"loading {path}") if ctx is not None else contextlib.nullcontext():
            read = _start_read(path, entries, following, engine, ctx, _device_of(map_location))
            try:
                table = _torch_compat.StorageTable(reader, read.locate, read.storages, read.whole)
                try:
                    loaded = _torch_compat.unpickle(
                        table, map_location, weights_only, path, data_ready=read.finish
                    )
                except BaseException:
                    read.finish()  # a read error is the one to report, as when reading came first
                    raise
                read.finish()
                return loaded
            finally:
                read.close()
    except _torch_compat.RecordSizeError as err:
        raise CheckpointFormatError(path, str(err)) from None
    finally:
        if owned and ctx is not None:
            ctx.close()


def _data_directory(path: str) -> tuple[dict[str, tuple[int, int]], int]:
    """The ``data/`` records (``name -> (local header offset, size)``) and where the first record
    after the last of them starts (the end of the span that holds them all)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        file_size = os.fstat(fd).st_size
        directory = read_directory(fd, file_size)
    finally:
        os.close(fd)
    entries = _torch_compat.data_entries(directory, file_size)
    last = max((offset for offset, _ in entries.values()), default=-1)
    following = min(
        (entry.header_offset for entry in directory if entry.header_offset > last), default=file_size
    )
    return entries, min(following, file_size)


class _Read:
    """Storage records being read (or already read): where each one's bytes are, once known."""

    storages: dict[str, torch.Tensor] | None = None
    whole: torch.UntypedStorage | None = None

    def __init__(self, path: str, located: dict[str, tuple[int, int]]) -> None:
        self.path = path
        self._located = located

    def locate(self, name: str) -> tuple[int, int] | None:
        """``(file offset, size)`` of record ``name``'s bytes; ``None``: the archive has no such record."""
        return self._located.get(name)

    def finish(self) -> None:
        """Return once every byte has been read and every record checked (else raise why not)."""

    def close(self) -> None:
        """Release the file (and wait for any read still in flight, unchecked)."""


def _device_of(map_location: Any) -> torch.device | None:
    """The CUDA device a ``map_location`` sends every storage to (``"cuda"``, ``"cuda:1"``, a
    ``torch.device``), else ``None`` (host loads, and dicts or functions that decide per storage)."""
    if isinstance(map_location, str) and map_location.startswith("cuda"):
        device = torch.device(map_location)
    elif isinstance(map_location, torch.device):
        device = map_location
    else:
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return None  # torch.load's own path, and its own error where there is no CUDA
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _start_read(
    path: str,
    entries: dict[str, tuple[int, int]],
    following: int,
    engine: str | None,
    ctx: FastPersistContext | None,
    device: torch.device | None = None,
) -> _Read:
    """Start reading every storage record: the direct path returns with the reads in flight."""
    if ctx is None or not any(size for _, size in entries.values()):
        return _Read(path, _located_by_reads(path))  # no bytes to read: only the headers are needed
    if device is not None:
        return _read_to_device(path, device, engine, ctx)
    io_engine = ctx.io_engine(engine or DEFAULT_LOAD_ENGINE, os.path.dirname(os.path.abspath(path)))
    if io_engine.device != "cpu":
        ctx.warn_once(
            f"fastpersist_load reads into host memory: engine {io_engine.name!r} replaced by 'python'"
        )
        io_engine = ctx.python_engine()
    file = open_file(path, write=False)
    if isinstance(io_engine, PythonEngine):
        try:
            return _DirectRead(path, entries, following, io_engine, file)
        except BaseException:
            file.close()
            raise
    try:
        located = _located_by_reads(path)
        records = sorted((offset, size, name) for name, (offset, size) in located.items() if size)
        read = _Read(path, located)
        storages = read.storages = {name: torch.empty(size, dtype=torch.uint8) for _, size, name in records}
        cursor = 0  # first record not yet fully copied

        def scatter(half: torch.Tensor, offset: int, length: int) -> None:
            nonlocal cursor
            cursor = _scatter(records, storages, cursor, half, offset, length)

        _read_staged(_span(records), scatter, io_engine, file, ctx)
    finally:
        file.close()
    return read


def _read_to_device(path: str, device: torch.device, engine: str | None, ctx: FastPersistContext) -> _Read:
    """A load to one GPU: the file is read through the page-locked staging halves, each half copied to
    the device as one span, into one device allocation of which every storage is a view. No host copy
    of the checkpoint is made, and the copies to the device run at the pinned copy rate."""
    located = _located_by_reads(path)
    records = sorted((offset, size, name) for name, (offset, size) in located.items() if size)
    read = _Read(path, located)
    start, end = _span(records)
    # Indexed by file offset, as storages are located; the bytes before the first record are not read.
    whole = torch.empty(end, dtype=torch.uint8, device=device)
    io_engine = ctx.io_engine(engine or ctx.engine or "aio", os.path.dirname(os.path.abspath(path)))
    if io_engine.device != "cpu":
        ctx.warn_once(f"fastpersist_load stages through host memory: engine {io_engine.name!r} replaced by 'aio'")
        io_engine = ctx.io_engine("aio")

    def copy_span(half: torch.Tensor, offset: int, length: int) -> None:
        # Synchronous: the half is read into again two chunks later (a pinned copy of a half takes
        # a few milliseconds, a disk read of it far longer).
        whole.narrow(0, offset, length).copy_(half.narrow(0, 0, length))

    file = open_file(path, write=False)
    try:
        _read_staged((start, end), copy_span, io_engine, file, ctx)
    finally:
        file.close()
    read.whole = whole.untyped_storage()
    return read


def _located_by_reads(path: str) -> dict[str, tuple[int, int]]:
    """Every ``data/`` record's bytes, found by reading its local header (a small read each)."""
    try:
        records = _torch_compat.storage_records(path, include_empty=True)
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointFormatError(path, f"damaged zip directory ({err})") from None
    return {name: (offset, size) for offset, size, name in records}


class _DirectRead(_Read):
    """The span holding every ``data/`` record, read with O_DIRECT into one page-aligned allocation
    (each storage is a slice of it, as with ``torch.load(mmap=True)``).

    Records are located from their local headers inside the span as the reads land, so unpickling
    goes on while the bytes arrive; :meth:`finish` waits for the rest, then checks every record. No
    staging copy: on a small machine the copy out of a pinned buffer into freshly faulted memory
    costs more than the read itself.
    """

    def __init__(
        self,
        path: str,
        entries: dict[str, tuple[int, int]],
        following: int,
        io_engine: PythonEngine,
        file: OpenFile,
    ) -> None:
        super().__init__(path, {})
        self._entries = entries
        self._engine = io_engine
        self._file = file
        self._file_size = file.size()
        self._error: BaseException | None = None
        self._done = False
        start = round_down(min(offset for offset, _ in entries.values()))
        self._end = end = max(following, start)
        direct_end = max(start, _direct_end(file, end))
        # Plain pages, not transparent huge pages: a huge page needs a free 2 MiB block, and on a
        # virtual machine those are the blocks the host has taken back (free page reporting), so every
        # first touch is a host fault; 4 KiB pages come from memory freed recently. Measured with the
        # FastPersist micro-benchmark's 64-tensor load on a 2-core VM: 0.65-0.85 s instead of
        # 1.1-1.25 s for 1 GiB.
        whole = aligned_empty(max(end, direct_end))
        self._view = memoryview(whole.numpy())
        offset = whole.storage_offset()
        self.whole = whole.untyped_storage()[offset : offset + whole.numel()]
        if direct_end > start:
            io_engine.submit(
                Transfer(file, whole.narrow(0, start, direct_end - start), start, write=False, fresh=True)
            )
        try:
            if end > direct_end:
                _read_tail(file, whole.narrow(0, direct_end, end - direct_end), direct_end)
        except BaseException:
            io_engine.abandon()
            raise

    def locate(self, name: str) -> tuple[int, int] | None:
        found = self._located.get(name)
        if found is not None:
            return found
        entry = self._entries.get(name)
        if entry is None:
            return None
        header_offset, size = entry
        self._engine.wait_until(header_offset + _torch_compat.LOCAL_HEADER_BYTES)
        try:
            offset = _torch_compat.data_offset(self._view, header_offset, header_offset, name)
            if offset + size > self._end:
                _torch_compat.check_records([(offset, size, name)], self._file_size)
                raise zipfile.BadZipFile(f"record {name} at offset {offset} overlaps the record after it")
        except zipfile.BadZipFile as err:
            raise CheckpointFormatError(self.path, f"damaged zip directory ({err})") from None
        self._located[name] = found = (offset, size)
        return found

    def finish(self) -> None:
        if self._error is not None:
            raise self._error
        if self._done:
            return
        try:
            self._engine.wait()
            if len(self._located) < len(self._entries):  # records the pickle did not refer to
                for name in self._entries:
                    self.locate(name)
            records = sorted((offset, size, name) for name, (offset, size) in self._located.items())
            try:
                _torch_compat.check_records(records, self._file_size)
            except zipfile.BadZipFile as err:
                raise CheckpointFormatError(self.path, f"damaged zip directory ({err})") from None
        except BaseException as err:
            self._error = err
            raise
        self._done = True

    def close(self) -> None:
        if not self._done:
            self._engine.abandon()
        self._file.close()


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _require_regular_file(mode: int, path: str) -> None:
    """Refuse anything but a regular file before reading it: a FIFO or a device would block the read
    (or never end), and its bytes are not a checkpoint."""
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
        raise CheckpointFormatError(path, f"it is {kind}, not a regular file")


def _sniff(path: str) -> str:
    """``"zip"`` or ``"legacy"``, else :class:`CheckpointFormatError` naming what the file is."""
    # O_NONBLOCK: should the path have become a FIFO since it was checked, opening it must not wait
    # for a writer; fstat then tells what was really opened.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _require_regular_file(os.fstat(fd).st_mode, path)
        head = os.pread(fd, len(ZIP_MAGIC), 0)
    finally:
        os.close(fd)
    if head == ZIP_MAGIC:
        return "zip"
    if not head:
        raise CheckpointFormatError(path, "the file is empty")
    if head[0] == PICKLE_PROTOCOL_OPCODE:
        return "legacy"
    raise CheckpointFormatError(path, f"not a torch checkpoint (starts with {head!r}, not a zip archive)")


def _span(records: list[Record]) -> tuple[int, int]:
    """The aligned-start byte range holding every storage record."""
    return round_down(records[0][0]), max(offset + size for offset, size, _ in records)


def _direct_end(file: OpenFile, end: int) -> int:
    """How far O_DIRECT may read (whole blocks inside the file); the rest needs a buffered read."""
    size = file.size()
    if end > size:
        raise io_error(
            errno.EIO, "read", file, size, "file is shorter than its zip directory says (truncated?)"
        )
    return min(round_up(end), round_down(size)) if file.direct else end


def _read_staged(
    span: tuple[int, int],
    deliver: Callable[[torch.Tensor, int, int], None],
    io_engine: IOEngine,
    file: OpenFile,
    ctx: FastPersistContext,
) -> None:
    """Read ``span`` of the file through the staging halves; ``deliver(half, file offset, length)``
    takes each half's bytes out while the next half is in flight."""
    start, end = span
    buffer = ctx.staging_buffer("cpu", nbytes=end - start)
    if buffer.device.type != "cpu":
        raise ValueError(f"staging buffer is on {buffer.device}; loads stage through host memory")
    halves = split_halves(buffer)
    reason = io_engine.accepts(halves[0], file)
    if reason is not None:
        ctx.warn_once(f"fastpersist engine {io_engine.name!r} cannot be used ({reason}); using 'python'")
        io_engine = ctx.python_engine()
    direct_end = _direct_end(file, end)
    chunks = [
        (offset, min(halves[0].numel(), end - offset)) for offset in range(start, end, halves[0].numel())
    ]

    def submit(index: int) -> None:
        offset, length = chunks[index]
        direct = max(0, min(round_up(length), direct_end - offset))
        if direct:
            io_engine.submit(Transfer(file, halves[index % 2].narrow(0, 0, direct), offset, write=False))
        if direct < length:  # the unaligned end of the file: only the last chunk
            io_engine.wait()
            _read_tail(file, halves[index % 2].narrow(0, direct, length - direct), offset + direct)

    try:
        submit(0)
        for index, (offset, length) in enumerate(chunks):
            io_engine.wait()
            if index + 1 < len(chunks):
                submit(index + 1)
            deliver(halves[index % 2], offset, length)
    except BaseException:
        io_engine.abandon()
        raise


def _read_tail(file: OpenFile, target: torch.Tensor, offset: int) -> None:
    """Buffered read filling ``target`` from ``offset`` (the unaligned end O_DIRECT cannot read)."""
    with open(file.path, "rb", buffering=0) as plain:
        got = os.preadv(plain.fileno(), [memoryview(target.numpy())], offset)
    if got != target.numel():
        raise io_error(errno.EIO, "read", file, offset + got, f"short read, {got} of {target.numel()} bytes")


def _scatter(
    records: list[Record],
    storages: dict[str, torch.Tensor],
    cursor: int,
    half: torch.Tensor,
    offset: int,
    length: int,
) -> int:
    """Copy the parts of records inside [offset, offset + length) out of ``half``; returns the new cursor."""
    end = offset + length
    index = cursor
    while index < len(records) and records[index][0] < end:
        record_offset, size, name = records[index]
        lo, hi = max(offset, record_offset), min(end, record_offset + size)
        if lo < hi:
            storages[name].narrow(0, lo - record_offset, hi - lo).copy_(half.narrow(0, lo - offset, hi - lo))
        if record_offset + size > end:
            break  # continues in the next chunk; records do not overlap, so none after it starts here
        index += 1
    return index
