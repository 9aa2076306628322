"""lightning_storage_plugins' torch adapter: every private torch name it reaches exists on the installed
torch and is still what torch's own DCP file-system format writes and reads. A torch release that
renames or reshapes one fails here, by name."""

from __future__ import annotations

import dataclasses
import io
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from lightning_storage_plugins import _torch_compat
from lightning_storage_plugins._torch_compat import StorageInfo


def test_every_private_torch_api_named_by_the_adapter_exists() -> None:
    missing = [f"{owner.__name__}.{name}" for owner, name in _torch_compat.PRIVATE_APIS if not hasattr(owner, name)]
    assert not missing, f"torch {torch.__version__} lacks {missing}"


def test_storage_info_starts_with_path_offset_length_and_the_rest_is_optional() -> None:
    fields = dataclasses.fields(StorageInfo)
    assert [field.name for field in fields[:3]] == ["relative_path", "offset", "length"]
    info = StorageInfo("__0_0.distcp", 5, 7)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 5, 7)


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning",
                            "ignore:TypedStorage is deprecated:UserWarning")
def test_torchs_own_file_system_writer_records_storage_info(tmp_path: Path) -> None:
    dcp.save({"w": torch.arange(6.0)}, storage_writer=FileSystemWriter(tmp_path))
    metadata = FileSystemReader(tmp_path).read_metadata()
    assert metadata.storage_data
    assert all(type(info) is StorageInfo for info in metadata.storage_data.values())


# One torch.save archive per DCP tensor item, loaded from memory ------------------------------------------
_ITEM_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.uint8,
                torch.bool, torch.complex64, torch.uint16, torch.float8_e4m3fn]


def _saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _item_in_memory(data: bytes, lead: int = 0) -> tuple[memoryview, torch.UntypedStorage]:
    """``data`` at offset ``lead`` of a larger allocation, as a DCP reader holds an item of a file."""
    whole = torch.zeros(lead + len(data) + 7, dtype=torch.uint8)
    item = whole.narrow(0, lead, len(data))
    item.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    storage = whole.untyped_storage()[lead : lead + len(data)]
    return memoryview(item.numpy()), storage


def _rewritten(data: bytes, change: Callable[[str, bytes], bytes | None], comment: bytes = b"") -> bytes:
    """The archive with each record passed through ``change(name, bytes)`` (``None`` drops it)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            record = change(info.filename.split("/", 1)[1], source.read(info))
            if record is not None:
                target.writestr(info.filename, record)
        target.comment = comment
    return out.getvalue()


@st.composite
def _item_tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    dtype = draw(st.sampled_from(_ITEM_DTYPES))
    tensor = torch.arange(int(torch.Size(shape).numel()) + 5, dtype=torch.float64)[5:].reshape(shape)
    tensor = tensor.to(dtype) if dtype != torch.bool else tensor > 2
    if tensor.dim() >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, 1)
    if tensor.numel() and draw(st.booleans()):
        tensor = tensor.reshape(-1)[1:]  # a view at an offset of its storage
    return tensor


@settings(max_examples=60, deadline=None)
@given(tensor=_item_tensors(), lead=st.integers(0, 5000))
def test_a_tensor_item_loads_as_torch_load_loads_it_as_a_view_of_the_read_bytes(tensor: torch.Tensor,
                                                                                  lead: int) -> None:
    data = _saved(tensor)
    want = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    view, storage = _item_in_memory(data, lead)
    got = _torch_compat.load_tensor_item(view, storage, "ckpt/__0_0.distcp")
    assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
        want.dtype, want.shape, want.stride(), want.storage_offset())
    assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))
    start = storage.data_ptr()
    assert start <= got.untyped_storage().data_ptr() < start + storage.nbytes() or not got.untyped_storage().nbytes()


@pytest.mark.parametrize("case", ["zip comment", "no byteorder record"])
def test_tensor_items_torch_reads_load_whatever_their_layout(case: str) -> None:
    data = _saved(torch.arange(10.0))
    if case == "zip comment":
        data = _rewritten(data, lambda name, record: record, comment=b"written elsewhere")
    else:
        data = _rewritten(data, lambda name, record: None if name == "byteorder" else record)
    assert torch.equal(_torch_compat.load_tensor_item(*_item_in_memory(data), "item"), torch.arange(10.0))


def test_a_tensor_item_of_a_newer_archive_format_is_refused_as_torch_refuses_it() -> None:
    data = _rewritten(_saved(torch.arange(3.0)), lambda name, record: b"99\n" if name.endswith("version") else record)
    with pytest.raises(RuntimeError) as theirs:
        torch.load(io.BytesIO(data), weights_only=True)
    with pytest.raises(RuntimeError) as ours:
        _torch_compat.load_tensor_item(*_item_in_memory(data), "item")
    assert str(ours.value) == str(theirs.value)


def test_a_tensor_item_whose_record_is_short_is_refused_naming_the_item() -> None:
    data = _rewritten(_saved(torch.arange(8.0)), lambda name, record: record[:16] if name == "data/0" else record)
    with pytest.raises(_torch_compat.RecordSizeError, match=r"ckpt/__1_0\.distcp item w: record data/0 holds 16 bytes, "
                                                            r"its storage needs 32"):
        _torch_compat.load_tensor_item(*_item_in_memory(data), "ckpt/__1_0.distcp item w")


class _Opens:
    def __reduce__(self) -> tuple[Any, ...]:
        return (open, ("never-created", "w"))


def test_a_tensor_item_that_would_run_code_is_refused_by_torchs_rules() -> None:
    data = _saved({"w": torch.ones(2), "x": _Opens()})
    with pytest.raises(pickle.UnpicklingError, match=r"weights-only load of item w refused: .*io\.open"):
        _torch_compat.load_tensor_item(*_item_in_memory(data), "item w")
    assert not Path("never-created").exists()


def test_a_damaged_tensor_item_gets_torchs_own_error() -> None:
    data = _saved(torch.arange(4.0))[:-30]
    with pytest.raises(RuntimeError) as theirs:
        torch.load(io.BytesIO(data), weights_only=True)
    with pytest.raises(RuntimeError) as ours:
        _torch_compat.load_tensor_item(*_item_in_memory(data), "item")
    assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]
