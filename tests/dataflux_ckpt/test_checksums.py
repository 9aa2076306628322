"""crc32c of concatenations from the crc32c of their pieces, against the crc32c of the whole."""

import itertools

import google_crc32c
import pytest
from hypothesis import given
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
