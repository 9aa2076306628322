"""Google Cloud Storage checkpointing for PyTorch Lightning (``gs://`` paths).

Names are imported on first use, so that ``import dataflux_ckpt`` (and the emulator and XML
multipart server processes) need neither torch nor Lightning until a checkpoint class is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CHUNK_SIZE_BYTES": "dataflux_ckpt.checkpoint_io",
    "MAX_WORKERS": "dataflux_ckpt.checkpoint_io",
    "STREAM_CHUNK_SIZE_BYTES": "dataflux_ckpt.checkpoint_io",
    "DatafluxCheckpointIO": "dataflux_ckpt.checkpoint_io",
    "reader": "dataflux_ckpt.checkpoint_io",
    "writer": "dataflux_ckpt.checkpoint_io",
    "DatafluxFSDPStrategy": "dataflux_ckpt.strategies",
    "DatafluxModelParallelStrategy": "dataflux_ckpt.strategies",
    "DatafluxStorageReader": "dataflux_ckpt.dcp",
    "DatafluxStorageWriter": "dataflux_ckpt.dcp",
    "ObjectReader": "dataflux_ckpt.download",
    "FakeGcsServer": "dataflux_ckpt.emulator",
    "DataCorruptionError": "dataflux_ckpt.errors",
    "TransferError": "dataflux_ckpt.errors",
    "GcsPath": "dataflux_ckpt.paths",
    "parse_gcs_path": "dataflux_ckpt.paths",
    "RetryPolicy": "dataflux_ckpt.retry",
    "ObjectWriter": "dataflux_ckpt.upload",
    "StreamingWriter": "dataflux_ckpt.upload",
    "XmlMultipartServer": "dataflux_ckpt.xml_server",
}

__all__ = [
    "CHUNK_SIZE_BYTES",
    "MAX_WORKERS",
    "STREAM_CHUNK_SIZE_BYTES",
    "DataCorruptionError",
    "DatafluxCheckpointIO",
    "DatafluxFSDPStrategy",
    "DatafluxModelParallelStrategy",
    "DatafluxStorageReader",
    "DatafluxStorageWriter",
    "FakeGcsServer",
    "GcsPath",
    "ObjectReader",
    "ObjectWriter",
    "RetryPolicy",
    "StreamingWriter",
    "TransferError",
    "XmlMultipartServer",
    "parse_gcs_path",
    "reader",
    "writer",
]

if TYPE_CHECKING:
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
    from dataflux_ckpt.emulator import FakeGcsServer
    from dataflux_ckpt.errors import DataCorruptionError, TransferError
    from dataflux_ckpt.paths import GcsPath, parse_gcs_path
    from dataflux_ckpt.retry import RetryPolicy
    from dataflux_ckpt.strategies import DatafluxFSDPStrategy, DatafluxModelParallelStrategy
    from dataflux_ckpt.upload import ObjectWriter, StreamingWriter
    from dataflux_ckpt.xml_server import XmlMultipartServer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
