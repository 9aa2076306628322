"""crc32c over any buffer (bytes, bytearray, read-only memoryviews), without copying it."""

from __future__ import annotations

import base64
import ctypes
import struct

import google_crc32c
import numpy as np

BytesLike = bytes | bytearray | memoryview


def crc32c_extend(crc: int, data: BytesLike) -> int:
    """Extend ``crc`` with the bytes of ``data``.

    ``google_crc32c`` accepts only buffers without a release hook (bytes, ctypes arrays); a ctypes
    array laid over the same memory gives it any buffer without a copy.
    """
    if isinstance(data, bytes):
        return google_crc32c.extend(crc, data)
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return crc
    array = np.frombuffer(view, dtype=np.uint8)  # keeps ``view`` alive while ``alias`` is used
    alias = (ctypes.c_char * view.nbytes).from_address(array.ctypes.data)
    return google_crc32c.extend(crc, alias)


def crc32c_b64(crc: int) -> str:
    """The base64 big-endian form GCS uses in ``crc32c`` metadata and ``x-goog-hash`` headers."""
    return base64.b64encode(struct.pack(">I", crc)).decode()
