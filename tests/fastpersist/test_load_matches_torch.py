"""``fastpersist_load`` returns what ``torch.load(weights_only=True)`` returns, and refuses what it refuses.

The plain-tensor loop (``lightning_storage_plugins._torch_compat._load_plain_tensors``) replaces torch's per-tensor machinery for
CPU weights-only loads, and the direct read path unpickles while the bytes are still arriving; these
tests compare every result with torch's own, and check that a read error is still the error reported.
"""

from __future__ import annotations

import collections
import datetime
import errno
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpersist import _libc, _torch_compat, engines, fastpersist_load, fastpersist_save
from lightning_storage_plugins.ziparchive import read_directory
from tests.support.direct_io import o_direct_dir
from tests.support.fp_compare import assert_same

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
MAP_LOCATIONS = [None, "cpu", torch.device("cpu")]


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(-100, 100, (numel,), generator=generator)
    if dtype == torch.bool:
        return (raw > 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(raw.double(), -raw.double()).to(dtype).reshape(shape)
    if dtype == torch.uint8:
        raw = raw.abs()
    return raw.to(dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn, pool: list[torch.Tensor]) -> torch.Tensor:
    """A tensor: fresh, a view of one drawn before (shared storage), non-contiguous, or a Parameter."""
    if pool and draw(st.booleans()):
        base = draw(st.sampled_from(pool))
        kind = draw(st.sampled_from(["same", "slice", "transpose", "flat"]))
        if kind == "slice" and base.dim() and base.shape[0]:
            start = draw(st.integers(0, base.shape[0] - 1))
            return base[start:]
        if kind == "transpose" and base.dim() >= 2:
            return base.transpose(0, 1)
        if kind == "flat" and base.is_contiguous():
            return base.reshape(-1)
        return base
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    tensor = _values(shape, dtype, draw(st.integers(0, 2**16)))
    if tensor.dim() >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, tensor.dim() - 1)  # non-contiguous, saved with its strides
    if dtype.is_floating_point or dtype.is_complex:
        wrap = draw(st.sampled_from(["plain", "requires_grad", "parameter", "frozen parameter"]))
        if wrap == "requires_grad":
            tensor = tensor.detach().requires_grad_(True)
        elif wrap != "plain":
            tensor = torch.nn.Parameter(tensor.contiguous(), requires_grad=wrap == "parameter")
    pool.append(tensor)
    return tensor


@st.composite
def states(draw: st.DrawFn) -> Any:
    """Nested dicts, OrderedDicts, lists and tuples of tensors and plain values."""
    pool: list[torch.Tensor] = []
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False),
        st.text(max_size=5), st.sampled_from([torch.float16, torch.int64, torch.Size([2, 3])]),
    )  # fmt: skip
    leaves = st.one_of(tensors(pool), tensors(pool), scalars)
    keys = st.text(max_size=4)
    tree = st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(keys, children, max_size=4),
            st.dictionaries(keys, children, max_size=4).map(collections.OrderedDict),
        ),
        max_leaves=12,
    )
    return draw(st.dictionaries(keys, tree, min_size=1, max_size=5))


def assert_loaded_like_torch(got: Any, want: Any) -> None:
    """Values, dtypes, shapes, strides and sharing (``assert_same``), and each tensor's autograd flag."""
    assert_same(got, want)
    got_tensors: list[torch.Tensor] = []
    want_tensors: list[torch.Tensor] = []
    _tensors(got, got_tensors)
    _tensors(want, want_tensors)
    for index, (g, w) in enumerate(zip(got_tensors, want_tensors, strict=True)):
        assert g.requires_grad == w.requires_grad, f"tensor #{index}: requires_grad differs"
        assert g.is_conj() == w.is_conj() and g.is_neg() == w.is_neg(), f"tensor #{index}: bits differ"
        assert g.device == w.device, f"tensor #{index}: device differs"


def _tensors(obj: Any, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, found)


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    state=states(),
    writer=st.sampled_from(["torch", "fastpersist"]),
    map_location=st.sampled_from(MAP_LOCATIONS),
)
def test_loads_what_torch_load_loads(
    tmp_path_factory: pytest.TempPathFactory, state: Any, writer: str, map_location: Any
) -> None:
    path = o_direct_dir(tmp_path_factory.getbasetemp()) / "state.pt"
    if writer == "torch":
        torch.save(state, path)
    else:
        fastpersist_save(state, path, engine="python")
    want = torch.load(path, map_location=map_location, weights_only=True)
    got = fastpersist_load(path, map_location=map_location, weights_only=True, engine="python")
    assert_loaded_like_torch(got, want)


class NotAllowed:
    """A class no weights-only load may construct."""

    def __init__(self, value: int) -> None:
        self.value = value


