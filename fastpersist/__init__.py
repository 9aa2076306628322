"""FastPersist: no-patch NVMe checkpoint writer (torch.load-compatible files via async O_DIRECT I/O).

```python
from fastpersist import FastPersistContext, fastpersist_load, fastpersist_save
with FastPersistContext(io_buffer_mb=256) as context:  # DeepSpeed aio handle + pinned buffer, reused
    stats = fastpersist_save(model.state_dict(), "/mnt/nvme0/ckpt.pt", context=context)
state = torch.load("/mnt/nvme0/ckpt.pt", weights_only=True)
```
The Lightning plugin and the DeepSpeed checkpoint engine are imported on first use (they pull in
Lightning and DeepSpeed's runtime).
"""


from fastpersist.aio import AioConfig, get_aio_handle
from fastpersist.context import ContextInUseError, FastPersistContext
from fastpersist.memory import get_pinned_buffer, release_pinned_buffer
from fastpersist.reader import CheckpointFormatError, fastpersist_load
from fastpersist.writer import SaveStats, estimated_bytes, fastpersist_save, remove_stale_temporaries
from lightning_storage_plugins.lazy import lazy_exports

__all__ = [
    "fastpersist_save",
    "fastpersist_load",
    "estimated_bytes",
    "FastPersistContext",
    "AioConfig",
    "get_aio_handle",
    "get_pinned_buffer",
    "release_pinned_buffer",
    "remove_stale_temporaries",
    "SaveStats",
    "CheckpointFormatError",
    "ContextInUseError",
    "ReentrantOperationError",
    "DeferredOperationError",
    "CheckpointExistsError",
    "CheckpointMetadataError",
    "ConcurrentWriteError",
    "FastPersistCheckpointIO",
    "FastPersistCheckpointEngine",
    "enable_fastpersist",
    "deepspeed_initialize",
    "FastPersistStorageReader",
    "FastPersistStorageWriter",
    "FastPersistFSDPStrategy",
    "FastPersistModelParallelStrategy",
]

_LAZY = {
    "CheckpointExistsError": "lightning_storage_plugins.errors",
    "CheckpointMetadataError": "lightning_storage_plugins.errors",
    "ConcurrentWriteError": "lightning_storage_plugins.errors",
    "ReentrantOperationError": "lightning_storage_plugins.reentry",
    "DeferredOperationError": "lightning_storage_plugins.reentry",
    "FastPersistCheckpointIO": "fastpersist.checkpoint_io",
    "FastPersistCheckpointEngine": "fastpersist.deepspeed_engine",
    "enable_fastpersist": "fastpersist.deepspeed_engine",
    "deepspeed_initialize": "fastpersist.deepspeed_engine",
    "FastPersistStorageReader": "fastpersist.dcp",
    "FastPersistStorageWriter": "fastpersist.dcp",
    "FastPersistFSDPStrategy": "fastpersist.strategies",
    "FastPersistModelParallelStrategy": "fastpersist.strategies",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
