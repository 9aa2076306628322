"""FastPersist: no-patch NVMe checkpoint writer (torch.load-compatible files via async O_DIRECT I/O).

```python
from fastpersist import fastpersist_save, fastpersist_load, get_aio_handle, get_pinned_buffer
stats = fastpersist_save(obj=model.state_dict(), file_path="/mnt/nvme0/ckpt.pt",
                         aio_handle=get_aio_handle(), pinned_buffer=get_pinned_buffer(size_mb=256))
state = torch.load("/mnt/nvme0/ckpt.pt", weights_only=True)
```
The Lightning plugin and the DeepSpeed checkpoint engine are imported on first use (they pull in
Lightning and DeepSpeed's runtime).
"""

from importlib import import_module
from typing import Any

from fastpersist.handles import get_aio_handle, get_pinned_buffer
from fastpersist.reader import fastpersist_load
from fastpersist.writer import SaveStats, fastpersist_save

__all__ = [
    "fastpersist_save",
    "fastpersist_load",
    "get_aio_handle",
    "get_pinned_buffer",
    "SaveStats",
    "FastPersistCheckpointIO",
    "FastPersistCheckpointEngine",
    "enable_fastpersist",
    "FastPersistStorageReader",
    "FastPersistStorageWriter",
    "FastPersistFSDPStrategy",
    "FastPersistModelParallelStrategy",
]

_LAZY = {
    "FastPersistCheckpointIO": "fastpersist.checkpoint_io",
    "FastPersistCheckpointEngine": "fastpersist.deepspeed_engine",
    "enable_fastpersist": "fastpersist.deepspeed_engine",
    "FastPersistStorageReader": "fastpersist.dcp",
    "FastPersistStorageWriter": "fastpersist.dcp",
    "FastPersistFSDPStrategy": "fastpersist.strategies",
    "FastPersistModelParallelStrategy": "fastpersist.strategies",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastpersist' has no attribute {name!r}")
