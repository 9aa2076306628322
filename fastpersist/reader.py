"""``fastpersist_load``: read any torch.save zip with large aligned async reads, then unpickle as torch.load.

Two read paths, chosen by engine:

- ``"python"`` (default, *direct*): one page-aligned host allocation the size of the file; the storage
  span is read straight into it with parallel O_DIRECT ``preadv`` calls, and each storage is a slice of
  it (as with ``torch.load(mmap=True)``). No staging copy: on a 2-core machine the copy out of a pinned
  buffer into freshly faulted memory costs more than the read itself.
- ``"aio"`` (*staged*): DeepSpeed aio reads into the two halves of the pinned buffer (one half is read
  while the other is scattered into separately allocated storages, which can be freed one by one).

Either way torch's own unpickling (``weights_only`` rules, ``map_location``, shared storages, byte
order) then runs over those bytes. Files that are not zip archives (legacy format) go to ``torch.load``.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
from typing import Any

import torch

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
)
from fastpersist.handles import ALIGNMENT_BYTES, exclusive, get_default_pinned_buffer, huge_page_empty

log = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"
DEFAULT_LOAD_ENGINE = "python"
Record = tuple[int, int, str]  # (file offset, size, record name)


class _PreloadedRecords:
    """A PyTorchFileReader whose storage records come from already-read tensors."""

    def __init__(self, reader: Any, storages: dict[str, torch.Tensor]) -> None:
        self._reader = reader
        self._storages = storages

    def get_storage_from_record(self, name: str, numel: int, dtype: Any) -> torch.Tensor:
        preloaded = self._storages.get(name)
        return (
            preloaded if preloaded is not None else self._reader.get_storage_from_record(name, numel, dtype)
        )

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._reader, attr)


def fastpersist_load(
    file_path: str | os.PathLike[str],
    map_location: Any = None,
    weights_only: bool | None = True,
    aio_handle: Any = None,
    pinned_buffer: torch.Tensor | None = None,
    *,
    engine: str | None = None,
) -> Any:
    """Return what ``torch.load(file_path, map_location, weights_only=weights_only)`` would.

    Args:
        file_path: a file written by ``torch.save`` or ``fastpersist_save``.
        map_location: as for ``torch.load``.
        weights_only: as for ``torch.load`` (``None`` means torch's default, ``True``).
        aio_handle: DeepSpeed aio handle for the staged path (default: the shared one).
        pinned_buffer: page-locked staging memory for the staged path (default: the shared one).
        engine: ``"python"`` (default: direct reads into the tensors' memory) or ``"aio"`` (staged).

    Raises:
        FileNotFoundError / IsADirectoryError: ``file_path`` is not a regular file.
        OSError: a read failed (path and offset in the message).
        pickle.UnpicklingError: ``weights_only`` forbids something in the file.
    """
    path = os.fspath(file_path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
    weights_only = True if weights_only is None else weights_only
    with open(path, "rb") as stream:
        if stream.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
            log.info("%s is not a zip archive (legacy torch.save format?): using torch.load", path)
            return torch.load(path, map_location=map_location, weights_only=weights_only)
        stream.seek(0)
        reader = torch._C.PyTorchFileReader(stream)
        names = reader.get_all_records()
        if "data.pkl" not in names or not hasattr(torch.serialization, "_load"):
            log.info("%s is not a torch.save archive this loader knows: using torch.load", path)
            return torch.load(path, map_location=map_location, weights_only=weights_only)
        records = sorted(
            (reader.get_record_offset(name), reader.get_record_size(name), name)
            for name in names
            if name.startswith("data/") and reader.get_record_size(name) > 0
        )
        if not records:
            return _unpickle(reader, map_location, weights_only, path)
        io_engine = create_engine(engine or DEFAULT_LOAD_ENGINE, aio_handle)
        if io_engine.device != "cpu":
            log.warning(
                "fastpersist_load reads into host memory: engine %r replaced by 'python'", io_engine.name
            )
            io_engine = PythonEngine()
        file = open_file(path, write=False)
        try:
            if isinstance(io_engine, PythonEngine):
                whole_file = _read_direct(records, io_engine, file)
                return _unpickle(reader, map_location, weights_only, path, overall_storage=whole_file)
            storages = {name: torch.empty(size, dtype=torch.uint8) for _, size, name in records}
            _read_staged(records, storages, io_engine, file, pinned_buffer)
        finally:
            file.close()
        return _unpickle(_PreloadedRecords(reader, storages), map_location, weights_only, path)


def _unpickle(zip_reader: Any, map_location: Any, weights_only: bool, path: str, **load_args: Any) -> Any:
    """torch.load's zip branch (``torch.serialization._load``) over bytes already in memory."""
    serialization: Any = torch.serialization
    if not weights_only:
        return serialization._load(zip_reader, map_location, pickle, encoding="utf-8", **load_args)
    try:
        return serialization._load(
            zip_reader,
            map_location,
            serialization._weights_only_unpickler,
            weights_only=True,
            encoding="utf-8",
            **load_args,
        )
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"Weights only load failed for {path}: {err}\nLoad with weights_only=False only if you trust the "
            "file's source; or allow the global with torch.serialization.add_safe_globals()."
        ) from None


def _span(records: list[Record]) -> tuple[int, int]:
    """The aligned-start byte range holding every storage record."""
    start = records[0][0] // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    return start, max(offset + size for offset, size, _ in records)


def _direct_end(file: OpenFile, end: int) -> int:
    """How far O_DIRECT may read (whole blocks inside the file); the rest needs a buffered read."""
    size = file.size()
    if end > size:
        raise io_error(
            errno.EIO, "read", file, size, "file is shorter than its zip directory says (truncated?)"
        )
    return (
        min(-(-end // ALIGNMENT_BYTES) * ALIGNMENT_BYTES, size // ALIGNMENT_BYTES * ALIGNMENT_BYTES)
        if file.direct
        else end
    )


def _read_direct(records: list[Record], io_engine: IOEngine, file: OpenFile) -> torch.UntypedStorage:
    """Read the storage span straight into one page-aligned allocation; returns it as file-offset storage."""
    start, end = _span(records)
    direct_end = max(start, _direct_end(file, end))
    whole = huge_page_empty(max(end, direct_end))
    if direct_end > start:
        io_engine.submit(Transfer(file, whole.narrow(0, start, direct_end - start), start, write=False))
        io_engine.wait()
    if end > direct_end:
        _read_tail(file, whole.narrow(0, direct_end, end - direct_end), direct_end)
    return whole.untyped_storage()[whole.storage_offset() : whole.storage_offset() + whole.numel()]


def _read_staged(
    records: list[Record],
    storages: dict[str, torch.Tensor],
    io_engine: IOEngine,
    file: OpenFile,
    pinned_buffer: torch.Tensor | None,
) -> None:
    """Read through the pinned halves, scattering one half while the next is in flight."""
    buffer = pinned_buffer if pinned_buffer is not None else get_default_pinned_buffer()
    halves = split_halves(buffer)
    io_engine = engine_for(io_engine, halves[0], file)
    start, end = _span(records)
    direct_end = _direct_end(file, end)
    chunks = [
        (offset, min(halves[0].numel(), end - offset)) for offset in range(start, end, halves[0].numel())
    ]

    def submit(index: int) -> None:
        offset, length = chunks[index]
        direct = max(0, min(-(-length // ALIGNMENT_BYTES) * ALIGNMENT_BYTES, direct_end - offset))
        if direct:
            io_engine.submit(Transfer(file, halves[index % 2].narrow(0, 0, direct), offset, write=False))
        if direct < length:  # the unaligned end of the file: only the last chunk
            io_engine.wait()
            _read_tail(file, halves[index % 2].narrow(0, direct, length - direct), offset + direct)

    with exclusive(("buffer", buffer.data_ptr())), io_engine.session():
        submit(0)
        cursor = 0  # first record not yet fully copied
        for index, (offset, length) in enumerate(chunks):
            io_engine.wait()
            if index + 1 < len(chunks):
                submit(index + 1)
            cursor = _scatter(records, storages, cursor, halves[index % 2], offset, length)


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
