"""Crafted archives: real torch.save files with storage-record sizes and lengths changed.

Whatever the change, ``fastpersist_load`` either refuses the file with ``CheckpointFormatError`` or
returns exactly what ``torch.load`` returns: never bytes that are not in the record (earlier heap
contents, a stale staging buffer, neighbouring records).
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpersist import CheckpointFormatError, FastPersistContext, fastpersist_load, fastpersist_save
from fastpersist.aio import aio_unavailable_reason
from tests.support.direct_io import o_direct_dir
from tests.support.fp_compare import assert_same

# A zero-size tensor, small ones, and one larger than a half of the 1 MiB staging buffer of
# ``small_context``, so the staged path scatters records across several buffer turns.
STATE = {
    "big": torch.arange(200_000, dtype=torch.float32),
    "w": torch.arange(3000, dtype=torch.int32),
    "b": torch.ones(10),
    "empty": torch.zeros(0),
    "last": torch.arange(7, dtype=torch.int64),
}
_CENTRAL = b"PK\x01\x02"
# (struct format, offset in the header) of each field a mutation may change.
FIELDS = {
    "central sizes": ("<II", 20),  # compressed and uncompressed size, kept equal
    "central compressed size": ("<I", 20),
    "central uncompressed size": ("<I", 24),
    "central header offset": ("<I", 42),
    "local sizes": ("<II", 18),
    "local name length": ("<H", 26),
    "local extra length": ("<H", 28),
}


def _engines() -> list[str]:
    return ["aio", "python"] if aio_unavailable_reason() is None else ["python"]


def _data_records(data: bytes) -> list[tuple[int, int, int]]:
    """``(central header position, local header position, size)`` of each ``data/`` record."""
    found = []
    position = data.find(_CENTRAL)
    while position >= 0:
        (size,) = struct.unpack_from("<I", data, position + 24)
        (name_length,) = struct.unpack_from("<H", data, position + 28)
        name = data[position + 46 : position + 46 + name_length].decode(errors="replace")
        if "/data/" in name:
            found.append((position, struct.unpack_from("<I", data, position + 42)[0], size))
        position = data.find(_CENTRAL, position + 1)
    return found


@st.composite
def mutations(draw: st.DrawFn, data: bytes) -> list[tuple[str, int, int]]:
    records = _data_records(data)
    chosen = []
    for _ in range(draw(st.integers(1, 3))):
        record = draw(st.integers(0, len(records) - 1))
        field = draw(st.sampled_from(sorted(FIELDS)))
        size = records[record][2]
        limit = 0xFFFF if FIELDS[field][0] == "<H" else 0xFFFFFFFF
        value = draw(
            st.sampled_from([0, 1, size - 1, size + 1, size // 2, 2 * size, size + 4096, len(data), limit])
            | st.integers(0, min(limit, 2 * len(data)))
        )
        chosen.append((field, record, max(0, min(limit, value))))
    return chosen


def _apply(data: bytes, changes: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    records = _data_records(data)
    for field, record, value in changes:
        central, local, _ = records[record]
        fmt, offset = FIELDS[field]
        base = central if field.startswith("central") else local
        struct.pack_into(fmt, out, base + offset, *[value] * (len(fmt) - 1))
    return bytes(out)


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    directory = o_direct_dir(tmp_path_factory.mktemp("crafted"))
    torch.save(STATE, directory / "torch.pt")
    fastpersist_save(STATE, directory / "fastpersist.pt", engine="python")
    return {name: (directory / f"{name}.pt").read_bytes() for name in ("torch", "fastpersist")}


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), writer=st.sampled_from(["torch", "fastpersist"]), engine=st.sampled_from(_engines()))
def test_crafted_record_sizes_are_refused_or_load_as_torch_load_does(
    originals: dict[str, bytes],
    tmp_path_factory: pytest.TempPathFactory,
    small_context: FastPersistContext,
    data: st.DataObject,
    writer: str,
    engine: str,
) -> None:
    changes = data.draw(mutations(originals[writer]), label="changes")
    path = o_direct_dir(tmp_path_factory.getbasetemp()) / "crafted.pt"
    path.write_bytes(_apply(originals[writer], changes))
    expected, refused = None, False
    try:
        expected = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal by torch.load: fastpersist must refuse too
        refused = True
    try:
        got = fastpersist_load(path, engine=engine, context=small_context)
    except CheckpointFormatError as err:
        assert err.path == str(path)
        return
    assert not refused, f"torch.load refuses {changes}, fastpersist_load returned {got!r}"
    assert_same(got, expected)


@pytest.mark.parametrize("engine", _engines())
@pytest.mark.parametrize("size", [0, 4, 1023, 1025])
def test_a_storage_record_of_the_wrong_size_is_refused_naming_it(
    tmp_path: Path, small_context: FastPersistContext, engine: str, size: int
) -> None:
    path = o_direct_dir(tmp_path) / "short.pt"
    torch.save({"a": torch.arange(256, dtype=torch.float32), "b": torch.ones(3)}, path)
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        names = [info.filename.split("/", 1)[1] for info in archive.infolist() if "/data/" in info.filename]
    index = names.index("data/0")
    path.write_bytes(_apply(data, [("central sizes", index, size), ("local sizes", index, size)]))
    with pytest.raises(CheckpointFormatError, match=f"data/0 holds {size} bytes, its storage needs 1024"):
        fastpersist_load(path, engine=engine, context=small_context)
