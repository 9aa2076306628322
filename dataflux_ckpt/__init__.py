"""Google Cloud Storage checkpointing for PyTorch Lightning (``gs://`` paths).

Names are imported on first use, so that ``import dataflux_ckpt`` (and the emulator and XML
multipart server processes) need neither torch nor Lightning until a checkpoint class is used.
``TieredCheckpointIO`` and ``ShardedLocalTier`` (DCP saves with ``local_dir``) also need the ``[nvme]``
extra (FastPersist), named when they are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_storage_plugins.lazy import lazy_exports

_EXPORTS = {
    "CHUNK_SIZE_BYTES": "dataflux_ckpt.checkpoint_io",
    "MAX_WORKERS": "dataflux_ckpt.checkpoint_io",
    "STREAM_CHUNK_SIZE_BYTES": "dataflux_ckpt.checkpoint_io",
    "DatafluxCheckpointIO": "dataflux_ckpt.checkpoint_io",
    "DatafluxModelCheckpoint": "dataflux_ckpt.checkpoint_callback",
    "reader": "dataflux_ckpt.checkpoint_io",
    "writer": "dataflux_ckpt.checkpoint_io",
    "DatafluxFSDPStrategy": "dataflux_ckpt.strategies",
    "DatafluxModelParallelStrategy": "dataflux_ckpt.strategies",
    "DatafluxStorageReader": "dataflux_ckpt.dcp",
    "DatafluxStorageWriter": "dataflux_ckpt.dcp",
    "ObjectReader": "dataflux_ckpt.download",
    "BucketNotFoundError": "dataflux_ckpt.errors",
    "CheckpointExistsError": "lightning_storage_plugins.errors",
    "CheckpointMetadataError": "lightning_storage_plugins.errors",
    "ConcurrentWriteError": "dataflux_ckpt.errors",
    "DataCorruptionError": "dataflux_ckpt.errors",
    "DeadlineExceededError": "dataflux_ckpt.errors",
    "InvalidCheckpointError": "dataflux_ckpt.errors",
    "InvalidBucketNameError": "dataflux_ckpt.errors",
    "InvalidObjectNameError": "dataflux_ckpt.errors",
    "TransferError": "dataflux_ckpt.errors",
    "UnsupportedSchemeError": "dataflux_ckpt.errors",
    "Gcs": "dataflux_ckpt.gcs",
    "parse_gcs_prefix": "dataflux_ckpt.paths",
    "GcsPath": "dataflux_ckpt.paths",
    "parse_gcs_path": "dataflux_ckpt.paths",
    "Deadline": "dataflux_ckpt.retry",
    "RetryPolicy": "dataflux_ckpt.retry",
    "ObjectWriter": "dataflux_ckpt.upload",
    "StreamingWriter": "dataflux_ckpt.upload",
    "TransferOptions": "dataflux_ckpt.options",
    "LocalTierFullError": "dataflux_ckpt.tiered",
    "LocalTierInUseError": "dataflux_ckpt.tiered",
    "TieredCheckpointIO": "dataflux_ckpt.tiered",
    "TieredCheckpointMonitor": "dataflux_ckpt.tiered",
    "TieredOptions": "dataflux_ckpt.tiered",
    "TieredStats": "dataflux_ckpt.tiered",
    "ShardedLocalTier": "dataflux_ckpt.tiered_dcp",
    "ReentrantOperationError": "lightning_storage_plugins.reentry",
    "DeferredOperationError": "lightning_storage_plugins.reentry",
}

__all__ = [
    "CHUNK_SIZE_BYTES",
    "MAX_WORKERS",
    "STREAM_CHUNK_SIZE_BYTES",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointMetadataError",
    "ConcurrentWriteError",
    "DataCorruptionError",
    "DatafluxCheckpointIO",
    "DatafluxFSDPStrategy",
    "DatafluxModelCheckpoint",
    "DatafluxModelParallelStrategy",
    "DatafluxStorageReader",
    "DatafluxStorageWriter",
    "Deadline",
    "DeadlineExceededError",
    "DeferredOperationError",
    "Gcs",
    "GcsPath",
    "InvalidCheckpointError",
    "InvalidBucketNameError",
    "InvalidObjectNameError",
    "LocalTierFullError",
    "LocalTierInUseError",
    "ObjectReader",
    "ObjectWriter",
    "ReentrantOperationError",
    "RetryPolicy",
    "ShardedLocalTier",
    "StreamingWriter",
    "TieredCheckpointIO",
    "TieredCheckpointMonitor",
    "TieredOptions",
    "TieredStats",
    "TransferError",
    "TransferOptions",
    "UnsupportedSchemeError",
    "parse_gcs_path",
    "parse_gcs_prefix",
    "reader",
    "writer",
]

if TYPE_CHECKING:
    from dataflux_ckpt.checkpoint_callback import DatafluxModelCheckpoint
    from dataflux_ckpt.checkpoint_io import (
        CHUNK_SIZE_BYTES,
        MAX_WORKERS,
        STREAM_CHUNK_SIZE_BYTES,
        DatafluxCheckpointIO,
        reader,
        writer,
    )
    from dataflux_ckpt.dcp import DatafluxStorageReader, DatafluxStorageWriter
    from dataflux_ckpt.download import ObjectReader
    from dataflux_ckpt.errors import (
        BucketNotFoundError,
        ConcurrentWriteError,
        DataCorruptionError,
        DeadlineExceededError,
        InvalidBucketNameError,
        InvalidCheckpointError,
        InvalidObjectNameError,
        TransferError,
        UnsupportedSchemeError,
    )
    from dataflux_ckpt.gcs import Gcs
    from dataflux_ckpt.options import TransferOptions
    from dataflux_ckpt.paths import GcsPath, parse_gcs_path, parse_gcs_prefix
    from dataflux_ckpt.retry import Deadline, RetryPolicy
    from dataflux_ckpt.strategies import DatafluxFSDPStrategy, DatafluxModelParallelStrategy
    from dataflux_ckpt.tiered import (
        LocalTierFullError,
        LocalTierInUseError,
        TieredCheckpointIO,
        TieredCheckpointMonitor,
        TieredOptions,
        TieredStats,
    )
    from dataflux_ckpt.tiered_dcp import ShardedLocalTier
    from dataflux_ckpt.upload import ObjectWriter, StreamingWriter
    from lightning_storage_plugins.errors import CheckpointExistsError, CheckpointMetadataError
    from lightning_storage_plugins.reentry import DeferredOperationError, ReentrantOperationError


# Test fakes that moved to dataflux_ckpt.testing; still importable from here for one release.
_MOVED_TO_TESTING = frozenset({"FakeGcsServer", "XmlMultipartServer"})


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__,
                                   moved={name: "dataflux_ckpt.testing" for name in _MOVED_TO_TESTING})
