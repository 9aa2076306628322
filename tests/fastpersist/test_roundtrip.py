"""Round trips: fastpersist_save files load in stock torch; fastpersist_load matches torch.load."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpersist import FastPersistContext, fastpersist_load, fastpersist_save
from fastpersist.aio import aio_unavailable_reason
from fastpersist.buffers import SLICES_PER_HALF
from fastpersist.memory import ALIGNMENT_BYTES
from tests.support import fp_compare
from tests.support.fp_compare import assert_same

HALF = 512 * 1024  # half of the 1 MiB small_context buffer
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    *[getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)],
]  # fmt: skip
# Byte sizes around the O_DIRECT alignment and the staging halves, plus one spanning several halves.
BOUNDARY_BYTES = [
    1,
    ALIGNMENT_BYTES - 1,
    ALIGNMENT_BYTES,
    ALIGNMENT_BYTES + 1,
    HALF - 16,
    HALF,
    HALF + 16,
    2 * HALF + 5000,
]
FIXED = settings(
    deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
FRESH_PROCESS_SCRIPT = Path(fp_compare.__file__)


def available_engines() -> list[str]:
    return ["aio", "python"] if aio_unavailable_reason() is None else ["python"]


def make_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and infinities included for floats)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=generator).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape_kind = draw(st.sampled_from(["scalar", "empty", "small", "boundary", "matrix"]))
    seed = draw(st.integers(0, 2**31))
    if shape_kind == "scalar":
        return make_tensor(dtype, 1, seed).reshape(())
    if shape_kind == "empty":
        return make_tensor(dtype, 0, seed).reshape(draw(st.sampled_from([(0,), (3, 0), (0, 2, 5)])))
    if shape_kind == "boundary":
        numel = max(1, draw(st.sampled_from(BOUNDARY_BYTES)) // itemsize)
        return make_tensor(dtype, numel, seed)
    if shape_kind == "matrix":
        rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        return make_tensor(dtype, rows * cols, seed).reshape(rows, cols)
    return make_tensor(dtype, draw(st.integers(1, 3000)), seed)


@st.composite
def view_groups(draw: st.DrawFn) -> list[torch.Tensor]:
    """Several tensors over one storage: the base, offset, strided, transposed views, the base again."""
    base = make_tensor(
        draw(st.sampled_from(DTYPES)), draw(st.integers(8, 6000)) * 2, draw(st.integers(0, 2**31))
    )
    views = draw(st.permutations([base, base[3:], base[1::2], base.view(2, -1).t(), base[5:9], base]))
    return views[: draw(st.integers(2, len(views)))]


leaves = st.one_of(
    tensors(),
    view_groups(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
)
keys = st.text(min_size=1, max_size=6)
objects = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
    ),
    max_leaves=8,
)


def test_saved_files_load_with_stock_torch_in_a_fresh_process(
    ckpt_dir: Path, small_context: FastPersistContext
) -> None:
    cases: list[str] = []

    @settings(FIXED, max_examples=50)
    @given(obj=objects, engine=st.sampled_from(available_engines()))
    def save_one(obj: Any, engine: str) -> None:
        saved, reference = ckpt_dir / f"case{len(cases)}.pt", ckpt_dir / f"case{len(cases)}.ref.pt"
        stats = fastpersist_save(obj, saved, context=small_context, engine=engine)
        assert stats.engine == engine and stats.bytes == saved.stat().st_size
        assert_same(torch.load(saved, weights_only=True), obj)
        torch.save(obj, reference)
        cases.append(f"{saved}\t{reference}")

    save_one()
    listing = ckpt_dir / "cases.tsv"
    listing.write_text("\n".join(cases) + "\n")
    done = subprocess.run(
        [sys.executable, str(FRESH_PROCESS_SCRIPT), str(listing)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"checked {len(cases)} files" in done.stdout


def test_fastpersist_load_matches_torch_load_on_torch_save_files(
    ckpt_dir: Path, small_context: FastPersistContext
) -> None:
    @settings(FIXED, max_examples=40)
    @given(obj=objects, engine=st.sampled_from(available_engines()), weights_only=st.booleans())
    def load_one(obj: Any, engine: str, weights_only: bool) -> None:
        path = ckpt_dir / "plain.pt"
        torch.save(obj, path)
        got = fastpersist_load(path, weights_only=weights_only, context=small_context, engine=engine)
        assert_same(got, torch.load(path, weights_only=weights_only))

    load_one()


def test_storage_records_start_on_the_o_direct_alignment(
    ckpt_dir: Path, engine: str, small_context: FastPersistContext
) -> None:
    path = ckpt_dir / "aligned.pt"
    fastpersist_save(
        {f"t{i}": torch.randn(i * 97 + 1) for i in range(20)}, path, context=small_context, engine=engine
    )
    with open(path, "rb") as stream:
        reader = torch._C.PyTorchFileReader(stream)
        offsets = [reader.get_record_offset(n) for n in reader.get_all_records() if n.startswith("data/")]
    assert len(offsets) == 20 and all(offset % ALIGNMENT_BYTES == 0 for offset in offsets)


def test_many_small_tensors_are_batched_into_few_writes(
    ckpt_dir: Path, engine: str, small_context: FastPersistContext
) -> None:
    state = {f"layer{i}.weight": torch.full((50,), float(i)) for i in range(10_000)}
    stats = fastpersist_save(state, ckpt_dir / "many.pt", context=small_context, engine=engine)
    assert stats.num_storages == 10_000
    assert stats.num_writes <= SLICES_PER_HALF * (stats.bytes // HALF + 1)  # however many tensors
    loaded = fastpersist_load(ckpt_dir / "many.pt", context=small_context, engine=engine)
    assert_same(loaded, state)


def test_a_save_of_many_tensors_runs_no_garbage_collection(ckpt_dir: Path, small_context: FastPersistContext) -> None:
    """Pickling 10,000 tensors makes tens of thousands of short-lived containers: with the cyclic
    collector on, they set off about a hundred of its passes, full ones among them, in every save.
    (The first save of a tensor gives its storage a Python object that lives on with it: the collector
    looks at those once, after that save.)"""
    state = {f"layer{i}.weight": torch.full((50,), float(i)) for i in range(10_000)}
    passes: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    fastpersist_save(state, ckpt_dir / "first.pt", context=small_context)
    assert gc.isenabled()
    gc.callbacks.append(count)
    try:
        fastpersist_save(state, ckpt_dir / "many.pt", context=small_context)
        assert passes == []
    finally:
        gc.callbacks.remove(count)
    assert gc.isenabled()


@pytest.mark.parametrize("engine", ["python", "aio"])
def test_a_load_of_many_tensors_leaves_the_collector_one_young_pass(
    ckpt_dir: Path, small_context: FastPersistContext, engine: str
) -> None:
    """The zip directory, the located records and the unpickler's memo of 10,000 tensors are all
    temporaries: none of them is left for the collector, only the loaded object's own containers."""
    state = {f"layer{i}.weight": torch.full((50,), float(i)) for i in range(10_000)}
    fastpersist_save(state, ckpt_dir / "many.pt", context=small_context)
    passes: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        loaded = fastpersist_load(ckpt_dir / "many.pt", context=small_context, engine=engine)
        young_pass = [0]
    finally:
        gc.callbacks.remove(count)
    assert passes in ([], young_pass)
    assert gc.isenabled()
    assert_same(loaded, state)


