"""``DatafluxCheckpointIO``: Lightning checkpoints on Google Cloud Storage (``gs://bucket/key``)."""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
import zipfile
from collections.abc import Sequence
from typing import Any

import torch
from google.cloud import storage
from typing_extensions import override

from dataflux_ckpt.download import ObjectReader, RangedReader
from dataflux_ckpt.errors import BucketNotFoundError, InvalidCheckpointError
from dataflux_ckpt.gcs import CONNECT_TIMEOUT_S, Gcs, make_client
from dataflux_ckpt.options import (
    CHUNK_SIZE_BYTES,
    MAX_WORKERS,
    RESUMABLE_CHUNK_MULTIPLE_BYTES,
    STREAM_CHUNK_SIZE_BYTES,
    TransferOptions,
    option_property,
    resolve_options,
)
from dataflux_ckpt.paths import GcsPath, check_bucket_name, parse_gcs_path, parse_gcs_prefix
from dataflux_ckpt.retry import Deadline, RetryPolicy
from dataflux_ckpt.upload import (
    PARTS_SUFFIX,
    ObjectWriter,
    StreamingWriter,
    sweep_dead_uploads,
    sweep_stale_parts,
)
from lightning_storage_plugins import _torch_compat as _load_compat
from lightning_storage_plugins._lightning_compat import is_launcher_handback_path
from lightning_storage_plugins.messages import plain_text
from lightning_storage_plugins.ordering import CheckpointDir, OrderedCheckpointIO, remove_local
from lightning_storage_plugins.ziparchive import ZIP_MAGIC, read_directory, torch_format_problem

log = logging.getLogger(__name__)

__all__ = [
    "CHUNK_SIZE_BYTES",
    "MAX_WORKERS",
    "RESUMABLE_CHUNK_MULTIPLE_BYTES",
    "STREAM_CHUNK_SIZE_BYTES",
    "DatafluxCheckpointIO",
    "reader",
    "writer",
]

# A checkpoint's place: an object, or the local file through which Lightning's own launchers hand
# rank 0's weights back to the main process (``ddp_spawn``: ``<tmp>/.temp.ckpt``).
_Target = GcsPath | str


def _check_torch_format(stream: RangedReader) -> None:
    """Refuse, naming the object, what ``torch.load`` could only fail on with a misleading message.

    Raises:
        InvalidCheckpointError: the object is empty, truncated (a zip archive without its central
            directory), or neither torch's zip format nor its legacy format.
    """
    problem = torch_format_problem(stream.pread, stream.size, stream.path.uri, "object")
    if problem is not None:
        raise InvalidCheckpointError(problem)
    stream.seek(0)


def _load_object(stream: RangedReader, map_location: Any = None, weights_only: bool | None = None) -> Any:
    """What ``torch.load(stream, map_location, weights_only=weights_only)`` returns, unpickled while the
    download goes on, with CPU tensors as views of the downloaded buffer instead of copies of it.

    torch's own rules decide what loads: ``weights_only`` (``None``: torch's default) allows and
    refuses exactly what ``torch.load`` does. Each storage must be exactly the bytes its tensor needs,
    inside the object, and no two storages may share bytes. Nothing is returned before the whole
    object has arrived and its crc32c matched. The buffer stays in memory as long as any loaded
    tensor does (``torch.load(mmap=True)`` behaves the same way for files).

    Raises:
        pickle.UnpicklingError: ``weights_only`` refused something in the object.
        zipfile.BadZipFile / RuntimeError / ValueError: the object is not a well-formed torch archive.
        DataCorruptionError, DeadlineExceededError, TransferError: from the download.
    """
    weights_only = _load_compat.resolve_weights_only(weights_only)
    if stream.pread(len(ZIP_MAGIC), 0) != ZIP_MAGIC:  # torch's legacy format: torch.load reads it
        stream.seek(0)
        return torch.load(stream, map_location=map_location, weights_only=weights_only)
    archive = _load_compat.open_reader(stream)
    if _load_compat.is_torchscript(archive):
        stream.seek(0)
        return torch.load(stream, map_location=map_location, weights_only=weights_only)
    if "data.pkl" not in archive.get_all_records():
        raise zipfile.BadZipFile(f"{stream.path.uri}: a zip archive without data.pkl (not written by torch.save)")
    entries = _load_compat.data_entries(read_directory(stream.pread, stream.size), stream.size)
    located: dict[str, tuple[int, int]] = {}

    def locate(name: str) -> tuple[int, int] | None:
        entry = entries.get(name)
        if entry is None:
            return None
        header_offset, size = entry
        header = stream.pread(_load_compat.LOCAL_HEADER_BYTES, header_offset)
        offset = _load_compat.data_offset(header, 0, header_offset, name)
        _load_compat.check_records([(offset, size, name)], stream.size)
        located[name] = (offset, size)
        return offset, size

    table = _load_compat.StorageTable(archive, locate, whole=stream.untyped_storage())
    loaded = _load_compat.unpickle(table, map_location, weights_only, stream.path.uri, data_ready=stream.verify)
    stream.verify()
    # Storages are views: two records over the same bytes would alias where torch.load's copies do not.
    _load_compat.check_records(sorted((offset, size, name) for name, (offset, size) in located.items()),
                               stream.size)
    return loaded


