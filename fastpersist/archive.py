"""The zip container of a torch.save file, written in one forward pass with aligned storage records
(and its central directory read back without ``zipfile``).

torch.load reads any zip archive whose records sit under one folder (``<folder>/data.pkl``,
``<folder>/data/<key>``, ``<folder>/version``, ...), in any order, found through the central
directory. fastpersist writes the storage records *first*, each as soon as the pickler meets its
storage, and ``data.pkl`` after them, so the tensor bytes are on their way to disk while the rest of
the object is still being pickled. Every storage payload starts on a 4 KiB boundary (padding goes in
a local-header extra field, as torch's own writer does), records are stored uncompressed, and zip64
fields are used where sizes or offsets pass 4 GiB.

Storage records carry a CRC-32 of 0, as torch.save writes them under
``torch.serialization.set_crc32_options(False)``; torch.load does not check them.
"""

from __future__ import annotations

import os
import secrets
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastpersist.memory import ALIGNMENT_BYTES

ARCHIVE_FOLDER = "archive"
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_ZIP64_END_SIG, _ZIP64_LOCATOR_SIG = 0x06064B50, 0x07064B50
_UTF8_NAMES = 0x0800
_ZIP64_EXTRA_ID = 0x0001
_PADDING_EXTRA_ID = 0x4246  # "FB": the id torch's writer gives its alignment padding
_VERSION_ZIP64 = 45
_VERSION_PLAIN = 20
_DOS_DATE_1980 = 0x21  # 1980-01-01, the zip epoch
U32_MAX = 0xFFFFFFFF
U16_MAX = 0xFFFF


@dataclass
class _Entry:
    name: bytes
    header_offset: int
    size: int
    crc: int


