"""Reading a zip archive's central directory without ``zipfile``: one pass with ``struct``.

torch's checkpoints are zip archives (stored, not compressed). Python's ``zipfile`` builds a
``ZipInfo`` per record, which costs more than reading a checkpoint's bytes when it holds many small
tensors; the plugins' loaders find each storage record through :func:`read_directory` instead, over a
file descriptor or over bytes already in memory.
"""

from __future__ import annotations

import functools
import os
import struct
import zipfile
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["DirectoryEntry", "read_directory", "torch_format_problem"]

LOCAL = struct.Struct("<IHHHHHIIIHH")
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
ZIP64_END = struct.Struct("<IQHHIIQQQQ")
ZIP64_LOCATOR = struct.Struct("<IIQI")
END = struct.Struct("<IHHHHIIH")
LOCAL_SIG, CENTRAL_SIG, END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
ZIP64_END_SIG, ZIP64_LOCATOR_SIG = 0x06064B50, 0x07064B50
UTF8_NAMES = 0x0800
ZIP64_EXTRA_ID = 0x0001
U32_MAX = 0xFFFFFFFF
U16_MAX = 0xFFFF


class DirectoryEntry(NamedTuple):
    """One record of a zip central directory (what a reader needs to find and check its bytes).

    A tuple, not a dataclass: a checkpoint of many small tensors has tens of thousands of records,
    and a tuple costs less than half as much to build.
    """

    name: str  # without the archive folder: ``data/0``, ``data.pkl``, ...
    header_offset: int  # the record's local header
    size: int
    compressed_size: int
    method: int  # 0: stored


_END_SEARCH_BYTES = END.size + U16_MAX  # the end record plus the longest comment


# The first bytes of torch.save's two formats: a zip archive's first local header, or (the legacy
# format, ``_use_new_zipfile_serialization=False``) this pickle.
ZIP_MAGIC = struct.pack("<I", LOCAL_SIG)
LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_END_RECORD = struct.pack("<I", END_SIG)


def torch_format_problem(pread: Callable[[int, int], bytes], size: int, what: str, noun: str) -> str | None:
    """What makes the ``size`` stored bytes that ``pread(count, offset)`` reads something ``torch.load``
    could only fail on with a misleading message (empty; a zip archive cut before its central directory;
    neither torch's zip format nor its legacy one), naming ``what`` (a ``noun``: object, value...);
    ``None`` when they may be a checkpoint."""
    if size == 0:
        return f"{what} is an empty {noun} (0 bytes), not a torch checkpoint"
    head = pread(min(size, len(LEGACY_TORCH_MAGIC)), 0)
    if head.startswith(ZIP_MAGIC):
        start = max(0, size - _END_SEARCH_BYTES)
        if pread(size - start, start).rfind(_END_RECORD) < 0:
            return (f"{what} is a truncated torch checkpoint: its {size} bytes end before the zip archive's "
                    "central directory (an interrupted copy or upload?)")
    elif head != LEGACY_TORCH_MAGIC:
        return (f"{what} is not a torch checkpoint: it starts with {head[:8]!r}, neither a zip archive "
                "(torch.save's format) nor torch's legacy format")
    return None


