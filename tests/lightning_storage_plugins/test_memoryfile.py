"""MemoryFile: reads and seeks over a buffer behave as those of a BytesIO over the same bytes."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_storage_plugins.memoryfile import MemoryFile

_MOVES = st.lists(
    st.tuples(st.sampled_from([io.SEEK_SET, io.SEEK_CUR, io.SEEK_END]), st.integers(-40, 40), st.integers(0, 40)),
    max_size=12,
)


@given(data=st.binary(max_size=64), moves=_MOVES)
def test_reads_and_seeks_match_bytesio(data: bytes, moves: list[tuple[int, int, int]]) -> None:
    reference, file = io.BytesIO(data), MemoryFile(bytearray(data))
    position = 0
    for whence, offset, size in moves:
        position = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: position, io.SEEK_END: len(data)}[whence] + offset)
        assert file.seek(offset, whence) == position
        reference.seek(position)
        assert file.read(size) == reference.read(size)
        position = min(position + size, len(data)) if position <= len(data) else len(data)
        assert file.tell() == position  # a read from past the end leaves the position at the end


def test_torch_load_reads_a_checkpoint_from_memory() -> None:
    stream = io.BytesIO()
    torch.save({"w": torch.arange(10)}, stream)
    with MemoryFile(memoryview(stream.getbuffer())) as file:
        assert torch.equal(torch.load(file, weights_only=True)["w"], torch.arange(10))


def test_close_releases_the_buffer() -> None:
    buffer = bytearray(b"abc")
    file = MemoryFile(buffer)
    file.close()
    buffer.extend(b"def")  # a bytearray cannot be resized while a view of it is alive
    with pytest.raises(ValueError):
        file.read(1)
