"""crc32c of concatenations from the crc32c of their pieces, against the crc32c of the whole."""

import itertools
import mmap

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflux_ckpt.checksums import crc32c_combine, crc32c_extend


def _crc(data: bytes) -> int:
    return google_crc32c.value(data)


@given(st.binary(max_size=4096), st.binary(max_size=4096))
def test_combine_of_two_pieces_is_the_crc_of_their_concatenation(a, b):
    assert crc32c_combine(_crc(a), _crc(b), len(b)) == _crc(a + b)


@given(st.binary(min_size=0, max_size=20_000), st.lists(st.integers(0, 20_000), max_size=12))
def test_folding_any_split_gives_the_whole(data, cuts):
    bounds = sorted({0, len(data), *(min(cut, len(data)) for cut in cuts)})
    crc = 0
    for start, end in itertools.pairwise(bounds):
        crc = crc32c_combine(crc, crc32c_extend(0, memoryview(data)[start:end]), end - start)
    assert crc == _crc(data)


@pytest.mark.parametrize("length", [2**20 - 1, 2**20, 32 * 2**20 + 1])
def test_combine_across_large_zero_runs(length):
    """Long second pieces exercise the high power-of-two operators."""
    zeros = bytes(length)
    assert crc32c_combine(_crc(b"head"), _crc(zeros), length) == _crc(b"head" + zeros)


def test_negative_length_is_refused():
    with pytest.raises(ValueError, match="length_b"):
        crc32c_combine(0, 0, -1)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=5000), start=st.integers(0, 5000), crc=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["bytes", "bytearray", "memoryview", "readonly", "mmap", "float32"]))
def test_every_buffer_kind_gives_google_crc32c_s_value(data, start, crc, kind):
    """Whichever implementation is installed (the optional crc32c package or google-crc32c)."""
    piece = data[min(start, len(data)):]
    if kind == "float32":
        piece = piece[: len(piece) // 4 * 4]
    expected = google_crc32c.extend(crc, piece)
    if kind == "bytes":
        buffer = piece
    elif kind == "bytearray":
        buffer = bytearray(piece)
    elif kind == "memoryview":
        buffer = memoryview(bytearray(b"xx" + piece))[2:]
    elif kind == "readonly":
        buffer = memoryview(piece).toreadonly()
    elif kind == "mmap":
        mapping = mmap.mmap(-1, max(len(piece), 1))
        mapping[: len(piece)] = piece
        buffer = memoryview(mapping)[: len(piece)]
    else:
        buffer = memoryview(bytearray(piece)).cast("f")
    assert crc32c_extend(crc, buffer) == expected
