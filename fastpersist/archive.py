"""The zip container of a torch.save file, written in one forward pass with aligned storage records
(and its central directory read back without ``zipfile``).

torch.load reads any zip archive whose records sit under one folder (``<folder>/data.pkl``,
``<folder>/data/<key>``, ``<folder>/version``, ...), in any order, found through the central
directory. fastpersist writes the storage records *first*, each as soon as the pickler meets its
storage, and ``data.pkl`` after them, so the tensor bytes are on their way to disk while the rest of
the object is still being pickled. Every storage payload starts on a 4 KiB boundary, or, for a large
host storage written in place, at its address modulo 4 KiB (a multiple of 64, as torch.save aligns
storages); padding goes in a local-header extra field, as torch's own writer does. Records are stored
uncompressed, and zip64 fields are used where sizes or offsets pass 4 GiB.

Storage records carry a CRC-32 of 0, as torch.save writes them under
``torch.serialization.set_crc32_options(False)``; torch.load does not check them.
"""

from __future__ import annotations

import secrets
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastpersist.memory import ALIGNMENT_BYTES
from lightning_storage_plugins.ziparchive import (
    CENTRAL as _CENTRAL,
)
from lightning_storage_plugins.ziparchive import (
    CENTRAL_SIG as _CENTRAL_SIG,
)
from lightning_storage_plugins.ziparchive import (
    END as _END,
)
from lightning_storage_plugins.ziparchive import (
    END_SIG as _END_SIG,
)
from lightning_storage_plugins.ziparchive import (
    LOCAL as _LOCAL,
)
from lightning_storage_plugins.ziparchive import (
    LOCAL_SIG as _LOCAL_SIG,
)
from lightning_storage_plugins.ziparchive import (
    U16_MAX,
    U32_MAX,
)
from lightning_storage_plugins.ziparchive import (
    UTF8_NAMES as _UTF8_NAMES,
)
from lightning_storage_plugins.ziparchive import (
    ZIP64_END as _ZIP64_END,
)
from lightning_storage_plugins.ziparchive import (
    ZIP64_END_SIG as _ZIP64_END_SIG,
)
from lightning_storage_plugins.ziparchive import (
    ZIP64_EXTRA_ID as _ZIP64_EXTRA_ID,
)
from lightning_storage_plugins.ziparchive import (
    ZIP64_LOCATOR as _ZIP64_LOCATOR,
)
from lightning_storage_plugins.ziparchive import (
    ZIP64_LOCATOR_SIG as _ZIP64_LOCATOR_SIG,
)

ARCHIVE_FOLDER = "archive"
TORCH_STORAGE_ALIGNMENT = 64  # torch.save starts every storage payload on a multiple of this
_PADDING_EXTRA_ID = 0x4246  # "FB": the id torch's writer gives its alignment padding
_VERSION_ZIP64 = 45
_VERSION_PLAIN = 20
_DOS_DATE_1980 = 0x21  # 1980-01-01, the zip epoch


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
        position: the offset the next ``put`` writes at, relative to the archive's first byte.
        zip64_limit: sizes and offsets at or above this get zip64 fields (lowered only by tests).
        alignment: storage payloads start on multiples of this many bytes of the file.
        base: where in the file the archive starts (non-zero for an archive inside a larger file, as
            each tensor item of a DCP checkpoint is).
        in_place_from: host storages of at least this many bytes (0: none) whose address is a multiple
            of ``TORCH_STORAGE_ALIGNMENT`` start instead at a file offset equal to their address modulo
            ``ALIGNMENT_BYTES``, so the page-aligned middle of their bytes can go to an O_DIRECT file
            straight from their memory (see :class:`fastpersist.buffers.DoubleBuffer`).
    """

    def __init__(
        self,
        put: Callable[[bytes | torch.Tensor | torch.UntypedStorage], None],
        position: Callable[[], int],
        zip64_limit: int = U32_MAX,
        alignment: int = ALIGNMENT_BYTES,
        base: int = 0,
        in_place_from: int = 0,
    ) -> None:
        self._put = put
        self._position = position
        self._zip64_limit = zip64_limit
        self._alignment = alignment
        self._base = base
        self._in_place_from = in_place_from
        self._entries: list[_Entry] = []
        self.num_storages = 0

    def add_storage(self, key: str, storage: torch.UntypedStorage) -> None:
        """Write ``data/<key>`` with the storage's bytes starting on an ``alignment`` boundary of the file,
        or, for a storage ``in_place_from`` covers, at its address modulo ``ALIGNMENT_BYTES``."""
        size = storage.nbytes()
        address = storage.data_ptr()
        in_place = (
            0 < self._in_place_from <= size
            and storage.device.type == "cpu"
            and address % TORCH_STORAGE_ALIGNMENT == 0  # the payload stays as aligned as torch.save's
        )
        self._header(f"data/{key}", size, crc=0, align=True,
                     residue=address % ALIGNMENT_BYTES if in_place else None)
        if size:
            self._put(storage)
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

    def _header(self, name: str, size: int, crc: int, align: bool, residue: int | None = None) -> None:
        """Write a local header; with ``align``, padded so the payload starts on an ``alignment``
        boundary of the file, or, given ``residue``, at a file offset of that residue modulo
        ``ALIGNMENT_BYTES``."""
        full_name = f"{ARCHIVE_FOLDER}/{name}".encode()
        offset = self._position()
        zip64 = size >= self._zip64_limit
        extra = struct.pack("<HHQQ", _ZIP64_EXTRA_ID, 16, size, size) if zip64 else b""
        if align:
            data_start = self._base + offset + _LOCAL.size + len(full_name) + len(extra)
            step = self._alignment if residue is None else ALIGNMENT_BYTES
            pad = ((residue or 0) - data_start) % step
            while pad and pad < 4:  # an extra field needs 4 bytes of its own header
                pad += step
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
    return f"{secrets.randbelow(10**40):040d}".encode()
