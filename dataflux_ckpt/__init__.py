"""Google Cloud Storage checkpointing for PyTorch Lightning (``gs://`` paths)."""

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
from dataflux_ckpt.upload import ObjectWriter, StreamingWriter

__all__ = [
    "CHUNK_SIZE_BYTES",
    "MAX_WORKERS",
    "STREAM_CHUNK_SIZE_BYTES",
    "DataCorruptionError",
    "DatafluxCheckpointIO",
    "DatafluxStorageReader",
    "DatafluxStorageWriter",
    "FakeGcsServer",
    "GcsPath",
    "ObjectReader",
    "ObjectWriter",
    "RetryPolicy",
    "StreamingWriter",
    "TransferError",
    "parse_gcs_path",
    "reader",
    "writer",
]
