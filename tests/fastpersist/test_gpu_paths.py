"""GPU code paths on a CPU-only machine: mocks stand in only for calls that need a CUDA device."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from fastpersist import engines, get_pinned_buffer, handles, writer
from fastpersist.engines import PythonEngine, create_engine, open_file
from fastpersist.image import FileImage

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="exercises the CPU-only fallbacks and mocks"
)


class PretendCudaTensor(torch.Tensor):
    """A CPU tensor that reports itself as a CUDA tensor (narrowing yields plain CPU tensors)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def narrow(self, *args: Any) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.narrow(self.as_subclass(torch.Tensor), *args)


def test_pinned_buffer_uses_pin_memory_where_cuda_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.numel()) or self)
    buffer = get_pinned_buffer(2)
    assert pinned == [2 * 1024**2] and buffer.dtype == torch.uint8 and buffer.numel() == 2 * 1024**2


def test_gpu_tensor_bytes_go_device_to_host_into_the_pinned_half_then_sync(
    ckpt_dir: Path, small_buffer: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer copies GPU storages straight into the pinned half with non_blocking=True and must
    # synchronize before that half is submitted; torch.cuda.synchronize is the GPU-only call mocked here.
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    real_submit = PythonEngine.submit
    monkeypatch.setattr(
        PythonEngine, "submit", lambda self, t: events.append("submit") or real_submit(self, t)
    )
    source = torch.arange(300_000, dtype=torch.uint8)
    image = FileImage(
        size=source.numel(), segments=[(0, source.as_subclass(PretendCudaTensor))], num_storages=1
    )
    file = open_file(str(ckpt_dir / "gpu.bin"), write=True)
    try:
        writer._stream(image, PythonEngine(), file, small_buffer)
    finally:
        file.close()
    assert events[:2] == ["sync", "submit"] and events.count("sync") == events.count("submit")
    assert (ckpt_dir / "gpu.bin").read_bytes() == source.numpy().tobytes()


def test_gds_without_cuda_falls_back_to_aio_with_a_warning(
    caplog: pytest.LogCaptureFixture, aio_engine: str
) -> None:
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        engine = create_engine("gds")
    assert (
        engine.name == "aio"
        and "'gds' unavailable (CUDA is not available); falling back to 'aio'" in caplog.text
    )


def test_aio_unavailable_falls_back_to_python_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engines, "aio_op", lambda: None)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        engine = create_engine(None)
    assert engine.name == "python" and "falling back to 'python'" in caplog.text
    with pytest.raises(ValueError, match="unknown fastpersist engine"):
        create_engine("nvme-magic")


def test_unlockable_memory_gives_aligned_unlocked_buffer_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handles, "can_lock_memory", lambda num_bytes: False)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        buffer = get_pinned_buffer(1)
    assert buffer.data_ptr() % handles.PAGE_BYTES == 0 and "cannot page-lock" in caplog.text