def test_load_maps_location_and_honours_weights_only(
    ckpt_dir: Path, small_context: FastPersistContext
) -> None:
    path = ckpt_dir / "obj.pt"
    torch.save({"w": torch.arange(6.0), "fn": torch.nn.ReLU()}, path)
    with pytest.raises(Exception, match="weights_only"):
        fastpersist_load(path, context=small_context)
    loaded = fastpersist_load(path, map_location="cpu", weights_only=False, context=small_context)
    assert isinstance(loaded["fn"], torch.nn.ReLU) and torch.equal(loaded["w"], torch.arange(6.0))
    moved = fastpersist_load(
        path, map_location=lambda storage, loc: storage, weights_only=False, context=small_context
    )
    assert torch.equal(moved["w"], torch.arange(6.0))


def test_legacy_format_files_load(ckpt_dir: Path, small_context: FastPersistContext) -> None:
    path = ckpt_dir / "legacy.pt"
    state = {"a": torch.arange(10), "b": [torch.ones(2, 2)]}
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert_same(fastpersist_load(path, context=small_context), state)


def test_a_context_reuses_its_buffer_and_a_call_without_one_frees_its_own(ckpt_dir: Path) -> None:
    with FastPersistContext(io_buffer_mb=1) as context:
        first = fastpersist_save({"x": torch.ones(3)}, ckpt_dir / "a.pt", context=context)
        buffer = context.staging_buffer()
        second = fastpersist_save({"x": torch.ones(3)}, ckpt_dir / "b.pt", context=context)
        assert context.staging_buffer() is buffer
    assert first.engine == second.engine == available_engines()[0]
    one_shot = fastpersist_save({"x": torch.ones(3)}, ckpt_dir / "c.pt")
    assert one_shot.engine == available_engines()[0]
    assert torch.equal(fastpersist_load(ckpt_dir / "b.pt")["x"], torch.ones(3))
    assert torch.equal(torch.load(ckpt_dir / "c.pt", weights_only=True)["x"], torch.ones(3))


def test_stats_report_bytes_time_speed_engine_and_path(
    ckpt_dir: Path, engine: str, small_context: FastPersistContext
) -> None:
    path = ckpt_dir / "stats.pt"
    stats = fastpersist_save({"w": torch.randn(300_000)}, path, context=small_context, engine=engine)
    assert stats.path == str(path) and stats.bytes == path.stat().st_size > 1_200_000
    assert stats.seconds > 0 and stats.gbps > 0 and stats.engine == engine
    assert set(stats.as_dict()) >= {"path", "bytes", "seconds", "gbps", "engine"}



def test_a_dict_changed_by_another_thread_while_it_is_saved_is_saved_as_it_was_when_reached(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning 2.5's ``AsyncCheckpointIO`` saves ModelCheckpoint's live state on its own thread while
    the training thread replaces the one entry of ``best_k_models``. Here an engine thread replaces it
    at the save's first write, which the save waits for before it goes on (the tensor fills both
    halves of the staging buffer): the dict is written as it was when the save reached it, as
    torch.save writes a one-entry dict."""
    best: dict[str, Any] = {"step=8.ckpt": torch.arange(4 * 2**20, dtype=torch.float32)}
    real_pwritev = os.pwritev
    replaced = []

    def pwritev(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        if not replaced:
            replaced.append(best.pop("step=8.ckpt"))
            best["step=9.ckpt"] = torch.zeros(1)
        return real_pwritev(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "pwritev", pwritev)
    path = ckpt_dir / "changed.ckpt"
    with FastPersistContext(engine="python", io_buffer_mb=1) as context:
        fastpersist_save({"best_k_models": best}, path, context=context)
    assert replaced and list(best) == ["step=9.ckpt"]
    loaded = torch.load(path, weights_only=True)["best_k_models"]
    assert list(loaded) == ["step=8.ckpt"] and torch.equal(loaded["step=8.ckpt"], replaced[0])