def read_directory(source: int | Callable[[int, int], bytes], file_size: int) -> list[DirectoryEntry]:
    """Every record of a zip archive of ``file_size`` bytes, from its central directory (zip64 included).

    Args:
        source: a file descriptor open on the archive, or ``pread(size, offset) -> bytes`` over it.
        file_size: the archive's size in bytes.

    Two reads (the end records, then the directory) and one pass with ``struct``. Offsets are taken as
    written, as torch's reader (miniz) does.

    Raises:
        zipfile.BadZipFile: no end record, or the directory is cut short or malformed.
    """
    pread = source if callable(source) else functools.partial(_pread_fd, source)
    # Archives without a comment (torch's) end with the end record: read only it when it is there
    # (the search below reads the last 64 KiB, a cost per archive when each item is its own archive).
    tail_size = min(file_size, END.size)
    tail = pread(tail_size, file_size - tail_size)
    at = 0
    end = END.unpack(tail) if len(tail) == END.size else None
    if end is None or end[0] != END_SIG or end[7] != 0:  # no end record there, or one with a comment
        tail_size = min(file_size, _END_SEARCH_BYTES)
        tail = pread(tail_size, file_size - tail_size)
        at = tail.rfind(struct.pack("<I", END_SIG))
        while at >= 0 and at + END.size > len(tail):
            at = tail.rfind(struct.pack("<I", END_SIG), 0, at)
    if at < 0:
        raise zipfile.BadZipFile("no end of central directory record")
    _, _, _, _, count, size, start, _ = END.unpack_from(tail, at)
    if count == U16_MAX or size == U32_MAX or start == U32_MAX:
        locator_at = file_size - tail_size + at - ZIP64_LOCATOR.size
        locator = pread(ZIP64_LOCATOR.size, locator_at) if locator_at >= 0 else b""
        if len(locator) != ZIP64_LOCATOR.size or ZIP64_LOCATOR.unpack(locator)[0] != ZIP64_LOCATOR_SIG:
            raise zipfile.BadZipFile("zip64 end of central directory locator missing")
        end64_at = ZIP64_LOCATOR.unpack(locator)[2]
        end64 = pread(ZIP64_END.size, end64_at)
        if len(end64) != ZIP64_END.size or ZIP64_END.unpack(end64)[0] != ZIP64_END_SIG:
            raise zipfile.BadZipFile(f"no zip64 end of central directory record at offset {end64_at}")
        count, size, start = ZIP64_END.unpack(end64)[7:10]
    if start + size > file_size:
        raise zipfile.BadZipFile(f"central directory ({size} bytes at offset {start}) ends past the end of the file")
    directory = pread(size, start)
    if len(directory) != size:
        raise zipfile.BadZipFile("central directory cut short")
    entries = []
    position = 0
    unpack = CENTRAL.unpack_from
    for _ in range(count):
        if position + CENTRAL.size > size:
            raise zipfile.BadZipFile(f"central directory holds fewer than its {count} records")
        (signature, _, _, flags, method, _, _, _, compressed, plain, name_length, extra_length,
         comment_length, _, _, _, header_offset) = unpack(directory, position)
        if signature != CENTRAL_SIG:
            raise zipfile.BadZipFile(f"bad central directory record at offset {start + position}")
        name_at = position + CENTRAL.size
        extra_at = name_at + name_length
        position = extra_at + extra_length + comment_length
        if position > size:
            raise zipfile.BadZipFile("central directory record cut short")
        name = directory[name_at:extra_at].decode("utf-8" if flags & UTF8_NAMES else "cp437", errors="replace")
        if U32_MAX in (plain, compressed, header_offset):
            plain, compressed, header_offset = _zip64_fields(
                directory[extra_at : extra_at + extra_length], plain, compressed, header_offset
            )
        entries.append(DirectoryEntry(name.split("/", 1)[-1], header_offset, plain, compressed, method))
    return entries


def _zip64_fields(extra: bytes, plain: int, compressed: int, header_offset: int) -> tuple[int, int, int]:
    """The sizes and offset a zip64 extra field replaces (each only where the 32-bit field is full)."""
    position = 0
    while position + 4 <= len(extra):
        field_id, field_size = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4 : position + 4 + field_size]
        position += 4 + field_size
        if field_id != ZIP64_EXTRA_ID:
            continue
        values = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
        try:
            if plain == U32_MAX:
                plain = values.pop(0)
            if compressed == U32_MAX:
                compressed = values.pop(0)
            if header_offset == U32_MAX:
                header_offset = values.pop(0)
        except IndexError:
            raise zipfile.BadZipFile("zip64 extra field too short") from None
        return plain, compressed, header_offset
    raise zipfile.BadZipFile("zip64 sizes or offset without a zip64 extra field")


def _pread_fd(fd: int, size: int, offset: int) -> bytes:
    return os.pread(fd, size, offset)
