"""``fastpersist_save``: a torch.save-compatible file written as one aligned, double-buffered stream.

Write path (why): the whole file image (skeleton runs + storage bytes, in file order) is streamed
through the two halves of the pinned buffer and each full half goes out as one large aligned write at
the next sequential offset. Small tensors are thereby batched for free (10,000 tensors are still
``size / half`` writes), every write is aligned, only the final tail is padded (then truncated off),
and because the file only grows, a completed write can be verified by the file's size.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fastpersist.buffers import DoubleBuffer, segment_length, split_halves
from fastpersist.engines import (
    IOEngine,
    OpenFile,
    Transfer,
    create_engine,
    engine_for,
    io_error,
    open_file,
    preallocate,
)
from fastpersist.handles import ALIGNMENT_BYTES, exclusive, get_default_pinned_buffer
from fastpersist.image import DEFAULT_PICKLE_PROTOCOL, FileImage, Fill, plan_image

log = logging.getLogger(__name__)

GB = 1024**3  # the seed's "GB" (its 14.23 GB phi-3 checkpoint is 14.23 * 2**30 bytes)
TEMP_SUFFIX = ".fastpersist.tmp"


@dataclass(frozen=True)
class SaveStats:
    """What one save did: ``bytes`` written to ``path`` in ``seconds`` with ``engine``."""

    path: str
    bytes: int
    seconds: float
    engine: str
    num_storages: int
    num_writes: int

    @property
    def gbps(self) -> float:
        return self.bytes / GB / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


def fastpersist_save(
    obj: Any,
    file_path: str | os.PathLike[str],
    aio_handle: Any = None,
    pinned_buffer: torch.Tensor | None = None,
    *,
    engine: str | None = None,
    pickle_protocol: int = DEFAULT_PICKLE_PROTOCOL,
) -> SaveStats:
    """Save ``obj`` to ``file_path`` as a normal torch.save zip, with large aligned async writes.

    The file is written under a temporary name in the same directory, fsynced and renamed into place:
    an error never leaves a partial file at ``file_path`` nor touches a previous one.

    Args:
        obj: anything ``torch.save`` accepts (state dicts, nested containers, tensors on any device).
        file_path: destination; its directory must exist.
        aio_handle: a DeepSpeed aio handle (default: a shared one, see ``get_aio_handle``).
        pinned_buffer: page-locked staging memory (default: a shared 256 MiB one).
        engine: ``"aio"`` (default), ``"python"`` or ``"gds"``; an unavailable one falls back with a warning.
        pickle_protocol: as for ``torch.save``.

    Returns:
        :class:`SaveStats` (bytes, seconds, gbps, engine, path).

    Raises:
        FileNotFoundError: the directory does not exist.
        IsADirectoryError: ``file_path`` is a directory.
        ValueError: the pinned buffer cannot hold two aligned halves.
        OSError: a write failed or was short (ENOSPC when the disk is full), naming path and offset.
    """
    start = time.perf_counter()
    path = _check_target(file_path)
    io_engine = create_engine(engine, aio_handle)
    buffer = pinned_buffer if pinned_buffer is not None else _default_buffer_for(io_engine)
    split_halves(buffer)  # refuse a too-small buffer before any work
    image = plan_image(obj, pickle_protocol)
    _check_free_space(path, image.size)
    temp = _temp_name(path)
    file = _create(temp, path)
    try:
        preallocate(file, _padded(image.size) if file.direct else image.size)
        io_engine = engine_for(io_engine, buffer, file)
        with exclusive(("buffer", buffer.data_ptr())), io_engine.session():
            num_writes = _stream(image, io_engine, file, buffer)
        os.fsync(file.fd)
        file.close()
        os.replace(temp, path)
    except BaseException:
        file.close()
        _unlink_quietly(temp)
        raise
    _fsync_dir(os.path.dirname(path))
    stats = SaveStats(
        path, image.size, time.perf_counter() - start, io_engine.name, image.num_storages, num_writes
    )
    log.info(
        "saved %s: %d bytes in %.3f s (%.2f GB/s, engine %s)",
        path,
        stats.bytes,
        stats.seconds,
        stats.gbps,
        stats.engine,
    )
    return stats


def _padded(num_bytes: int) -> int:
    return -(-num_bytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def _default_buffer_for(io_engine: IOEngine) -> torch.Tensor:
    if io_engine.device == "cpu":
        return get_default_pinned_buffer()
    return torch.empty(get_default_pinned_buffer().numel(), dtype=torch.uint8, device=io_engine.device)


def _check_target(file_path: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(file_path))
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "checkpoint path is a directory", path)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT, f"checkpoint directory does not exist (saving {path})", directory
        )
    return path


def _check_free_space(path: str, size: int) -> None:
    """Fail before writing anything when the filesystem cannot hold the file (the old one stays)."""
    fs = os.statvfs(os.path.dirname(path))
    free = fs.f_bavail * fs.f_frsize
    if free < size + ALIGNMENT_BYTES:
        raise OSError(errno.ENOSPC, f"no space left for {size} bytes at {path} ({free} bytes free)", path)


def _temp_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def _create(temp: str, path: str) -> OpenFile:
    try:
        file = open_file(temp, write=True)
    except OSError as err:
        directory = os.path.dirname(path)
        raise type(err)(
            err.errno, f"cannot create a file in {directory} to save {path}: {err.strerror}", directory
        ) from err
    file.label = f"{path} (temporary {os.path.basename(temp)})"
    return file


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stream(image: FileImage, io_engine: IOEngine, file: OpenFile, buffer: torch.Tensor) -> int:
    """Copy the file image through the double buffer and write it; returns the number of writes."""
    stage = DoubleBuffer(buffer)
    cursor = 0  # file offset of the next byte to stage
    writes = 0

    def drain(nbytes: int) -> None:
        nonlocal writes
        if stage.has_device_copies:
            torch.cuda.synchronize()  # non-blocking device-to-host copies must land before the write
            stage.has_device_copies = False
        io_engine.wait()  # the other half's write is done: it may be refilled after this submit
        io_engine.submit(Transfer(file, stage.current.narrow(0, 0, nbytes), stage.file_offset, write=True))
        writes += 1
        stage.swap(nbytes)

    for offset, segment in image.segments:
        if offset > cursor:
            stage.put(Fill(offset - cursor, 0), drain)
        stage.put(segment, drain)
        cursor = offset + segment_length(segment)
    if cursor < image.size:
        stage.put(Fill(image.size - cursor, 0), drain)
    tail = stage.filled
    if tail:
        padded = _padded(tail) if file.direct else tail
        stage.current.narrow(0, tail, padded - tail).zero_()
        stage.filled = padded
        drain(padded)
    io_engine.wait()
    if file.size() != image.size:
        os.ftruncate(file.fd, image.size)  # drop the tail's alignment padding
    if file.size() != image.size:
        raise io_error(
            errno.EIO, "write", file, file.size(), f"file is {file.size()} bytes, expected {image.size}"
        )
    return writes