def _archive_with_pickle(path: Path, data_pkl: bytes) -> None:
    """A torch.save archive of ``{}`` whose ``data.pkl`` is replaced by ``data_pkl``."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source, zipfile.ZipFile(path, "w") as target:
        for info in source.infolist():
            body = data_pkl if info.filename.endswith("/data.pkl") else source.read(info)
            target.writestr(info.filename, body)


REFUSED = {
    "a class of the test suite": lambda: {"w": torch.ones(3), "x": NotAllowed(1)},
    "a standard-library class": lambda: [torch.ones(2), datetime.date(2020, 1, 1)],
}
# A storage-type name from another module than torch: torch's weights-only unpickler refuses it.
FOREIGN_STORAGE_PICKLE = b"\x80\x02}q\x00X\x01\x00\x00\x00xq\x01cos\nFloatStorage\nq\x02s."


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_refuses_what_torch_load_refuses(ckpt_dir: Path, what: str) -> None:
    path = ckpt_dir / "refused.pt"
    torch.save(REFUSED[what](), path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match="weights-only load of .* refused"):
        fastpersist_load(path, weights_only=True, engine="python")


def test_a_storage_type_named_from_another_module_is_refused_as_torch_refuses_it(ckpt_dir: Path) -> None:
    path = ckpt_dir / "foreign.pt"
    _archive_with_pickle(path, FOREIGN_STORAGE_PICKLE)
    with pytest.raises(pickle.UnpicklingError, match="os.FloatStorage"):
        torch.load(path, weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match="os.FloatStorage"):
        fastpersist_load(path, weights_only=True, engine="python")


def test_a_global_torch_allows_but_the_loop_does_not_resolve_still_loads(ckpt_dir: Path) -> None:
    state = {"counts": collections.Counter("abca"), "w": torch.arange(4.0)}
    path = ckpt_dir / "counter.pt"
    torch.save(state, path)
    try:
        want = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:  # a torch that does not allow Counter: both refuse
        with pytest.raises(pickle.UnpicklingError):
            fastpersist_load(path, weights_only=True, engine="python")
        return
    assert_loaded_like_torch(fastpersist_load(path, weights_only=True, engine="python"), want)


def test_plain_tensors_load_without_per_tensor_fake_mode_checks(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(50)}
    path = ckpt_dir / "plain.pt"
    fastpersist_save(state, path, engine="python")
    calls = []
    detect = torch._guards.detect_fake_mode
    monkeypatch.setattr(torch._guards, "detect_fake_mode", lambda *a: calls.append(a) or detect(*a))
    got = fastpersist_load(path, weights_only=True, engine="python")
    assert len(calls) <= 1, f"{len(calls)} fake-mode checks for 50 tensors"
    assert_loaded_like_torch(got, torch.load(path, weights_only=True))


@pytest.mark.parametrize("where", ["first chunk", "last chunk"])
def test_a_read_error_while_unpickling_is_raised_and_nothing_is_returned(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    state = {f"t{i}": torch.full((1024 * 1024,), float(i)) for i in range(40)}  # 160 MiB: 10 chunks
    path = ckpt_dir / "big.pt"
    fastpersist_save(state, path, engine="python")
    records = sorted(_torch_compat.storage_records(str(path)))
    fault_offset = records[0][0] if where == "first chunk" else records[-1][0] + records[-1][1] - 1
    preadv = os.preadv

    def failing_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        if offset <= fault_offset < offset + sum(len(b) for b in buffers):
            raise OSError(errno.EIO, "injected read error")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(engines.os, "preadv", failing_preadv)
    with pytest.raises(OSError, match=r"read failed at offset \d+ of .*big\.pt") as caught:
        fastpersist_load(path, weights_only=True, engine="python")
    assert caught.value.errno == errno.EIO


@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
def test_the_directory_is_read_as_zipfile_reads_it(ckpt_dir: Path, writer: str) -> None:
    state = {f"t{i}": torch.ones(i % 3) for i in range(300)}
    path = ckpt_dir / "many.pt"
    torch.save(state, path) if writer == "torch" else fastpersist_save(state, path, engine="python")
    with open(path, "rb") as stream, zipfile.ZipFile(stream) as archive:
        want = [(i.filename.split("/", 1)[-1], i.header_offset, i.file_size) for i in archive.infolist()]
        got = [(e.name, e.header_offset, e.size) for e in read_directory(stream.fileno(), path.stat().st_size)]
    assert got == want


@pytest.mark.parametrize("populate", ["kernel populates", "kernel refuses (before Linux 5.14)"])
def test_reads_into_fresh_memory_land_whether_or_not_the_kernel_populates_it(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, populate: str
) -> None:
    state = {f"t{i}": torch.full((1024 * 1024,), float(i)) for i in range(12)}  # 48 MiB: 3 chunks
    path = ckpt_dir / "fresh.pt"
    fastpersist_save(state, path, engine="python")
    calls: list[int] = []
    real = _libc.populate_write

    def populate_write(address: int, length: int) -> int:
        calls.append(length)
        return errno.EINVAL if populate.startswith("kernel refuses") else real(address, length)

    monkeypatch.setattr(_libc, "populate_write", populate_write)
    assert_loaded_like_torch(fastpersist_load(path, engine="python"), torch.load(path, weights_only=True))
    assert calls and (len(calls) == 1 or not populate.startswith("kernel refuses"))


@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
def test_conjugate_and_negative_bits_are_restored_as_torch_restores_them(ckpt_dir: Path, writer: str) -> None:
    base = torch.complex(torch.arange(3.0), torch.arange(3.0) + 1)
    state = {"conj": base.conj(), "neg": base.clone().conj().imag, "plain": base}
    path = ckpt_dir / "bits.pt"
    torch.save(state, path) if writer == "torch" else fastpersist_save(state, path, engine="python")
    want = torch.load(path, weights_only=True)
    got = fastpersist_load(path, weights_only=True, engine="python")
    for key in state:
        assert (got[key].is_conj(), got[key].is_neg()) == (want[key].is_conj(), want[key].is_neg()), key
        assert torch.equal(got[key].resolve_conj().resolve_neg(), want[key].resolve_conj().resolve_neg()), key
    assert got["conj"].is_conj() and got["neg"].is_neg()
