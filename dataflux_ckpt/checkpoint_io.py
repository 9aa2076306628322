"""``DatafluxCheckpointIO``: Lightning checkpoints on Google Cloud Storage (``gs://bucket/key``)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from google.cloud import storage
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from dataflux_ckpt.download import ObjectReader
from dataflux_ckpt.gcs import Gcs, make_client
from dataflux_ckpt.paths import parse_gcs_path
from dataflux_ckpt.retry import RetryPolicy
from dataflux_ckpt.upload import UPLOAD_MODES, ObjectWriter, StreamingWriter, parts_prefix

log = logging.getLogger(__name__)

CHUNK_SIZE_BYTES = 32 * 2**20
MAX_WORKERS = 8
# Without the transfer manager each resumable-upload request carries this much. Larger requests
# mean fewer round trips; fake-gcs-server also re-hashes the whole object on every request.
STREAM_CHUNK_SIZE_BYTES = 128 * 2**20
RESUMABLE_CHUNK_MULTIPLE_BYTES = 256 * 2**10


class DatafluxCheckpointIO(CheckpointIO):
    """Save and load Lightning checkpoints at ``gs://bucket/key`` paths.

    Args:
        project_name: GCS project of the client created from the environment.
        storage_client: a ``google.cloud.storage.Client`` to use in this process; it is not pickled,
            a copy of the plugin in another process makes its own client from the environment.
        use_transfer_manager: parallel part uploads and ranged downloads; ``False`` streams each
            checkpoint through one resumable upload / one GET.
        chunk_size: bytes per part and per ranged read (transfer manager).
        stream_chunk_size: bytes per request of the resumable upload (no transfer manager); a
            multiple of 256 KiB. Up to four such buffers are alive during a save: two being filled
            and sent, the resumable upload's own buffer, and the request body it cuts from it.
        max_workers: concurrent part uploads / ranged reads.
        upload_mode: ``"auto"`` (probe XML multipart once per bucket, else composite uploads),
            ``"xml"`` or ``"composite"``.
        retry: retry policy for each request (part, range, compose, ...).
    """

    def __init__(
        self,
        project_name: str | None = None,
        storage_client: storage.Client | None = None,
        use_transfer_manager: bool = True,
        chunk_size: int = CHUNK_SIZE_BYTES,
        max_workers: int = MAX_WORKERS,
        stream_chunk_size: int = STREAM_CHUNK_SIZE_BYTES,
        upload_mode: str = "auto",
        retry: RetryPolicy | None = None,
    ) -> None:
        if upload_mode not in UPLOAD_MODES:
            raise ValueError(f"upload_mode must be one of {UPLOAD_MODES}, not {upload_mode!r}")
        if chunk_size <= 0 or max_workers <= 0:
            raise ValueError(f"chunk_size ({chunk_size}) and max_workers ({max_workers}) must be positive")
        if stream_chunk_size <= 0 or stream_chunk_size % RESUMABLE_CHUNK_MULTIPLE_BYTES:
            raise ValueError(f"stream_chunk_size must be a positive multiple of "
                             f"{RESUMABLE_CHUNK_MULTIPLE_BYTES} bytes, not {stream_chunk_size}")
        self.project_name = project_name
        self.use_transfer_manager = use_transfer_manager
        self.chunk_size = chunk_size
        self.max_workers = max_workers
        self.stream_chunk_size = stream_chunk_size
        self.upload_mode = upload_mode
        self.retry = retry or RetryPolicy()
        self._client = storage_client
        self._gcs: Gcs | None = None
        self._lock = threading.Lock()

    # Pickling: the client (sockets, credentials) stays behind and is made again where needed.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_client=None, _gcs=None, _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def gcs(self) -> Gcs:
        """The GCS helper of this process, created on first use."""
        with self._lock:
            if self._gcs is None:
                client = self._client or make_client(self.project_name)
                self._gcs = Gcs(client, self.retry, self.max_workers)
            return self._gcs

    # File-likes ------------------------------------------------------------------------------
    def writer(self, path: str | os.PathLike[str]) -> ObjectWriter | StreamingWriter:
        """A writable file-like for ``path``: ``with io.writer(p) as w: torch.save(obj, w)``.

        The object is published when the ``with`` block ends normally and discarded otherwise.
        """
        target = parse_gcs_path(path)
        if self.use_transfer_manager:
            return ObjectWriter(self.gcs, target, chunk_size=self.chunk_size,
                                max_workers=self.max_workers, mode=self.upload_mode)
        return StreamingWriter(self.gcs, target, chunk_size=self.stream_chunk_size)

    def reader(self, path: str | os.PathLike[str]) -> ObjectReader:
        """A seekable readable file-like for ``path``: ``with io.reader(p) as r: torch.load(r)``.

        Raises:
            FileNotFoundError: no object at ``path``.
            DataCorruptionError: on close (or ``verify()``), when the bytes do not match their crc32c.
        """
        target = parse_gcs_path(path)
        return ObjectReader(self.gcs, target, chunk_size=self.chunk_size,
                            max_workers=self.max_workers, parallel=self.use_transfer_manager)

    # CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Serialize ``checkpoint`` with ``torch.save`` straight into ``path``.

        Raises:
            TypeError: if ``storage_options`` is given.
            ValueError: if ``path`` is not ``gs://bucket/key``.
        """
        if storage_options is not None:
            raise TypeError(f"`storage_options` are not supported by {type(self).__name__}")
        with self.writer(path) as stream:
            torch.save(checkpoint, stream)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint at ``path``; nothing is returned unless its crc32c checks out.

        Raises:
            FileNotFoundError: no object at ``path``.
            DataCorruptionError: the downloaded bytes do not match the object's crc32c.
        """
        with self.reader(path) as stream:
            try:
                checkpoint = torch.load(stream, map_location=map_location, weights_only=weights_only)
            except Exception:
                stream.verify()  # damaged bytes explain a failed unpickling better than its own error
                raise
            stream.verify()
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the object at ``path`` (and parts left by failed uploads to it); missing is fine."""
        target = parse_gcs_path(path)
        gcs = self.gcs
        for name in gcs.list_names(target.bucket, parts_prefix(target)):
            gcs.delete(target.bucket, name)
        gcs.delete(*target)
        log.debug("removed %s", target)

    def teardown(self) -> None:
        """Wait for the background deletion of part objects, then close this process' connections;
        the next use opens new ones."""
        with self._lock:
            if self._gcs is not None:
                self._gcs.wait_background()
            if self._gcs is not None and self._client is None:
                self._gcs.session.close()
                self._gcs = None


def writer(path: str | os.PathLike[str], **options: Any) -> ObjectWriter | StreamingWriter:
    """A writable file-like for ``path`` outside Lightning; ``options`` as for :class:`DatafluxCheckpointIO`."""
    return DatafluxCheckpointIO(**options).writer(path)


def reader(path: str | os.PathLike[str], **options: Any) -> ObjectReader:
    """A readable file-like for ``path`` outside Lightning; ``options`` as for :class:`DatafluxCheckpointIO`."""
    return DatafluxCheckpointIO(**options).reader(path)
