"""lightning_storage_plugins' torch adapter: every private torch name it reaches exists on the installed
torch and is still what torch's own DCP file-system format writes and reads. A torch release that
renames or reshapes one fails here, by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
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