class ArchiveWriter:
    """Writes zip records through ``put`` (bytes or flat uint8 tensors, in file order).

    Args:
        put: appends a piece to the file.
        position: the file offset the next ``put`` writes at.
        zip64_limit: sizes and offsets at or above this get zip64 fields (lowered only by tests).
    """

    def __init__(
        self,
        put: Callable[[bytes | torch.Tensor], None],
        position: Callable[[], int],
        zip64_limit: int = U32_MAX,
    ) -> None:
        self._put = put
        self._position = position
        self._zip64_limit = zip64_limit
        self._entries: list[_Entry] = []
        self.num_storages = 0

    def add_storage(self, key: str, storage: torch.UntypedStorage) -> None:
        """Write ``data/<key>`` with the storage's bytes starting on an ``ALIGNMENT_BYTES`` boundary."""
        size = storage.nbytes()
        self._header(f"data/{key}", size, crc=0, align=True)
        if size:
            self._put(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
        self.num_storages += 1

    def add_bytes(self, name: str, data: bytes) -> None:
        """Write a small record (the pickle, the version) with its CRC-32."""
        self._header(name, len(data), crc=zlib.crc32(data), align=False)
        self._put(data)

    def finish(self) -> None:
        """Write the central directory and the end records."""
        start = self._position()
        directory = bytearray()
        for entry in self._entries:
            zip64 = []
            size_field = offset_field = 0
            if entry.size >= self._zip64_limit:
                zip64 += [entry.size, entry.size]
                size_field = U32_MAX
            else:
                size_field = entry.size
            if entry.header_offset >= self._zip64_limit:
                zip64.append(entry.header_offset)
                offset_field = U32_MAX
            else:
                offset_field = entry.header_offset
            extra = (
                struct.pack(f"<HH{len(zip64)}Q", _ZIP64_EXTRA_ID, 8 * len(zip64), *zip64) if zip64 else b""
            )
            version = _VERSION_ZIP64 if zip64 else _VERSION_PLAIN
            directory += _CENTRAL.pack(
                _CENTRAL_SIG, version, version, _UTF8_NAMES, 0, 0, _DOS_DATE_1980, entry.crc,
                size_field, size_field, len(entry.name), len(extra), 0, 0, 0, 0, offset_field,
            )  # fmt: skip
            directory += entry.name + extra
        self._put(bytes(directory))
        count, size = len(self._entries), len(directory)
        if count >= U16_MAX or size >= self._zip64_limit or start >= self._zip64_limit:
            end64 = self._position()
            self._put(
                _ZIP64_END.pack(_ZIP64_END_SIG, _ZIP64_END.size - 12, _VERSION_ZIP64, _VERSION_ZIP64,
                                0, 0, count, count, size, start)
                + _ZIP64_LOCATOR.pack(_ZIP64_LOCATOR_SIG, 0, end64, 1)
            )  # fmt: skip
            self._put(_END.pack(_END_SIG, 0, 0, U16_MAX, U16_MAX, U32_MAX, U32_MAX, 0))
        else:
            self._put(_END.pack(_END_SIG, 0, 0, count, count, size, start, 0))

    def _header(self, name: str, size: int, crc: int, align: bool) -> None:
        full_name = f"{ARCHIVE_FOLDER}/{name}".encode()
        offset = self._position()
        zip64 = size >= self._zip64_limit
        extra = struct.pack("<HHQQ", _ZIP64_EXTRA_ID, 16, size, size) if zip64 else b""
        if align:
            data_start = offset + _LOCAL.size + len(full_name) + len(extra)
            pad = -data_start % ALIGNMENT_BYTES
            if pad and pad < 4:  # an extra field needs 4 bytes of its own header
                pad += ALIGNMENT_BYTES
            if pad:
                extra += struct.pack("<HH", _PADDING_EXTRA_ID, pad - 4) + b"Z" * (pad - 4)
        size_field = U32_MAX if zip64 else size
        version = _VERSION_ZIP64 if zip64 else _VERSION_PLAIN
        header = _LOCAL.pack(
            _LOCAL_SIG, version, _UTF8_NAMES, 0, 0, _DOS_DATE_1980, crc, size_field, size_field,
            len(full_name), len(extra),
        )  # fmt: skip
        self._put(header + full_name + extra)
        self._entries.append(_Entry(full_name, offset, size, crc))


def new_serialization_id() -> bytes:
    """A fresh 40-digit id, the form torch.save gives ``.data/serialization_id``."""
    return "".join(str(secrets.randbelow(10)) for _ in range(40)).encode()


@dataclass(frozen=True)
class DirectoryEntry:
    """One record of a zip central directory (what a reader needs to find and check its bytes)."""

    name: str  # without the archive folder: ``data/0``, ``data.pkl``, ...
    header_offset: int  # the record's local header
    size: int
    compressed_size: int
    method: int  # 0: stored


_END_SEARCH_BYTES = _END.size + U16_MAX  # the end record plus the longest comment


def read_directory(fd: int, file_size: int) -> list[DirectoryEntry]:
    """Every record of the zip archive open at ``fd``, from its central directory (zip64 included).

    Two reads (the end records, then the directory) and one pass with ``struct``: Python's
    ``zipfile`` builds a ``ZipInfo`` per record, which costs more than reading a checkpoint's bytes
    when it holds many small tensors. Offsets are taken as written, as torch's reader (miniz) does.

    Raises:
        zipfile.BadZipFile: no end record, or the directory is cut short or malformed.
    """
    tail_size = min(file_size, _END_SEARCH_BYTES)
    tail = os.pread(fd, tail_size, file_size - tail_size)
    at = tail.rfind(struct.pack("<I", _END_SIG))
    while at >= 0 and at + _END.size > len(tail):
        at = tail.rfind(struct.pack("<I", _END_SIG), 0, at)
    if at < 0:
        raise zipfile.BadZipFile("no end of central directory record")
    _, _, _, _, count, size, start, _ = _END.unpack_from(tail, at)
    if count == U16_MAX or size == U32_MAX or start == U32_MAX:
        locator_at = file_size - tail_size + at - _ZIP64_LOCATOR.size
        locator = os.pread(fd, _ZIP64_LOCATOR.size, locator_at) if locator_at >= 0 else b""
        if len(locator) != _ZIP64_LOCATOR.size or _ZIP64_LOCATOR.unpack(locator)[0] != _ZIP64_LOCATOR_SIG:
            raise zipfile.BadZipFile("zip64 end of central directory locator missing")
        end64_at = _ZIP64_LOCATOR.unpack(locator)[2]
        end64 = os.pread(fd, _ZIP64_END.size, end64_at)
        if len(end64) != _ZIP64_END.size or _ZIP64_END.unpack(end64)[0] != _ZIP64_END_SIG:
            raise zipfile.BadZipFile(f"no zip64 end of central directory record at offset {end64_at}")
        count, size, start = _ZIP64_END.unpack(end64)[7:10]
    if start + size > file_size:
        raise zipfile.BadZipFile(f"central directory ({size} bytes at offset {start}) ends past the end of the file")
    directory = os.pread(fd, size, start)
    if len(directory) != size:
        raise zipfile.BadZipFile("central directory cut short")
    entries = []
    position = 0
    for _ in range(count):
        if position + _CENTRAL.size > size:
            raise zipfile.BadZipFile(f"central directory holds fewer than its {count} records")
        fields = _CENTRAL.unpack_from(directory, position)
        if fields[0] != _CENTRAL_SIG:
            raise zipfile.BadZipFile(f"bad central directory record at offset {start + position}")
        flags, method = fields[3], fields[4]
        compressed, plain, name_length, extra_length, comment_length = fields[8:13]
        header_offset = fields[16]
        name_at = position + _CENTRAL.size
        extra_at = name_at + name_length
        position = extra_at + extra_length + comment_length
        if position > size:
            raise zipfile.BadZipFile("central directory record cut short")
        raw_name = directory[name_at:extra_at]
        name = raw_name.decode("utf-8" if flags & _UTF8_NAMES else "cp437", errors="replace")
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
        if field_id != _ZIP64_EXTRA_ID:
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