def _load_checkpoint(stream: RangedReader, map_location: Any, weights_only: bool | None) -> Any:
    """The checkpoint ``stream`` holds, once its bytes are checked; errors name the checkpoint, and
    damaged bytes are reported as such rather than as what torch made of them.

    Raises:
        InvalidCheckpointError: not a torch checkpoint, or one torch cannot load.
        pickle.UnpicklingError: ``weights_only`` refused something in it.
        DataCorruptionError, DeadlineExceededError, TransferError: from the stream.
    """
    uri = stream.path.uri
    try:
        _check_torch_format(stream)
    except InvalidCheckpointError:
        stream.verify()  # damaged bytes in transit explain it better
        raise
    try:
        checkpoint = _load_object(stream, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        stream.raise_if_failed()
        stream.verify()  # damaged bytes explain a failed unpickling better than its own error
        raise pickle.UnpicklingError(f"{uri}: {plain_text(str(exc))}") from exc
    except _load_compat.LOAD_FAILURES as exc:
        stream.raise_if_failed()
        stream.verify()
        raise InvalidCheckpointError(
            f"{uri} could not be loaded as a torch checkpoint: {plain_text(str(exc))}") from exc
    except Exception:
        stream.raise_if_failed()  # the stream's own error, not what torch made of it
        raise
    stream.verify()
    return checkpoint


class DatafluxCheckpointIO(OrderedCheckpointIO[_Target]):
    """Save and load Lightning checkpoints at ``gs://bucket/key`` paths.

    When training starts, the bucket of each ``ModelCheckpoint`` directory is looked up, so that a
    missing bucket or a local directory is reported before the first step, not at the first save.
    Local paths are taken only where Lightning's own launchers put them (``ddp_spawn`` hands rank
    0's weights back through ``<tmp>/.temp.ckpt``).

    Args:
        project_name: GCS project of the client created from the environment.
        storage_client: a ``google.cloud.storage.Client`` to use in this process; it is not pickled,
            a copy of the plugin in another process makes its own client from the environment.
        use_transfer_manager: parallel part uploads and ranged downloads; ``False`` streams each
            checkpoint through one resumable upload / one GET.
        chunk_size, max_workers, stream_chunk_size, upload_mode, retry, deadline_s, request_timeout_s,
            cleanup_timeout_s: as the fields of :class:`~dataflux_ckpt.TransferOptions` (their
            defaults where not given); or give them all as ``options``.
        options: the transfer options (part size, parallelism, upload mode, retries, deadlines).
        weights_only: what ``load_checkpoint`` passes to ``torch.load`` when its caller passes
            ``None`` (``None``: torch's default).

    Raises:
        ValueError: an option is out of range (the message names it).
        TypeError: an option has the wrong type, an individual option conflicts with the same field
            of ``options``, or ``weights_only`` is not a bool or ``None``.
    """

    _process_local = ("_client", "_gcs", "_lock")

    def __init__(
        self,
        project_name: str | None = None,
        storage_client: storage.Client | None = None,
        use_transfer_manager: bool = True,
        chunk_size: int | None = None,
        max_workers: int | None = None,
        stream_chunk_size: int | None = None,
        upload_mode: str | None = None,
        retry: RetryPolicy | None = None,
        *,
        deadline_s: float | None = None,
        request_timeout_s: float | None = None,
        cleanup_timeout_s: float | None = None,
        options: TransferOptions | None = None,
        weights_only: bool | None = None,
    ) -> None:
        super().__init__(weights_only=weights_only)
        self.options = resolve_options(
            type(self).__name__, options, chunk_size=chunk_size, max_workers=max_workers,
            stream_chunk_size=stream_chunk_size, upload_mode=upload_mode, retry=retry, deadline_s=deadline_s,
            request_timeout_s=request_timeout_s, cleanup_timeout_s=cleanup_timeout_s)
        self.project_name = project_name
        self.use_transfer_manager = use_transfer_manager
        self._client = storage_client

    # The options' fields, read as attributes of the plugin.
    chunk_size = option_property("chunk_size", "Bytes per part and per ranged read.")
    max_workers = option_property("max_workers", "Concurrent part uploads / ranged reads.")
    stream_chunk_size = option_property("stream_chunk_size", "Bytes per request of the resumable upload.")
    upload_mode = option_property("upload_mode", '``"auto"``, ``"xml"`` or ``"composite"``.')
    retry = option_property("retry", "The retry policy of each request.")
    deadline_s = option_property("deadline_s", "Each save, load, removal and listing's deadline, in seconds.")
    request_timeout_s = option_property("request_timeout_s", "One request's wait for the server, in seconds.")
    cleanup_timeout_s = option_property("cleanup_timeout_s", "Clean-up's time limit, in seconds.")

    @override
    def _start_process_state(self) -> None:
        # A pickled copy leaves the client (sockets, credentials) behind and makes its own.
        self._gcs: Gcs | None = None
        self._lock = threading.Lock()
        super()._start_process_state()

    @property
    def gcs(self) -> Gcs:
        """The GCS helper of this process (client, connections, per-bucket upload modes), created on
        first use; :meth:`teardown` closes it."""
        with self._lock:
            if self._gcs is None:
                client = self._client or make_client(self.project_name)
                self._gcs = Gcs(client, retry=self.retry, connections=self.max_workers,
                                request_timeout_s=self.request_timeout_s,
                                connect_timeout_s=min(CONNECT_TIMEOUT_S, self.request_timeout_s))
            return self._gcs

    def _deadline(self, operation: str, target: str) -> Deadline:
        return Deadline(self.deadline_s, operation, target)

    # File-likes ------------------------------------------------------------------------------
    def writer(self, path: str | os.PathLike[str]) -> ObjectWriter | StreamingWriter:
        """A writable file-like for ``path``: ``with io.writer(p) as w: torch.save(obj, w)``.

        The object is published when the ``with`` block ends normally and discarded otherwise.

        Raises:
            ValueError: ``path`` is not ``gs://bucket/key``.
            BucketNotFoundError: the bucket does not exist.
            DeadlineExceededError: the server did not answer within ``deadline_s``.
        """
        return self._writer(parse_gcs_path(path))

    def _writer(self, target: GcsPath) -> ObjectWriter | StreamingWriter:
        options = {"deadline_s": self.deadline_s, "cleanup_timeout_s": self.cleanup_timeout_s}
        if self.use_transfer_manager:
            return ObjectWriter(self.gcs, target, chunk_size=self.chunk_size, max_workers=self.max_workers,
                                mode=self.upload_mode, **options)
        return StreamingWriter(self.gcs, target, chunk_size=self.stream_chunk_size, **options)

    def reader(self, path: str | os.PathLike[str]) -> ObjectReader:
        """A seekable readable file-like for ``path``: ``with io.reader(p) as r: torch.load(r)``.

        Raises:
            ValueError: ``path`` is not ``gs://bucket/key``.
            FileNotFoundError: no object at ``path``.
            BucketNotFoundError: the bucket does not exist.
            DataCorruptionError: on close (or ``verify()``), when the bytes do not match their crc32c.
            DeadlineExceededError: the download did not finish within ``deadline_s``.
        """
        return self._reader(parse_gcs_path(path))

    def _reader(self, target: GcsPath) -> ObjectReader:
        return ObjectReader(self.gcs, target, chunk_size=self.chunk_size, max_workers=self.max_workers,
                            parallel=self.use_transfer_manager, deadline_s=self.deadline_s)

    # The storage under OrderedCheckpointIO's save/load/remove ---------------------------------
    # save_checkpoint: nothing appears at the path unless the whole checkpoint was uploaded and its
    # crc32c checked; a failed save leaves the previous object there. Errors: ValueError (not
    # gs://bucket/key), BucketNotFoundError, ConcurrentWriteError (another writer replaced the object
    # meanwhile), DeadlineExceededError, TransferError. load_checkpoint: FileNotFoundError,
    # BucketNotFoundError, InvalidCheckpointError (empty, truncated, not a torch checkpoint),
    # WeightsOnlyError, DataCorruptionError (crc32c mismatch), DeadlineExceededError.
    @override
    def _target(self, path: str | os.PathLike[str]) -> _Target:
        if is_launcher_handback_path(path):
            return os.path.abspath(path)
        return parse_gcs_path(path)

    @override
    def _write(self, checkpoint: dict[str, Any], target: _Target) -> None:
        if isinstance(target, str):
            _save_local(checkpoint, target)
            return
        with self._writer(target) as stream:
            torch.save(checkpoint, stream)

    @override
    def _read(self, target: _Target, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        if isinstance(target, str):
            if not os.path.isfile(target):
                raise FileNotFoundError(f"Checkpoint file not found: {target}")
            return torch.load(target, map_location=map_location, weights_only=weights_only)
        with self._reader(target) as stream:
            return _load_checkpoint(stream, map_location, weights_only)

    @override
    def _delete(self, target: _Target) -> None:
        """Delete the object and the part objects that dead uploads to it left (missing is fine)."""
        if isinstance(target, str):
            remove_local(target)
            return
        deadline = self._deadline("remove", target.uri)
        gcs = self.gcs
        sweep_stale_parts(gcs, target, deadline)
        gcs.delete(target.bucket, target.key, deadline)
        log.debug("removed %s", target)

    @override
    def _stored(self, target: _Target) -> bool:
        if isinstance(target, str):
            return os.path.lexists(target)
        try:
            self.gcs.stat(target, self._deadline("stat", target.uri))
        except FileNotFoundError:
            return False
        return True

    @override
    def preflight(self, checkpoint_dirs: Sequence[CheckpointDir]) -> None:
        """Check each ``ModelCheckpoint`` directory before the first step: a ``gs://`` path whose
        bucket exists, and no ``save_last="link"`` (Lightning makes links only in local filesystems).
        Then remove the part objects that saves killed in the middle left in those directories
        (see :func:`~dataflux_ckpt.upload.sweep_dead_uploads`; never those of a save still running),
        within ``cleanup_timeout_s``; a clean-up that fails is logged, and training goes on.

        Raises:
            ValueError: a local directory, a path that is not ``gs://bucket/...``, an invalid
                bucket name, or ``save_last="link"``.
            BucketNotFoundError: the bucket does not exist.
            DeadlineExceededError: the look-up did not finish within ``deadline_s``.
        """
        for checkpoint_dir in checkpoint_dirs:
            dirpath = checkpoint_dir.dirpath
            if "://" not in dirpath and not dirpath.startswith(("gs:/", "gcs:/")):
                raise ValueError(
                    f"{type(self).__name__} saves checkpoints to gs://bucket/...; ModelCheckpoint's directory "
                    f"{dirpath!r} is a local path (give ModelCheckpoint(dirpath='gs://bucket/...') or "
                    "Trainer(default_root_dir='gs://bucket/...'))")
            if not dirpath.startswith("gs://"):
                # Lightning resolves the directory through fsspec, which knows gs:// (gcsfs) but
                # lists and removes nothing under other spellings.
                raise ValueError(f"ModelCheckpoint's directory {dirpath!r} must start with gs:// "
                                 f"(the scheme {type(self).__name__} saves to)")
            prefix = parse_gcs_prefix(dirpath)
            check_bucket_name(prefix.bucket)
            if checkpoint_dir.links:
                raise ValueError(
                    f"ModelCheckpoint(save_last='link') makes its links in the local filesystem, which "
                    f"cannot hold links to {prefix.uri}; use save_last=True with {type(self).__name__}")
            if self.gcs.bucket_exists(prefix.bucket, self._deadline("look-up", prefix.uri)) is False:
                raise BucketNotFoundError(
                    f"bucket {prefix.bucket!r} of ModelCheckpoint's directory {dirpath} does not exist")
            self._sweep_directory(prefix)

    def _sweep_directory(self, prefix: GcsPath) -> None:
        """Remove the part objects of uploads under ``prefix`` that are over; log a failure."""
        directory = GcsPath(prefix.bucket, prefix.key.rstrip("/") + "/" if prefix.key.strip("/") else "")
        deadline = Deadline(self.cleanup_timeout_s, "removal of part objects left by killed saves", directory.uri)
        try:
            removed = sweep_dead_uploads(self.gcs, directory, deadline)
        except Exception as exc:
            log.warning("could not remove the part objects killed saves left under %s: %s", directory.uri, exc)
            return
        if removed:
            log.info("removed %d part objects that killed saves left under %s", removed, directory.uri)

    def last_checkpoints(self, directory: str) -> dict[str, str]:
        """Copies of ``directory``'s ``last`` checkpoints that a listing of ``directory`` does not
        show, by their ``gs://`` path (for ``ckpt_path="last"``): none here, where every checkpoint
        is an object of the directory; a tiered plugin's local copies."""
        return {}

    def list_checkpoints(self, prefix: str | os.PathLike[str]) -> list[str]:
        """The ``gs://`` paths of the objects under ``prefix`` (``gs://bucket/dir/``), sorted; part
        objects of uploads in progress are left out.

        Raises:
            ValueError: ``prefix`` is not ``gs://bucket`` or ``gs://bucket/...``.
            BucketNotFoundError: the bucket does not exist.
            DeadlineExceededError: the listing did not finish within ``deadline_s``.
        """
        target = parse_gcs_prefix(prefix)
        names = self.gcs.list_names(target.bucket, target.key, self._deadline("listing", target.uri))
        return sorted(GcsPath(target.bucket, name).uri for name in names if PARTS_SUFFIX not in name)

    @override
    def _close(self) -> None:
        """Wait (up to ``cleanup_timeout_s``) for the background deletion of part objects, then
        close this process' connections; the next use opens new ones."""
        with self._lock:
            gcs, self._gcs = self._gcs, None
        if gcs is not None and not gcs.close(self.cleanup_timeout_s, close_session=self._client is None):
            log.warning("background deletion of part objects did not finish within %g s; what is left is "
                        "removed by later saves", self.cleanup_timeout_s)


def _save_local(checkpoint: dict[str, Any], path: str) -> None:
    """``torch.save`` to a temporary file beside ``path``, then renamed over it (the previous file
    stays until the new one is whole)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as stream:
            torch.save(checkpoint, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def writer(path: str | os.PathLike[str], **options: Any) -> ObjectWriter | StreamingWriter:
    """A writable file-like for ``path`` outside Lightning; ``options`` as for :class:`DatafluxCheckpointIO`.

    Raises:
        As :meth:`DatafluxCheckpointIO.writer`.
    """
    return DatafluxCheckpointIO(**options).writer(path)


def reader(path: str | os.PathLike[str], **options: Any) -> ObjectReader:
    """A readable file-like for ``path`` outside Lightning; ``options`` as for :class:`DatafluxCheckpointIO`.

    Raises:
        As :meth:`DatafluxCheckpointIO.reader`.
    """
    return DatafluxCheckpointIO(**options).reader(path)
