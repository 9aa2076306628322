"""Large host tensors written straight from their memory: wherever their bytes start within a page,
files load in stock torch and in fastpersist_load, sharded checkpoints in torch's own reader, and a
save that fails leaves neither a broken file nor a temporary behind."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader

from fastpersist import (
    FastPersistContext,
    FastPersistStorageWriter,
    engines,
    fastpersist_load,
    fastpersist_save,
)
from fastpersist.archive import TORCH_STORAGE_ALIGNMENT
from fastpersist.buffers import IN_PLACE_MIN_BYTES
from fastpersist.memory import ALIGNMENT_BYTES
from tests.fastpersist.test_bad_input import assert_previous_intact, write_previous
from tests.fastpersist.test_roundtrip import FIXED, available_engines


def tensor_at(residue: int, nbytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of random ``dtype`` values whose storage is exactly its ``nbytes`` bytes and starts at
    an address of ``residue`` modulo ``ALIGNMENT_BYTES``."""
    backing = torch.empty(nbytes + 2 * ALIGNMENT_BYTES, dtype=torch.uint8)
    shift = (residue - backing.data_ptr()) % ALIGNMENT_BYTES
    storage = backing.untyped_storage()[shift : shift + nbytes]
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
    tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    assert tensor.data_ptr() % ALIGNMENT_BYTES == residue
    return tensor.view(dtype)


def record_offsets(path: Path) -> list[int]:
    """Where each storage record's bytes start in the file, in key order (``data/0``, ``data/1``...)."""
    with open(path, "rb") as stream:
        reader = torch._C.PyTorchFileReader(stream)
        names = [name for name in reader.get_all_records() if name.startswith("data/")]
        return [reader.get_record_offset(name) for name in sorted(names, key=lambda n: int(n.split("/")[1]))]


def assert_equal_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key


# (residue of the storage's address, bytes past IN_PLACE_MIN_BYTES, dtype): residues that are not a
# multiple of torch's storage alignment are staged whole; byte counts put the end anywhere in a page.
large = st.tuples(
    st.sampled_from([0, TORCH_STORAGE_ALIGNMENT, 16, ALIGNMENT_BYTES - TORCH_STORAGE_ALIGNMENT, 40 * 64]),
    st.sampled_from([0, 4, 4092, ALIGNMENT_BYTES, 12_348, 600_000]),
    st.sampled_from([torch.uint8, torch.float32]),
)
small = st.integers(min_value=1, max_value=300_000)


@pytest.mark.parametrize("buffer_mb", [1, 16])  # halves far smaller than the tensors, and larger
def test_large_tensors_load_back_bit_exact_wherever_their_memory_starts(ckpt_dir: Path, buffer_mb: int) -> None:
    with FastPersistContext(io_buffer_mb=buffer_mb) as context:

        @settings(FIXED, max_examples=12)
        @given(
            items=st.lists(st.one_of(large, small), min_size=1, max_size=4),
            engine=st.sampled_from(available_engines()),
        )
        def round_trip(items: list[tuple[int, int, torch.dtype] | int], engine: str) -> None:
            state: dict[str, torch.Tensor] = {}
            for index, item in enumerate(items):
                if isinstance(item, int):
                    state[f"small{index}"] = tensor_at(0, item, torch.uint8, seed=index)
                else:
                    residue, extra, dtype = item
                    nbytes = (IN_PLACE_MIN_BYTES + extra) // dtype.itemsize * dtype.itemsize
                    state[f"large{index}"] = tensor_at(residue, nbytes, dtype, seed=index)
            path = ckpt_dir / "in_place.pt"
            fastpersist_save(state, path, context=context, engine=engine)
            assert_equal_bits(torch.load(path, weights_only=True), state)
            assert_equal_bits(fastpersist_load(path, context=context), state)
            for offset, tensor in zip(record_offsets(path), state.values(), strict=True):
                residue = tensor.data_ptr() % ALIGNMENT_BYTES
                in_place = tensor.nbytes >= IN_PLACE_MIN_BYTES and residue % TORCH_STORAGE_ALIGNMENT == 0
                # Written in place: file and memory aligned alike; else staged, on a page boundary.
                assert offset % ALIGNMENT_BYTES == (residue if in_place else 0)

        round_trip()


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group exists
def test_sharded_checkpoints_with_large_tensors_load_in_torchs_own_reader(ckpt_dir: Path) -> None:
    state = {
        "embedding": tensor_at(64, IN_PLACE_MIN_BYTES + 4 * 4099, torch.float32, seed=1),
        "bias": tensor_at(0, 4000, torch.float32, seed=2),
        "head": tensor_at(ALIGNMENT_BYTES - 64, 2 * IN_PLACE_MIN_BYTES, torch.bfloat16, seed=3),
    }
    dcp.save(state, storage_writer=FastPersistStorageWriter(ckpt_dir / "ckpt", io_buffer_mb=1))
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(loaded, storage_reader=FileSystemReader(ckpt_dir / "ckpt"))
    assert_equal_bits(loaded, state)


@pytest.mark.parametrize("engine", available_engines())
def test_a_pickling_error_after_a_write_in_place_leaves_the_previous_file(ckpt_dir: Path, engine: str) -> None:
    path = write_previous(ckpt_dir)
    state = {"w": tensor_at(64, 3 * IN_PLACE_MIN_BYTES, torch.float32, seed=0), "fn": lambda: 0}
    with FastPersistContext(io_buffer_mb=1) as context, pytest.raises((pickle.PicklingError, AttributeError)):
        fastpersist_save(state, path, context=context, engine=engine)
    assert_previous_intact(path)


@pytest.mark.parametrize("engine", available_engines())
def test_a_failed_write_in_place_names_the_path_and_offset(
    ckpt_dir: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the write that starts at the tensor's first whole page (the one taken from its memory) fails.
    tensor = tensor_at(64, 2 * IN_PLACE_MIN_BYTES, torch.float32, seed=0)
    probe = ckpt_dir / "probe.pt"
    with FastPersistContext(io_buffer_mb=1) as context:
        fastpersist_save({"w": tensor}, probe, context=context, engine=engine)
    fault_offset = record_offsets(probe)[0] + ALIGNMENT_BYTES - 64
    real_pwritev = os.pwritev

    def pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == fault_offset and buffers[0].nbytes > ALIGNMENT_BYTES:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(engines.os, "pwritev", pwritev)
    path = write_previous(ckpt_dir)
    with (
        FastPersistContext(io_buffer_mb=1) as context,
        pytest.raises(OSError, match=rf"write failed at offset {fault_offset} of .*ckpt\.pt") as caught,
    ):
        fastpersist_save({"w": tensor}, path, context=context, engine=engine)
    assert caught.value.errno == errno.EIO
    assert_previous_intact(path)
