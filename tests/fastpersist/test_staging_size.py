"""The staging buffer is the size of what an operation stages, and loads take the same path whatever
the save engine: a short-lived process page-locks no more than its checkpoint needs.

Page-locked memory is read from ``VmLck`` in ``/proc/self/status``: DeepSpeed's aio handle locks the
staging buffer with ``mlock`` where there is no CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpersist import (
    FastPersistCheckpointIO,
    FastPersistContext,
    FastPersistStorageReader,
    FastPersistStorageWriter,
    estimated_bytes,
    fastpersist_load,
    fastpersist_save,
)
from fastpersist.context import MIN_STAGING_BYTES
from fastpersist.memory import ALIGNMENT_BYTES, MiB

CAP_MB = 8


def locked_bytes() -> int:
    """Bytes this process has page-locked (``VmLck``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.fixture
def locks_with_aio(aio_engine: str) -> None:
    """Where the aio handle page-locks the staging buffer itself (no CUDA: pin_memory would)."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the staging buffer is pinned by CUDA, which VmLck may not show")


def mib_state(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=generator), "step": torch.tensor(seed)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.none(), st.integers(0, 3 * CAP_MB * MiB)), min_size=1, max_size=6))
def test_a_buffer_holds_what_is_asked_up_to_the_cap_and_grows_geometrically(asked: list[int | None]) -> None:
    cap = CAP_MB * MiB
    with FastPersistContext(engine="python", io_buffer_mb=CAP_MB) as context:
        previous: torch.Tensor | None = None
        for nbytes in asked:
            buffer = context.staging_buffer("cpu", pinned=False, nbytes=nbytes)
            wanted = cap if nbytes is None else min(cap, max(nbytes, MIN_STAGING_BYTES))
            assert wanted <= buffer.numel() <= cap
            assert buffer.numel() % (2 * ALIGNMENT_BYTES) == 0  # two aligned halves
            if previous is not None and previous.numel() >= wanted:
                assert buffer.data_ptr() == previous.data_ptr(), "a buffer large enough is kept"
            elif previous is not None:
                assert buffer.numel() >= min(cap, 2 * previous.numel()), "grown at least twofold"
            previous = buffer


def test_a_negative_size_is_refused() -> None:
    with FastPersistContext(engine="python") as context, pytest.raises(ValueError, match="must not be negative"):
        context.staging_buffer("cpu", pinned=False, nbytes=-1)


def test_a_save_locks_what_its_checkpoint_needs_grows_for_a_bigger_one_and_stops_at_the_cap(
    ckpt_dir: Path, locks_with_aio: None
) -> None:
    before = locked_bytes()
    plugin = FastPersistCheckpointIO()  # the default cap: 256 MiB
    small, big = mib_state(16, 1), mib_state(40, 2)
    try:
        plugin.save_checkpoint(small, ckpt_dir / "small.ckpt")
        after_small = locked_bytes() - before
        assert 16 * MiB <= after_small <= 18 * MiB, f"{after_small / MiB:.1f} MiB locked for a 16 MiB checkpoint"
        plugin.save_checkpoint(small, ckpt_dir / "small.ckpt")
        assert locked_bytes() - before == after_small, "the buffer is kept for a save it holds"
        plugin.save_checkpoint(big, ckpt_dir / "big.ckpt")
        after_big = locked_bytes() - before
        assert 40 * MiB <= after_big <= 42 * MiB, f"{after_big / MiB:.1f} MiB locked for a 40 MiB checkpoint"
    finally:
        plugin.teardown()
    assert locked_bytes() == before, "teardown unlocks the buffer"
    capped = FastPersistCheckpointIO(io_buffer_mb=4)
    try:
        capped.save_checkpoint(big, ckpt_dir / "capped.ckpt")
        assert locked_bytes() - before == 4 * MiB, "io_buffer_mb caps the buffer"
    finally:
        capped.teardown()
    for name, state in (("small", small), ("big", big), ("capped", big)):
        loaded = torch.load(ckpt_dir / f"{name}.ckpt", weights_only=True)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == state["step"]


def test_a_save_given_the_estimate_sizes_its_buffer_by_it_and_writes_the_same_checkpoint(ckpt_dir: Path,
                                                                                  locks_with_aio: None) -> None:
    state = mib_state(16, 4)
    estimate = estimated_bytes(state)
    assert 16 * MiB < estimate < 17 * MiB
    paths = {name: ckpt_dir / name / "x.ckpt" for name in ("walked", "given", "small")}  # one archive name
    for path in paths.values():
        path.parent.mkdir()
    before = locked_bytes()
    with FastPersistContext() as context:
        fastpersist_save(state, paths["walked"], context=context)
        fastpersist_save(state, paths["given"], context=context, estimated_nbytes=estimate)
        assert 16 * MiB <= locked_bytes() - before <= 18 * MiB
    with FastPersistContext() as context:  # a caller's (smaller) estimate is what the buffer is sized by
        fastpersist_save(state, paths["small"], context=context, estimated_nbytes=4 * MiB)
        assert locked_bytes() - before < 6 * MiB
    assert len({path.stat().st_size for path in paths.values()}) == 1  # (each save has its own serialization id)
    for path in paths.values():
        loaded = torch.load(path, weights_only=True)
        assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == state["step"]


@pytest.mark.parametrize("engine", [None, "aio"], ids=["default", "aio"])
def test_a_load_reads_into_the_tensors_whatever_engine_saves(ckpt_dir: Path, locks_with_aio: None,
                                                             engine: str | None) -> None:
    state = mib_state(16, 3)
    writer = FastPersistCheckpointIO(engine=engine)
    try:
        writer.save_checkpoint(state, ckpt_dir / "x.ckpt")
    finally:
        writer.teardown()
    before = locked_bytes()
    reader = FastPersistCheckpointIO(engine=engine)  # as a restarted process loads: nothing allocated yet
    try:
        loaded = reader.load_checkpoint(ckpt_dir / "x.ckpt")
        assert locked_bytes() == before, "a host load page-locks no staging buffer, as with the default engine"
    finally:
        reader.teardown()
    assert torch.equal(loaded["w"], state["w"])
    with FastPersistContext() as context:  # asked for by the call itself, the staged path is still there
        staged = fastpersist_load(ckpt_dir / "x.ckpt", context=context, engine="aio")
        assert locked_bytes() - before >= 16 * MiB
    assert torch.equal(staged["w"], state["w"])


def test_a_sharded_load_locks_no_memory_and_a_save_after_it_locks_what_it_needs(ckpt_dir: Path,
                                                                                locks_with_aio: None) -> None:
    generator = torch.Generator().manual_seed(5)
    state = {f"w{index}": torch.randn(MiB // 2, generator=generator) for index in range(8)}  # 8 x 2 MiB

    def load(path: Path, context: FastPersistContext) -> dict[str, torch.Tensor]:
        loaded = {key: torch.zeros_like(value) for key, value in state.items()}
        dcp.load(loaded, storage_reader=FastPersistStorageReader(path, context=context))
        return loaded

    dcp.save(state, storage_writer=FastPersistStorageWriter(ckpt_dir / "first"))
    before = locked_bytes()
    with FastPersistContext() as context:  # as a restarted process: it loads, then saves
        first = load(ckpt_dir / "first", context)
        assert locked_bytes() == before, "reads go through the python engine: a load page-locks nothing"
        dcp.save(state, storage_writer=FastPersistStorageWriter(ckpt_dir / "second", context=context))
        locked = locked_bytes() - before
        assert 16 * MiB <= locked <= 18 * MiB, f"{locked / MiB:.1f} MiB locked for a 16 MiB save"
        second = load(ckpt_dir / "second", context)
        assert locked_bytes() - before == locked, "a load after the save locks nothing more"
    assert locked_bytes() == before, "close unlocks the buffer"
    for loaded in (first, second):
        assert all(torch.equal(loaded[key], value) for key, value in state.items())
