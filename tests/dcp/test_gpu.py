"""DCP storage with CUDA tensors (run wherever CUDA is present): GPU state dicts save through both
storages (device-to-host in pieces / through the staging buffer) and load back into GPU and CPU targets
bit-exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dataflux_ckpt import DatafluxStorageReader, DatafluxStorageWriter
from fastpersist import FastPersistStorageReader, FastPersistStorageWriter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _state(device: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "fp32": torch.randn(1024, 513, generator=generator).to(device),
        "bf16": torch.randn(77, 300, generator=generator).to(torch.bfloat16).to(device),
        "fp16_t": torch.randn(64, 32, generator=generator).half().to(device).t(),  # not contiguous
        "scalar": torch.tensor(5.0, device=device),
    }


@pytest.mark.parametrize("storage", ["gs", "nvme"])
@pytest.mark.parametrize("target_device", ["cuda", "cpu"])
def test_gpu_state_round_trip(storage: str, target_device: str, gs_root: str, nvme_root: Path) -> None:
    state = _state("cuda")
    if storage == "gs":
        writer = DatafluxStorageWriter(f"{gs_root}/gpu", chunk_size=2**20)
        reader = DatafluxStorageReader(f"{gs_root}/gpu", chunk_size=2**20)
    else:
        writer, reader = FastPersistStorageWriter(nvme_root, io_buffer_mb=8), FastPersistStorageReader(nvme_root)
    dcp.save(state, storage_writer=writer)
    loaded = {key: torch.zeros_like(value, device=target_device) for key, value in state.items()}
    dcp.load(loaded, storage_reader=reader)
    for key, value in state.items():
        assert loaded[key].device.type == target_device
        assert torch.equal(loaded[key].cpu(), value.cpu()), key
