"""``TieredCheckpointIO``: training waits for the local NVMe, and the checkpoint still ends up in GCS.

A save writes the checkpoint once, with FastPersist, under ``local_dir`` (the *local tier*) and
returns; the file is then uploaded to its ``gs://`` path in the background, as the file it is
(parallel parts, crc32c, the atomic publish and generation precondition of every Dataflux upload).
A load reads the newest whole copy: the local file when its bytes match its manifest, else GCS.

The local tier, one flat directory::

    <key>.manifest                the checkpoint's current version: its URI, size, crc32c, whether
                                  it goes to GCS and, once published there, the generation holding it
    <key>-<version>-<name>        the version's bytes (a file ``torch.load`` reads)

``<key>`` is a digest of the ``gs://`` URI, ``<version>`` a random id per save. The manifest is the
commit point. A save writes the new version's file (FastPersist: temporary name, fsync, rename),
then the manifest (temporary name, fsync, rename), then drops the previous version's file. A crash
at any point leaves a manifest naming a whole file (old or new), and files no manifest names, which
the next writer removes. The crc32c is taken in the background right after the save (training does
not wait for a second pass over the file); a manifest without it names a file FastPersist renamed
into place only once it was whole, and it is checked by size until the checksum is recorded.

*Durable* means: the version's bytes are published in GCS. The manifest records that only after
the publish succeeded (with the generation that holds it), so a crash never makes a local-only
checkpoint look durable. A crash between the publish and that record is found on restart, when the
object in GCS has the version's size and crc32c.

The local copy is the newest unless GCS holds another writer's newer object (another node saved
there since): before an upload starts, the crc32c of the version it uploads is recorded in the
manifest, and after a publish its generation, so an object in GCS with one of those checksums, or of
that generation or an older one, is this tier's own, never newer (an older save's upload may
publish after newer saves returned); any other one is newer when it was created after the local save.

One process writes to a local tier at a time (an exclusive ``flock`` on ``.tiered.lock``, taken at
its first save and released at teardown); it first finishes the uploads a crashed writer left
pending and removes what the crash left behind. Any process may read.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from dataflux_ckpt.checkpoint_io import DatafluxCheckpointIO, _load_checkpoint, _Target
from dataflux_ckpt.checksums import crc32c_b64
from dataflux_ckpt.download import DEADLINE_S, RangedReader
from dataflux_ckpt.errors import ConcurrentWriteError, DataCorruptionError
from dataflux_ckpt.mapped import file_crc32c, map_file, read_ahead
from dataflux_ckpt.paths import GcsPath, parse_gcs_path
from dataflux_ckpt.retry import Deadline
from dataflux_ckpt.upload import UploadStopped, upload_file
from lightning_storage_plugins.ordering import CheckpointDir, remove_local

if TYPE_CHECKING:

    from fastpersist import FastPersistContext

__all__ = [
    "LocalTierFullError",
    "LocalTierInUseError",
    "Manifest",
    "ManifestError",
    "TieredCheckpointIO",
    "TieredCheckpointMonitor",
    "TieredOptions",
    "TieredStats",
]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
MANIFEST_SUFFIX = ".manifest"
MANIFEST_TEMP_SUFFIX = ".manifest-tmp"
# The manifest of an older version of a checkpoint that still owes GCS its upload (see _LocalTier).
PENDING_SUFFIX = ".pending"
LOCK_NAME = ".tiered.lock"
KEY_HEX = 20
VERSION_HEX = 16
SLUG_MAX = 80
UPLOADED_KEPT = 64
DEFAULT_KEEP_LOCAL = 2
DEFAULT_TEARDOWN_TIMEOUT_S = 1800.0
DEFAULT_IO_BUFFER_MB = 256
# Room a save makes beyond FastPersist's estimate of its file: the pickle and the zip records of a
# checkpoint of many small tensors take more than the estimate counts for them.
ROOM_MARGIN_BYTES = 1 * 2**20
LOCAL_READ_THREADS = 4
# A local load reads its file this much at a time per thread; unpickling follows the reads.
LOCAL_RANGE_BYTES = 8 * 2**20
# A failed upload is tried again after this long, doubling up to the maximum.
RETRY_INITIAL_S = 1.0
RETRY_MAX_S = 60.0
PROGRESS_EVERY_S = 30.0
# How long a load waits for GCS to say whether it holds a newer copy than the local tier.
NEWER_CHECK_TIMEOUT_S = 10.0

_DATA_RE = re.compile(rf"^(?P<key>[0-9a-f]{{{KEY_HEX}}})-(?P<version>[0-9a-f]{{{VERSION_HEX}}})-")
_MANIFEST_RE = re.compile(rf"^(?P<key>[0-9a-f]{{{KEY_HEX}}}){re.escape(MANIFEST_SUFFIX)}$")
_PENDING_RE = re.compile(rf"^(?P<key>[0-9a-f]{{{KEY_HEX}}}){re.escape(PENDING_SUFFIX)}$")
_VERSION_RE = re.compile(rf"^[0-9a-f]{{{VERSION_HEX}}}$")
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")
_NVME_HINT = ("{user} writes its local tier with FastPersist and needs the [nvme] extra as well as "
              "[gcs]: pip install 'lightning-storage-plugins[gcs,nvme]'")


def _fastpersist(engine: str | None, user: str = "TieredCheckpointIO") -> ModuleType:
    """The ``fastpersist`` package, imported on first use so that ``import dataflux_ckpt`` needs only ``[gcs]``.

    Raises:
        ImportError: fastpersist cannot be imported, or DeepSpeed (its ``aio`` engine) is not
            installed and ``engine`` is not ``"python"``; the message names the ``[nvme]`` extra
            and ``user``, what needs it.
    """
    hint = _NVME_HINT.format(user=user)
    try:
        import fastpersist
    except ImportError as exc:
        raise ImportError(f"{hint} ({exc})", name=exc.name) from exc
    if engine != "python":
        import importlib.util

        try:
            found = importlib.util.find_spec("deepspeed") is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules
            found = False
        if not found:
            raise ImportError(f"{hint} (DeepSpeed, for the aio engine, is not installed; "
                              "engine='python' writes the local tier without it)", name="deepspeed")
    return fastpersist


# Errors ------------------------------------------------------------------------------------------
class LocalTierFullError(OSError):
    """The local tier's filesystem has no room for a checkpoint; raised before anything is written.

    ``errno`` is ``ENOSPC``; the message names the directory, the bytes free and the bytes needed.
    """


class LocalTierInUseError(RuntimeError):
    """Another live process writes to this local tier (each writer needs a ``local_dir`` of its own)."""


class ManifestError(ValueError):
    """A manifest is not one this version writes; the message names the field."""


# Options -----------------------------------------------------------------------------------------
def _check_count(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"TieredOptions.{name} must be an int, not {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"TieredOptions.{name} must be at least 1, not {value!r}")


@dataclass(frozen=True)
class TieredOptions:
    """Where and how :class:`TieredCheckpointIO` keeps its local tier; checked when made.

    Raises:
        TypeError: a field has the wrong type (the message names it).
        ValueError: a field is out of range (the message names it).
    """

    local_dir: str
    """The local tier's directory (on the node's NVMe); created on the first save."""

    remote_every: int = 1
    """Upload every N-th save round to GCS (``1``: every one). Saves of the same ``global_step``
    (a step's checkpoint and ``last.ckpt``) are one round."""

    keep_local: int | None = DEFAULT_KEEP_LOCAL
    """The local tier keeps the newest K checkpoints (``None``: as many as ``ModelCheckpoint``
    keeps); older ones leave it once their upload is over (a checkpoint never uploaded is then gone)."""

    min_free_bytes: int = 0
    """Bytes a save leaves free on the local filesystem; a save that would need them is refused."""

    teardown_timeout_s: float = DEFAULT_TEARDOWN_TIMEOUT_S
    """How long ``teardown`` waits for the uploads in flight before leaving them to the next writer."""

    io_buffer_mb: float = DEFAULT_IO_BUFFER_MB
    """FastPersist's staging buffer, in MiB."""

    engine: str | None = None
    """FastPersist's engine: ``"aio"`` (default), ``"python"`` (no DeepSpeed) or ``"gds"``."""

    def __post_init__(self) -> None:
        if not isinstance(self.local_dir, (str, os.PathLike)) or not os.fspath(self.local_dir):
            raise TypeError(f"TieredOptions.local_dir must be a local directory path, not {self.local_dir!r}")
        local_dir = os.fspath(self.local_dir)
        if "://" in local_dir:
            raise ValueError(f"TieredOptions.local_dir must be a local directory (on the node's NVMe), "
                             f"not the URL {local_dir!r}")
        object.__setattr__(self, "local_dir", os.path.abspath(local_dir))
        _check_count("remote_every", self.remote_every)
        _check_count("keep_local", self.keep_local, optional=True)
        if isinstance(self.min_free_bytes, bool) or not isinstance(self.min_free_bytes, int):
            raise TypeError(f"TieredOptions.min_free_bytes must be an int, not {self.min_free_bytes!r}")
        if self.min_free_bytes < 0:
            raise ValueError(f"TieredOptions.min_free_bytes must not be negative, not {self.min_free_bytes!r}")
        for name in ("teardown_timeout_s", "io_buffer_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"TieredOptions.{name} must be a number, not {type(value).__name__} {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"TieredOptions.{name} must be positive and finite, not {value!r}")
        if self.engine not in (None, "auto", "aio", "python", "gds"):
            raise ValueError(f"TieredOptions.engine must be 'aio', 'python' or 'gds', not {self.engine!r}")


# The manifest ------------------------------------------------------------------------------------
def _crc_text(value: Any) -> str | None:
    """``value`` if it is GCS's form of a crc32c (base64 of 4 big-endian bytes), else ``None``."""
    if not isinstance(value, str):
        return None
    try:
        return value if len(base64.b64decode(value, validate=True)) == 4 else None
    except (binascii.Error, ValueError):
        return None


def _optional_generation(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ManifestError(f"manifest field {name!r} must be a positive generation or null, not {value!r}")
    return value


@dataclass(frozen=True)
class Manifest:
    """What the local tier knows of one checkpoint's current version.

    Raises:
        ManifestError: a field is missing, of the wrong type or out of range (the message names it).
    """

    uri: str
    """The checkpoint's ``gs://bucket/key``."""
    version: str
    """The version's id (16 hex digits), part of its file's name."""
    size: int
    """The version's bytes."""
    crc32c: str | None
    """Their crc32c in GCS's form (base64); ``None`` until taken, right after the save."""
    saved_at: float
    """When the save finished writing (seconds since the epoch)."""
    remote: bool
    """Whether this version goes to GCS."""
    durable_generation: int | None = None
    """The GCS generation holding this version, once published (``None``: not durable)."""
    uploaded_crc32c: tuple[str, ...] = ()
    """The crc32c of the versions of this URI the local tier uploads or uploaded (the newest
    ``UPLOADED_KEPT``), each recorded when its upload starts: an object in GCS with one of them
    is this tier's own, never newer than the local copy."""
    published_generation: int | None = None
    """The newest GCS generation this local tier published for this URI, of this version or an
    older one: an object in GCS of that generation or an older one is not newer than the local copy."""

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str):
            raise ManifestError(f"manifest field 'uri' must be a gs:// URI, not {self.uri!r}")
        try:
            parse_gcs_path(self.uri)
        except ValueError as exc:
            raise ManifestError(f"manifest field 'uri': {exc}") from None
        if not isinstance(self.version, str) or not _VERSION_RE.match(self.version):
            raise ManifestError(f"manifest field 'version' must be {VERSION_HEX} hex digits, not {self.version!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ManifestError(f"manifest field 'size' must be a byte count, not {self.size!r}")
        if self.crc32c is not None and _crc_text(self.crc32c) is None:
            raise ManifestError(f"manifest field 'crc32c' must be a base64 crc32c or null, not {self.crc32c!r}")
        if (isinstance(self.saved_at, bool) or not isinstance(self.saved_at, (int, float))
                or not math.isfinite(self.saved_at) or self.saved_at < 0):
            raise ManifestError(f"manifest field 'saved_at' must be a time, not {self.saved_at!r}")
        if not isinstance(self.remote, bool):
            raise ManifestError(f"manifest field 'remote' must be true or false, not {self.remote!r}")
        _optional_generation("durable_generation", self.durable_generation)
        _optional_generation("published_generation", self.published_generation)
        uploaded = self.uploaded_crc32c
        if isinstance(uploaded, list):
            uploaded = tuple(uploaded)
            object.__setattr__(self, "uploaded_crc32c", uploaded)
        if (not isinstance(uploaded, tuple) or len(uploaded) > UPLOADED_KEPT
                or any(_crc_text(crc) is None for crc in uploaded)):
            raise ManifestError(f"manifest field 'uploaded_crc32c' must be a list of at most {UPLOADED_KEPT} "
                                f"base64 crc32c, not {self.uploaded_crc32c!r}")

    @property
    def durable(self) -> bool:
        """Whether this version is published in GCS."""
        return self.durable_generation is not None

    def replace(self, **changes: Any) -> Manifest:
        """A copy with ``changes`` (checked like a new one)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> bytes:
        """The manifest as stored."""
        return json.dumps({"format": MANIFEST_FORMAT, **dataclasses.asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a stored manifest.

        Raises:
            ManifestError: not JSON, another format, an unknown or missing field, or a bad value.
        """
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ManifestError(f"not a manifest: {exc}") from None
        if not isinstance(fields, dict):
            raise ManifestError(f"not a manifest: a JSON {type(fields).__name__}, not an object")
        if fields.pop("format", None) != MANIFEST_FORMAT:
            raise ManifestError(f"not a manifest of format {MANIFEST_FORMAT}")
        known = {field.name for field in dataclasses.fields(cls)}
        if set(fields) - known or not {"uri", "version", "size", "crc32c", "saved_at", "remote"} <= set(fields):
            raise ManifestError(f"manifest fields {sorted(fields)} are not {sorted(known)}")
        return cls(**fields)


# The local tier's files --------------------------------------------------------------------------
def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _write_atomically(path: str, data: bytes, temporary: str) -> None:
    """Create or replace ``path`` with ``data`` in one step: written to ``temporary`` (in the same
    directory), fsynced, renamed over ``path``, and the directory fsynced."""
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        _unlink_quietly(temporary)
        raise
    _fsync_dir(os.path.dirname(path))


class _LocalTier:
    """The files of one local tier directory: names, manifests (written atomically), free space.

    Each checkpoint (``key``) has a manifest naming its current version. A version that goes to GCS and
    is replaced on the node by a save that stays there (``remote_every``) before its upload is over is
    kept, with a second manifest (``<key>.pending``), until that upload ends: a writer that dies leaves
    it for the next one to upload.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    @staticmethod
    def key(uri: str) -> str:
        return hashlib.sha256(uri.encode()).hexdigest()[:KEY_HEX]

    def manifest_path(self, key: str) -> str:
        return os.path.join(self.directory, key + MANIFEST_SUFFIX)

    def data_path(self, key: str, version: str, uri: str) -> str:
        name = _SLUG_UNSAFE.sub("_", uri.rsplit("/", 1)[-1])[:SLUG_MAX]
        return os.path.join(self.directory, f"{key}-{version}-{name}")

    def key_of(self, path: str) -> str | None:
        """The key of a version's file in this tier (``None`` for any other path)."""
        if os.path.dirname(os.path.abspath(path)) != self.directory:
            return None
        match = _DATA_RE.match(os.path.basename(path))
        return match["key"] if match else None

    def pending_path(self, key: str) -> str:
        return os.path.join(self.directory, key + PENDING_SUFFIX)

    def read(self, key: str) -> Manifest | None:
        """The manifest of ``key``; ``None`` when there is none, or it is unreadable (logged)."""
        return self._read(self.manifest_path(key))

    def read_pending(self, key: str) -> Manifest | None:
        """The older version of ``key`` that still owes GCS its upload, if any."""
        return self._read(self.pending_path(key))

    @staticmethod
    def _read(path: str) -> Manifest | None:
        try:
            with open(path, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return None
        try:
            return Manifest.from_json(data)
        except ManifestError as exc:
            log.warning("ignoring the local tier's manifest %s: %s", path, exc)
            return None

    def write(self, key: str, manifest: Manifest) -> None:
        """Replace the manifest of ``key`` atomically (temporary name, fsync, rename, fsync the directory)."""
        self._write(self.manifest_path(key), key, manifest)

    def write_pending(self, key: str, manifest: Manifest) -> None:
        """Record ``manifest``'s version (older than the current one) as owing GCS its upload."""
        self._write(self.pending_path(key), key, manifest)

    def _write(self, path: str, key: str, manifest: Manifest) -> None:
        temporary = os.path.join(self.directory, f".{key}.{uuid.uuid4().hex[:8]}{MANIFEST_TEMP_SUFFIX}")
        _write_atomically(path, manifest.to_json(), temporary)

    def remove_pending(self, key: str) -> None:
        """Forget the pending upload of ``key``, and remove its version's file unless the manifest of
        ``key`` names that version too."""
        pending = self.read_pending(key)
        _unlink_quietly(self.pending_path(key))
        if pending is not None and ((current := self.read(key)) is None or current.version != pending.version):
            remove_local(self.data_path(key, pending.version, pending.uri))

    def files_of(self, key: str) -> list[str]:
        """The version files of ``key`` (whatever their version)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return [os.path.join(self.directory, name) for name in names if name.startswith(key + "-")]

    def remove(self, key: str, *, free_now: bool = False) -> None:
        """Remove the checkpoint ``key``: its manifest first (the local copy is gone), then its files,
        whose blocks are freed after this returns (``free_now``: before). A pending upload is forgotten
        first: without the manifest it would bring a removed checkpoint back to GCS."""
        _unlink_quietly(self.pending_path(key))
        _unlink_quietly(self.manifest_path(key))
        for path in self.files_of(key):
            if free_now:
                _unlink_quietly(path)
            else:
                remove_local(path)

    def remove_other_versions(self, key: str, version: str, keep: Sequence[str] = ()) -> None:
        """Remove the files of ``key``'s versions other than ``version`` and those in ``keep``."""
        for path in self.files_of(key):
            match = _DATA_RE.match(os.path.basename(path))
            if match is None or (match["version"] != version and match["version"] not in keep):
                remove_local(path)

    def manifests(self) -> dict[str, Manifest]:
        """Every readable manifest, by key."""
        return self._manifests(_MANIFEST_RE, self.read)

    def pending_manifests(self) -> dict[str, Manifest]:
        """Every readable pending manifest (an older version owing GCS its upload), by key."""
        return self._manifests(_PENDING_RE, self.read_pending)

    def _manifests(self, pattern: re.Pattern[str], read: Callable[[str], Manifest | None]) -> dict[str, Manifest]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        found = {}
        for name in names:
            match = pattern.match(name)
            if match and (manifest := read(match["key"])) is not None:
                found[match["key"]] = manifest
        return found

    def remove_leftovers(self) -> int:
        """Remove what a crashed writer left: manifest temporaries and files no manifest names."""
        manifests = self.manifests()
        pending = self.pending_manifests()
        for key in set(pending) - set(manifests):  # a removal that died half-way
            _unlink_quietly(self.pending_path(key))
            del pending[key]
        removed = 0
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.startswith(".") and name.endswith(MANIFEST_TEMP_SUFFIX):
                _unlink_quietly(path)
                removed += 1
                continue
            match = _DATA_RE.match(name)
            if match is None:
                continue
            named = {m.version for m in (manifests.get(match["key"]), pending.get(match["key"])) if m is not None}
            if match["version"] not in named:
                remove_local(path)
                removed += 1
        return removed

    def free_bytes(self) -> int:
        stats = os.statvfs(self.directory)
        return stats.f_bavail * stats.f_frsize


# Reading a local copy ----------------------------------------------------------------------------
class _LocalCopy(RangedReader):
    """A local tier file, mapped copy-on-write (loaded tensors are views of the page cache's pages, and
    changing them leaves the file as it is), its ranges of ``LOCAL_RANGE_BYTES`` checked by
    ``LOCAL_READ_THREADS`` threads (its end first), each range's crc32c taken as it is read from disk
    or the page cache; read like an :class:`ObjectReader`, as soon as the bytes a read touches are
    checked (a load unpickles while the rest is).

    ``path`` is the checkpoint's ``gs://`` path (a format error names the checkpoint). With ``crc32c``
    (the manifest's), :meth:`verify` and ``close()`` check the bytes against it.

    Raises:
        OSError: the file cannot be opened.
        DataCorruptionError: from reads, :meth:`verify` and ``close()``: the file ends early, or its
            bytes do not match ``crc32c``.
        DeadlineExceededError: the bytes were not read within ``deadline_s``.
    """

    def __init__(self, path: GcsPath, file_path: str, size: int, crc32c: str | None = None, *,
                 deadline_s: float = DEADLINE_S) -> None:
        self.file_path = file_path
        self._fd = os.open(file_path, os.O_RDONLY | os.O_CLOEXEC)
        mapping = None
        try:
            what = f"the local copy {file_path} of {path.uri}"
            mapping = map_file(self._fd, size, what, private=True) if size else None
            super().__init__(path, size, crc32c, range_bytes=LOCAL_RANGE_BYTES, tail_first=True,
                             deadline=Deadline(deadline_s, "load", path.uri), buffer=mapping)
            pool = ThreadPoolExecutor(LOCAL_READ_THREADS, thread_name_prefix="dataflux-tiered-read")
            self._start(pool.submit, LOCAL_READ_THREADS)
            pool.shutdown(wait=False)  # its threads end once the ranges are read
        except BaseException:
            os.close(self._fd)
            if mapping is not None:
                mapping.close()
            raise

    @override
    def _describe(self, start: int, end: int) -> str:
        return f"read of bytes {start}-{end - 1} of the local copy {self.file_path} of {self.path.uri}"

    @override
    def _fill(self, index: int, what: str) -> None:
        mapping = self._buffer
        assert isinstance(mapping, mmap.mmap)

        def arrived(block: memoryview, offset: int) -> int:
            # The bytes are mapped already: a block "arrives" once the kernel has read it ahead.
            read_ahead(mapping, offset, offset + block.nbytes)
            return block.nbytes

        self._receive(index, arrived, what)

    @override
    def _ended_early(self, what: str, got: int, total: int) -> BaseException:
        return DataCorruptionError(f"{what}: the file ends {got} bytes into these {total}")

    @override
    def _mismatch(self, actual: str) -> str:
        return (f"the local copy {self.file_path} of {self.path.uri} has crc32c {actual}, it was written with "
                f"{self._expected_crc}")

    @property
    def crc32c(self) -> str:
        """The crc32c of the file's bytes, in GCS's form (once every byte is read).

        Raises:
            OSError, DataCorruptionError, DeadlineExceededError: the file could not be read whole.
        """
        self.wait_all()
        return self._crc32c()

    @property
    def checked(self) -> bool:
        """Whether every byte was read and matched the crc32c it was written with."""
        return self._verified and self._expected_crc is not None

    @override
    def close(self) -> None:
        """Check the bytes (as :meth:`verify`, unless abandoned) and let go of the file and the buffer
        (it is unmapped once no loaded tensor is a view of it)."""
        try:
            super().close()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


# Background work ---------------------------------------------------------------------------------
class _Job:
    """One saved version: its checksum is taken, then (if it goes to GCS) it is uploaded."""

    def __init__(self, target: GcsPath, key: str, version: str, fd: int, size: int, remote: bool,
                 started: float) -> None:
        self.target, self.key, self.version, self.fd, self.size = target, key, version, fd, size
        self.remote, self.started = remote, started
        self.crc: int | None = None
        self.sealed = threading.Event()
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.uploading = False

    def close(self) -> None:
        """Let go of the version's bytes (its file descriptor kept them, even once replaced)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"{self.target.uri} (version {self.version})"


class _SaveRounds:
    """Which saves go to GCS with ``remote_every``: every N-th save round, the first round being
    the N-th. Saves given the same ``key`` one after another (Lightning's ``global_step``: a step's
    checkpoint and ``last.ckpt``) are one round, so that they go to GCS together; a save without a
    key is a round of its own."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._lock = threading.Lock()
        self._count = 0
        self._key: object = None

    def next(self, key: object = None) -> bool:
        """Count a save of round ``key``; whether it goes to GCS."""
        if isinstance(key, bool) or not isinstance(key, int):
            key = object()  # only a step number joins a save to the round before it
        with self._lock:
            if key != self._key:
                self._count += 1
                self._key = key
            return self._count % self.every == 0


class _Worker:
    """A thread that runs what is queued to it in order, until stopped."""

    def __init__(self, name: str, run: Callable[[Any], None]) -> None:
        self._run = run
        self._queue: deque[Any] = deque()
        self._condition = threading.Condition()
        self._stopping = False
        #: The item being run now (``None`` between items).
        self.current: Any = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        with self._condition:
            self._queue.append(item)
            self._condition.notify_all()

    def queued(self) -> list[Any]:
        with self._condition:
            return list(self._queue)

    def discard(self, item: Any) -> bool:
        """Take ``item`` out of the queue if it has not started; whether it was there."""
        with self._condition:
            try:
                self._queue.remove(item)
            except ValueError:
                return False
            return True

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._queue and not self._stopping:
                    self._condition.wait()
                if self._stopping:
                    return
                item = self.current = self._queue.popleft()
            try:
                self._run(item)
            except Exception:  # the work logs its own failures; this keeps the thread serving
                log.exception("tiered checkpoint background work on %r failed", item)
            finally:
                self.current = None

    def stop(self, timeout_s: float) -> None:
        """Drop what is queued, and wait (up to ``timeout_s``) for the item running now (:attr:`current`
        while it runs)."""
        with self._condition:
            self._stopping = True
            self._queue.clear()
            self._condition.notify_all()
        self._thread.join(timeout_s)

    def sleep(self, seconds: float, until: Callable[[], bool]) -> None:
        """Wait ``seconds``, or less once ``until()`` or a stop says so."""
        end = time.monotonic() + seconds
        with self._condition:
            while not self._stopping and not until() and (left := end - time.monotonic()) > 0:
                self._condition.wait(min(left, 0.5))

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def alive(self) -> bool:
        """Whether the thread still runs (an item it could not leave yet, after :meth:`stop`)."""
        return self._thread.is_alive()


@dataclass(frozen=True)
class TieredStats:
    """What :class:`TieredCheckpointIO` has done in this process (see :meth:`TieredCheckpointIO.stats`)."""

    saves: int = 0
    """Saves written to the local tier."""
    last_save_s: float | None = None
    """How long training waited for the last save (the local write), in seconds."""
    total_save_s: float = 0.0
    """How long training waited for every save together, in seconds."""
    uploads_pending: int = 0
    """Uploads to GCS not finished yet (queued, running or waiting to be tried again)."""
    uploads_done: int = 0
    """Checkpoints made durable in GCS."""
    upload_failures: int = 0
    """Upload attempts that failed (each is tried again)."""
    last_durable_s: float | None = None
    """For the last checkpoint made durable: seconds from the start of its save to its publish in GCS."""
    last_durable: str | None = None
    """The ``gs://`` path of the last checkpoint made durable."""


# The plugin --------------------------------------------------------------------------------------
class TieredCheckpointIO(DatafluxCheckpointIO):
    """Save Lightning checkpoints to the node's NVMe, and upload them to their ``gs://`` paths in the background.

    ``save_checkpoint(checkpoint, "gs://bucket/run/x.ckpt")`` writes the checkpoint once, with
    FastPersist, under ``local_dir``, and returns: training waits only for the local write. The file
    is then uploaded in the background with this plugin's transfer options (parts, parallelism,
    crc32c, deadline, the atomic publish and generation precondition of :class:`DatafluxCheckpointIO`);
    an upload that fails (GCS unreachable) is logged as a warning and tried again. ``load_checkpoint``
    reads the newest whole copy: the local one when its bytes match its manifest, else GCS.

    Paths stay the ``gs://`` ones given to ``ModelCheckpoint``; use :class:`DatafluxModelCheckpoint`
    for ``ckpt_path="last"``, which then also finds the local tier's newer ``last`` checkpoints.

    Args:
        local_dir: the local tier's directory (a node-local NVMe filesystem). One process writes to
            it at a time.
        remote_every: upload every N-th save round (``1``: every one). The saves of one
            ``global_step`` are one round.
        keep_local: the local tier keeps the newest K checkpoints (``None``: no limit of its own);
            an older one leaves it once its upload is over.
        min_free_bytes: bytes a save must leave free on the local filesystem.
        teardown_timeout_s: how long ``teardown`` waits for uploads in flight.
        io_buffer_mb: FastPersist's staging buffer (MiB).
        engine: FastPersist's engine (``"aio"``, ``"python"``, ``"gds"``; default ``"aio"``).
        **kwargs: any option of :class:`DatafluxCheckpointIO` (``options``, ``storage_client``,
            ``weights_only``...), by keyword.

    Raises:
        ImportError: the ``[nvme]`` extra (FastPersist and DeepSpeed) is not installed.
        TypeError, ValueError: an option is of the wrong type or out of range (the message names it).
    """

    _process_local = (*DatafluxCheckpointIO._process_local, "_context", "_sealer", "_uploader", "_save_lock",
                      "_state_lock", "_jobs", "_lock_fd", "_stats", "_rounds")

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        *,
        remote_every: int = 1,
        keep_local: int | None = DEFAULT_KEEP_LOCAL,
        min_free_bytes: int = 0,
        teardown_timeout_s: float = DEFAULT_TEARDOWN_TIMEOUT_S,
        io_buffer_mb: float = DEFAULT_IO_BUFFER_MB,
        engine: str | None = None,
        **kwargs: Any,
    ) -> None:
        #: The local tier's options, checked.
        self.tier_options = TieredOptions(
            local_dir=local_dir, remote_every=remote_every, keep_local=keep_local, min_free_bytes=min_free_bytes,
            teardown_timeout_s=teardown_timeout_s, io_buffer_mb=io_buffer_mb, engine=engine)
        _fastpersist(self.tier_options.engine)
        super().__init__(**kwargs)
        self._tier = _LocalTier(self.tier_options.local_dir)

    @property
    def local_dir(self) -> str:
        """The local tier's directory (absolute)."""
        return self.tier_options.local_dir

    @override
    def _start_process_state(self) -> None:
        super()._start_process_state()
        self._context: FastPersistContext | None = None
        self._sealer: _Worker | None = None
        self._uploader: _Worker | None = None
        self._save_lock = threading.RLock()  # a save entered from a signal handler waits on no one
        self._state_lock = threading.RLock()
        self._jobs: dict[str, list[_Job]] = {}
        self._lock_fd: int | None = None
        self._stats = TieredStats()
        self._rounds = _SaveRounds(self.tier_options.remote_every)
        self._pid = os.getpid()

    def _in_this_process(self) -> None:
        """Start over in a forked child: the parent's threads, lock and open files stay the parent's."""
        if self._pid != os.getpid():
            self._start_process_state()

    # Observability ---------------------------------------------------------------------------
    def stats(self) -> TieredStats:
        """What this plugin did in this process so far: saves and how long training waited for them,
        uploads pending, done and failed, and how long the last one took to become durable."""
        with self._state_lock:
            pending = sum(1 for jobs in self._jobs.values() for job in jobs if job.remote)
            return dataclasses.replace(self._stats, uploads_pending=pending)

    def _count(self, **changes: Any) -> None:
        with self._state_lock:
            self._stats = dataclasses.replace(self._stats, **changes)

    # Writing ---------------------------------------------------------------------------------
    def _start_writing(self) -> None:
        """Become the local tier's writer (once per process, until teardown): take its lock, remove
        what a crashed writer left, and queue the uploads it left pending (before any new one).

        Raises:
            LocalTierInUseError: another live process writes to this local tier.
        """
        self._in_this_process()
        with self._state_lock:
            if self._lock_fd is not None:
                return
            os.makedirs(self.local_dir, exist_ok=True)
            fd = os.open(os.path.join(self.local_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise LocalTierInUseError(
                    f"the local tier {self.local_dir} is in use by another process (pid {holder}); give each "
                    "job (and each saving rank) a local_dir of its own") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._lock_fd = fd
            _fastpersist(self.tier_options.engine).remove_stale_temporaries(self.local_dir)
            removed = self._tier.remove_leftovers()
            if removed:
                log.warning("removed %d file(s) a crashed writer left in the local tier %s", removed, self.local_dir)
            self._sealer = _Worker("dataflux-tiered-checksum", self._seal)
            self._uploader = _Worker("dataflux-tiered-upload", self._upload)
            pending = [(key, manifest) for key, manifest in self._tier.manifests().items()
                       if manifest.crc32c is None or (manifest.remote and not manifest.durable)]
            pending += self._tier.pending_manifests().items()  # older than their keys' current versions
            for key, manifest in sorted(pending, key=lambda item: item[1].saved_at):
                self._uploader.put(("recover", key, manifest))

    def _next_round(self, checkpoint: dict[str, Any]) -> bool:
        """Whether this save goes to GCS (every ``remote_every``-th round; one round per ``global_step``)."""
        return self._rounds.next(checkpoint.get("global_step") if isinstance(checkpoint, dict) else None)

    @override
    def _write(self, checkpoint: dict[str, Any], target: _Target) -> None:
        if isinstance(target, str):  # Lightning's launchers hand weights back through a local file
            super()._write(checkpoint, target)
            return
        started = time.perf_counter()
        self._start_writing()
        fastpersist = _fastpersist(self.tier_options.engine)
        remote = self._next_round(checkpoint)
        key, version = self._tier.key(target.uri), uuid.uuid4().hex[:VERSION_HEX]
        with self._save_lock:
            estimated = fastpersist.estimated_bytes(checkpoint)
            self._make_room(estimated + ROOM_MARGIN_BYTES, key)
            path = self._tier.data_path(key, version, target.uri)
            if self._context is None:
                self._context = fastpersist.FastPersistContext(engine=self.tier_options.engine,
                                                               io_buffer_mb=self.tier_options.io_buffer_mb)
            size = fastpersist.fastpersist_save(checkpoint, path, context=self._context,
                                                estimated_nbytes=estimated).bytes
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                with self._state_lock:
                    previous = self._tier.read(key)
                    kept = self._keep_owed(key, previous, remote)
                    self._tier.write(key, Manifest(
                        target.uri, version, size, None, time.time(), remote,
                        uploaded_crc32c=previous.uploaded_crc32c if previous else (),
                        published_generation=previous.published_generation if previous else None))
                    if remote:  # it goes to GCS itself: an older version owes nothing once it is newer there
                        self._tier.remove_pending(key)
                    job = _Job(target, key, version, fd, size, remote, started)
                    self._supersede(key, job)
                    self._jobs.setdefault(key, []).append(job)
            except BaseException:
                os.close(fd)
                remove_local(path)
                raise
            self._tier.remove_other_versions(key, version, keep=kept)  # a running upload keeps its bytes open
        assert self._sealer is not None
        self._sealer.put(job)
        self._evict()
        waited = time.perf_counter() - started
        with self._state_lock:
            self._count(saves=self._stats.saves + 1, last_save_s=waited, total_save_s=self._stats.total_save_s + waited)
        log.info("saved %s to the local tier (%s, %d bytes) in %.3f s; %s", target.uri, path, size, waited,
                 "uploading it to GCS in the background" if remote else
                 f"not uploaded (remote_every={self.tier_options.remote_every})")

    def _keep_owed(self, key: str, previous: Manifest | None, remote: bool) -> tuple[str, ...]:
        """The versions of ``key`` a new save (``remote``: one that goes to GCS) must keep on the local tier:
        for a save that stays on the node, the version it replaces while that one's upload is not over
        (recorded as pending, before the new manifest replaces its own, so that a writer that dies
        leaves it for the next), or the one already pending."""
        if remote:
            return ()
        if previous is not None and previous.remote and not previous.durable:
            self._tier.write_pending(key, previous)
            return (previous.version,)
        pending = self._tier.read_pending(key)
        return (pending.version,) if pending is not None else ()

    def _supersede(self, key: str, job: _Job) -> None:
        """A newer version that goes to GCS makes the older versions' uploads that have not started moot."""
        if not job.remote or self._uploader is None:
            return
        for older in self._jobs.get(key, []):
            if older.remote and not older.uploading and self._uploader.discard(older):
                log.debug("%s: the upload of version %s is replaced by version %s", job.target, older.version,
                          job.version)
                self._finish(older)

    def _make_room(self, needed: int, key: str) -> None:
        """Check, before writing, that the local filesystem can take ``needed`` more bytes; evict the
        checkpoints this save pushes out of the newest ``keep_local`` early where that makes room.

        Raises:
            LocalTierFullError: not enough room.
        """
        def room() -> int:
            return self._tier.free_bytes() - self.tier_options.min_free_bytes

        if needed <= room():
            return
        for victim in self._evictable(extra=1, exclude=key):
            log.info("evicting %s from the local tier early to make room for a new checkpoint", victim)
            self._remove_local(victim, free_now=True)
            if needed <= room():
                return
        free = self._tier.free_bytes()
        raise LocalTierFullError(
            errno.ENOSPC,
            f"the local tier {self.local_dir} has {free} bytes free, and this checkpoint needs about {needed} "
            f"(plus min_free_bytes={self.tier_options.min_free_bytes}); nothing was written. Free space, lower "
            "keep_local or point local_dir at a larger disk", self.local_dir)

    def _evictable(self, *, extra: int = 0, exclude: str | None = None) -> list[str]:
        """Keys of the checkpoints beyond the newest ``keep_local`` (counting ``extra`` newer ones to
        come), oldest first, whose checksum and upload are over."""
        limit = self.tier_options.keep_local
        if limit is None:
            return []
        manifests = sorted(((manifest.saved_at, key) for key, manifest in self._tier.manifests().items()
                            if key != exclude), reverse=True)
        keep = max(limit - extra, 0)
        with self._state_lock:
            owing = set(self._tier.pending_manifests())
            return [key for _, key in reversed(manifests[keep:]) if not self._jobs.get(key) and key not in owing]

    def _evict(self) -> None:
        for key in self._evictable():
            log.debug("evicting %s from the local tier (keep_local=%s)", key, self.tier_options.keep_local)
            self._remove_local(key)

    def _remove_local(self, key: str, *, free_now: bool = False) -> None:
        with self._state_lock:
            self._tier.remove(key, free_now=free_now)

    # Background: checksum, upload, recovery ---------------------------------------------------
    def _seal(self, job: _Job) -> None:
        """Take a new version's checksum (the sealer thread). A version that goes to GCS is queued for
        upload first: its parts go up while the checksum is taken (both read the file, which the
        local write left on disk, not in the page cache), and it is published only once the
        checksum is recorded and matches what was sent."""
        if not job.remote or self._uploader is None:
            self._checksum(job)
            self._finish(job)
            return
        try:
            fd = os.dup(job.fd)  # the checksum's own: the upload may end, and let go of the job's, first
        except OSError:  # no descriptor to spare: the checksum, then the upload
            if self._checksum(job):
                self._uploader.put(job)
            else:
                self._finish(job)
            return
        try:
            self._uploader.put(job)
            self._checksum(job, fd)
        finally:
            os.close(fd)

    def _checksum(self, job: _Job, fd: int | None = None) -> bool:
        """Take the crc32c of ``job``'s file (through ``fd``, else the job's own) and record it in its
        manifest; whether that worked."""
        try:
            crc = file_crc32c(job.fd if fd is None else fd, job.size, f"the local copy of {job.target}")
            job.crc = crc
            self._record_checksum(job)
            return True
        except Exception as exc:
            log.warning("could not take the checksum of the local copy of %s (%s); it is not uploaded", job.target, exc)
            job.cancelled.set()
            return False
        finally:
            job.sealed.set()

    def _record_checksum(self, job: _Job) -> None:
        """Record ``job``'s crc32c in the manifest as its version's (when the manifest still names it)."""
        assert job.crc is not None
        crc = crc32c_b64(job.crc)
        with self._state_lock:
            current = self._tier.read(job.key)
            if current is not None and current.version == job.version and current.crc32c != crc:
                self._tier.write(job.key, current.replace(crc32c=crc))

    def _record_upload(self, job: _Job) -> None:
        """Record, before ``job``'s upload publishes, its crc32c among the uploads of the URI (whatever
        version the manifest now describes). Only uploads about to publish are recorded: saves replaced
        before theirs did would push older uploads, which GCS may still hold, out of the list."""
        assert job.crc is not None
        crc = crc32c_b64(job.crc)
        with self._state_lock:
            current = self._tier.read(job.key)
            if current is not None and crc not in current.uploaded_crc32c:
                self._tier.write(job.key, current.replace(
                    uploaded_crc32c=(*current.uploaded_crc32c, crc)[-UPLOADED_KEPT:]))

    def _finish(self, job: _Job) -> None:
        job.close()
        with self._state_lock:
            jobs = self._jobs.get(job.key, [])
            if job in jobs:
                jobs.remove(job)
            if not jobs:
                self._jobs.pop(job.key, None)
        job.sealed.set()
        job.finished.set()

    def _upload(self, item: _Job | tuple[str, str, Manifest]) -> None:
        if isinstance(item, tuple):
            self._recover(*item[1:])
            return
        job = item
        job.uploading = True
        try:
            self._upload_job(job)
        finally:
            self._finish(job)
        self._evict()

    def _upload_job(self, job: _Job) -> None:
        """Upload ``job``'s version until it is published, replaced in GCS, removed or stopped."""
        attempts = 0
        uploader = self._uploader
        assert uploader is not None

        def stopping() -> bool:
            return job.cancelled.is_set() or uploader.stopping

        def publishable_crc() -> int:
            """The crc32c the version was written with, once the sealer has it, recorded among the
            uploads of its URI before the publish (so that a restart after the publish knows GCS's
            object for this tier's own)."""
            while not job.sealed.wait(0.5):
                if stopping():
                    break
            if job.crc is None or stopping():
                raise UploadStopped(f"upload of {job.target} stopped before its publish (no checksum of it)")
            self._record_upload(job)
            return job.crc

        while not stopping():
            try:
                log.debug("uploading %s (%d bytes) from the local tier", job, job.size)
                generation = upload_file(self._writer(job.target), job.fd, job.size, expected_crc32c=publishable_crc,
                                         stop=stopping)
            except UploadStopped:
                log.info("stopped the upload of %s before its publish", job.target)
                return
            except ConcurrentWriteError:
                if not self._already_there(job):
                    log.warning("another writer replaced %s in GCS during its upload; this version stays on the "
                                "local tier only", job.target)
                    self._settle_pending(job)
                return
            except DataCorruptionError as exc:
                log.warning("not uploading %s: %s", job.target, exc)
                self._settle_pending(job)
                return
            except Exception as exc:
                attempts += 1
                delay = min(RETRY_INITIAL_S * 2 ** (attempts - 1), RETRY_MAX_S)
                with self._state_lock:
                    self._count(upload_failures=self._stats.upload_failures + 1)
                log.warning("upload of %s to GCS failed (attempt %d: %s); trying again in %.0f s. Training goes on: "
                            "the checkpoint is whole on the local tier, but not durable until an upload succeeds",
                            job.target, attempts, exc, delay)
                uploader.sleep(delay, job.cancelled.is_set)
                continue
            self._durable(job, generation, after_failures=attempts)
            return

    def _already_there(self, job: _Job) -> bool:
        """Whether GCS holds ``job``'s bytes (another upload of the same version won); if so, record it."""
        try:
            info = self.gcs.stat(job.target, self._deadline("stat", job.target.uri))
        except Exception:
            return False
        if job.crc is None or info.size != job.size or info.crc32c != crc32c_b64(job.crc):
            return False
        self._durable(job, info.generation, after_failures=0)
        return True

    def _durable(self, job: _Job, generation: int | None, after_failures: int) -> None:
        """Record that ``job``'s version is published in GCS (only now is it durable)."""
        with self._state_lock:
            current = self._tier.read(job.key)
            if current is not None and generation:
                changes: dict[str, Any] = {}
                if current.version == job.version:
                    changes["durable_generation"] = generation
                if generation > (current.published_generation or 0):
                    changes["published_generation"] = generation
                if changes:
                    self._tier.write(job.key, current.replace(**changes))
            self._settle_pending(job)
            durable_s = time.perf_counter() - job.started
            self._count(uploads_done=self._stats.uploads_done + 1, last_durable_s=durable_s,
                        last_durable=job.target.uri)
        log.info("%s is durable in GCS (generation %s), %.2f s after its save%s", job.target, generation, durable_s,
                 f", after {after_failures} failed attempt(s)" if after_failures else "")

    def _settle_pending(self, job: _Job) -> None:
        """Forget that ``job``'s version owes GCS its upload, if it was recorded as pending: it is
        published, or it never can be (its bytes are damaged, or another writer replaced it there)."""
        with self._state_lock:
            pending = self._tier.read_pending(job.key)
            if pending is not None and pending.version == job.version:
                self._tier.remove_pending(job.key)

    def _recover(self, key: str, manifest: Manifest) -> None:
        """Finish what a crashed writer left undone for ``key``'s version of ``manifest`` (its current
        one, or an older one that is pending): the checksum, then the upload."""
        with self._state_lock:
            # The records as they are now: the upload of an older version may have changed the current one.
            current, pending = self._tier.read(key), self._tier.read_pending(key)
            if current is not None and current.version == manifest.version:
                manifest, owed = current, False
            elif current is not None and pending is not None and pending.version == manifest.version:
                manifest, owed = pending, True
            else:
                return  # saved again (the new version's own work covers it) or removed since
            if any(job.version == manifest.version for job in self._jobs.get(key, [])):
                return
            path = self._tier.data_path(key, manifest.version, manifest.uri)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = -1
            if fd < 0 or os.fstat(fd).st_size != manifest.size:
                log.warning("the local copy of %s is missing or damaged (%s); removing it from the local tier",
                            manifest.uri, path)
                if fd >= 0:
                    os.close(fd)
                if owed:
                    self._tier.remove_pending(key)
                else:
                    self._tier.remove(key)
                return
            target = parse_gcs_path(manifest.uri)
            job = _Job(target, key, manifest.version, fd, manifest.size, manifest.remote and not manifest.durable,
                       time.perf_counter())
            self._jobs.setdefault(key, []).append(job)
        if manifest.crc32c is not None:
            job.crc = int.from_bytes(base64.b64decode(manifest.crc32c), "big")
            job.sealed.set()
        if (job.crc is not None or self._checksum(job)) and job.remote and not self._already_there(job):
            log.info("finishing the upload of %s, which a previous writer of the local tier left pending", target)
            job.uploading = True
            self._upload_job(job)
        self._finish(job)

    # Reading ---------------------------------------------------------------------------------
    @override
    def _target(self, path: str | os.PathLike[str]) -> _Target:
        text = os.fspath(path)
        if isinstance(text, str) and "://" not in text:
            key = self._tier.key_of(text)
            if key is not None:  # a local tier file (Lightning's ckpt_path="last" may pick one)
                manifest = self._tier.read(key)
                if manifest is None:
                    raise FileNotFoundError(f"{text} is a local tier file whose checkpoint was removed")
                return parse_gcs_path(manifest.uri)
        return super()._target(path)

    @override
    def _reader(self, target: GcsPath) -> RangedReader:
        """The newest whole copy of ``target``: the local tier's, read and checked against its manifest
        before this returns (when GCS holds no newer one), else the GCS object's."""
        local = self._local_copy(target)
        if local is not None:
            try:
                local.verify()
            except OSError as exc:  # DataCorruptionError too
                self._local_copy_failed(target, local, exc)
            else:
                log.info("loading %s from the local tier (%s)", target, local.file_path)
                return local
        return super()._reader(target)

    @override
    def _read(self, target: _Target, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """Load the newest whole copy of ``target``. A local copy is unpickled while it is read (as a
        GCS load is while it downloads) and returned only once every byte matched its manifest's
        crc32c and GCS, asked meanwhile, holds no newer copy; one that does not match, or cannot be
        read, is loaded from GCS instead, as is a newer copy GCS holds."""
        if isinstance(target, str):
            return super()._read(target, map_location, weights_only)
        found = self._local_candidate(target)
        if found is not None:
            local, manifest = found
            # GCS is asked whether it holds a newer copy while the local one loads (a round trip
            # saved); a newer one there makes this load's result moot.
            asking = ThreadPoolExecutor(1, thread_name_prefix="dataflux-tiered-newer")
            newer = asking.submit(self._newer_in_gcs, target, manifest)
            asking.shutdown(wait=False)
            try:
                with local:
                    checkpoint = _load_checkpoint(local, map_location, weights_only)
            except Exception as exc:
                if newer.result():
                    pass  # GCS's newer copy is the one to load
                elif local.checked:
                    raise  # the bytes are the ones written: the checkpoint itself does not load
                else:
                    self._local_copy_failed(target, local, exc)
            else:
                if not newer.result():
                    log.info("loaded %s from the local tier (%s)", target, local.file_path)
                    return checkpoint
                del checkpoint
        with super()._reader(target) as stream:
            return _load_checkpoint(stream, map_location, weights_only)

    def _local_copy_failed(self, target: GcsPath, local: _LocalCopy, exc: BaseException) -> None:
        local.abandon()
        log.warning("the local copy of %s is damaged or unreadable (%s); loading it from GCS", target, exc)

    def _local_copy(self, target: GcsPath) -> _LocalCopy | None:
        """The local tier's copy of ``target``, being read, when its manifest names a file of the size
        written and GCS holds no newer copy (asked while the file is read); else ``None``."""
        found = self._local_candidate(target)
        if found is None:
            return None
        copy, manifest = found
        if self._newer_in_gcs(target, manifest):
            copy.abandon()
            return None
        return copy

    def _local_candidate(self, target: GcsPath) -> tuple[_LocalCopy, Manifest] | None:
        """The local tier's copy of ``target``, being read, and its manifest, when the manifest names
        a file of the size written (GCS is not asked whether it holds a newer one); else ``None``."""
        self._in_this_process()
        key = self._tier.key(target.uri)
        with self._state_lock:
            pending = [job for job in self._jobs.get(key, []) if not job.sealed.is_set()]
        for job in pending:  # a save of this process whose checksum is being taken
            job.sealed.wait(self.deadline_s)
        manifest = self._tier.read(key)
        if manifest is None:
            return None
        path = self._tier.data_path(key, manifest.version, manifest.uri)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            size = None
        if size != manifest.size:
            log.warning("the local copy of %s is %s; loading it from GCS", target,
                        "missing" if size is None else f"{size} bytes, not the {manifest.size} written")
            return None
        try:
            copy = _LocalCopy(target, path, manifest.size, manifest.crc32c, deadline_s=self.deadline_s)
        except OSError as exc:
            log.warning("could not read the local copy of %s (%s); loading it from GCS", target, exc)
            return None
        return copy, manifest

    def _newer_in_gcs(self, target: GcsPath, manifest: Manifest) -> bool:
        """Whether GCS holds a newer version of ``target`` than the local tier (saved there from
        another node since); when GCS cannot be asked, the local copy is used."""
        try:
            info = self.gcs.stat(target, Deadline(min(NEWER_CHECK_TIMEOUT_S, self.deadline_s), "stat", target.uri))
        except FileNotFoundError:
            return False
        except Exception as exc:
            log.warning("could not ask GCS whether it holds a newer copy of %s than the local tier (%s); "
                        "loading the local copy", target, exc)
            return False
        if info.crc32c == manifest.crc32c or info.crc32c in manifest.uploaded_crc32c:
            return False  # this version, or an older one this tier uploaded
        if manifest.published_generation is not None and info.generation <= manifest.published_generation:
            return False  # what this tier published, or older
        # Another writer's (another node's) object. A generation is the object's creation time in
        # microseconds, in GCS and its emulators alike: it is newer if it was made after the local save.
        newer = info.generation > manifest.saved_at * 1e6
        if newer:
            log.info("GCS holds a newer copy of %s (generation %s) than the local tier; loading it from GCS",
                     target, info.generation)
        return newer

    # Removal and the rest --------------------------------------------------------------------
    @override
    def _delete(self, target: _Target) -> None:
        """Remove both copies: the upload of ``target`` is stopped first (so it cannot publish after
        the GCS object is deleted), then the local copy, then the GCS object."""
        if isinstance(target, str):
            super()._delete(target)
            return
        key = self._tier.key(target.uri)
        with self._state_lock:
            jobs = list(self._jobs.get(key, []))
        for job in jobs:
            job.cancelled.set()
            if self._uploader is not None and self._uploader.discard(job):
                self._finish(job)
        for job in jobs:
            if not job.finished.wait(self.cleanup_timeout_s + self.deadline_s):
                log.warning("the upload of %s did not stop in time; it may publish after this removal", job)
        self._remove_local(key)
        super()._delete(target)

    @override
    def _stored(self, target: _Target) -> bool:
        if isinstance(target, GcsPath) and self._tier.read(self._tier.key(target.uri)) is not None:
            return True
        return super()._stored(target)

    @override
    def preflight(self, checkpoint_dirs: Sequence[CheckpointDir]) -> None:
        """Check the ``gs://`` directories as :class:`DatafluxCheckpointIO` does, then become the
        local tier's writer: finish the uploads a crashed writer left pending (in the background).

        Raises:
            As :meth:`DatafluxCheckpointIO.preflight`; LocalTierInUseError: another live process
            writes to ``local_dir``.
        """
        super().preflight(checkpoint_dirs)
        self._start_writing()

    @override
    def last_checkpoints(self, directory: str) -> dict[str, str]:
        """The local tier's ``last`` checkpoints (``last.ckpt``, ``last-v1.ckpt``...) of the ``gs://``
        ``directory``: each one's local file, by its ``gs://`` path."""
        prefix = directory.rstrip("/") + "/"
        found = {}
        for key, manifest in self._tier.manifests().items():
            if manifest.uri.startswith(prefix) and re.match(r"^last(-v?\d+)?\.ckpt$", manifest.uri[len(prefix):]):
                found[manifest.uri] = self._tier.data_path(key, manifest.version, manifest.uri)
        return found

    @override
    def _close(self) -> None:
        """Wait (up to ``teardown_timeout_s``) for checksums and uploads in flight, saying what for;
        what is left stays on the local tier, for the next writer to upload. Then let go of the
        local tier and close the connections."""
        self._in_this_process()
        sealer, uploader = self._sealer, self._uploader
        if sealer is not None and uploader is not None:
            self._wait_for_uploads(self.tier_options.teardown_timeout_s)
            # An upload attempt running now stops between blocks, or before its publish, and aborts.
            with self._state_lock:
                jobs = [job for jobs in self._jobs.values() for job in jobs]
            for job in jobs:
                job.cancelled.set()
            sealer.stop(self.cleanup_timeout_s)
            uploader.stop(self.cleanup_timeout_s)
            busy = [job for job in jobs if (job.uploading and uploader.alive) or (job is sealer.current and sealer.alive)]
            if busy:
                log.warning("%s is still stopping after %g s; it ends on its own (its upload is not published)",
                            ", ".join(map(str, busy)), self.cleanup_timeout_s)
            for job in jobs:
                if job not in busy:  # a running one lets go of its file itself
                    self._finish(job)
        with self._state_lock:
            self._sealer = self._uploader = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
        if self._context is not None:
            self._context.close()
            self._context = None
        super()._close()

    def _wait_for_uploads(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        said = 0.0
        while True:
            with self._state_lock:
                jobs = [job for jobs in self._jobs.values() for job in jobs]
            # Uploads a previous writer left pending (preflight queues them), before they become jobs: read
            # after the jobs, the uploader's queue and current item see every one that is not a job yet.
            uploader = self._uploader
            items = [*uploader.queued(), uploader.current] if uploader is not None else []
            busy = {(job.key, job.version) for job in jobs}
            recovering = list({(item[1], item[2].version): item[2] for item in items
                               if isinstance(item, tuple) and (item[1], item[2].version) not in busy}.values())
            if not jobs and not recovering:
                return True
            now = time.monotonic()
            pending = len(jobs) + len(recovering)
            if now >= end:
                log.warning("%d upload(s) to GCS did not finish within %g s: %s. They stay on the local tier %s and "
                            "the next process writing to it uploads them", pending, timeout_s,
                            ", ".join([*(str(job) for job in jobs), *(m.uri for m in recovering)]), self.local_dir)
                return False
            if now - said >= PROGRESS_EVERY_S:
                log.info("waiting up to %.0f s for %d upload(s) to GCS: %s", end - now, pending,
                         ", ".join([*(job.target.uri for job in jobs),
                                    *(f"{m.uri} (left pending by a previous writer)" for m in recovering)]))
                said = now
            for job in jobs[:1]:
                job.finished.wait(min(end - now, 1.0))
            if not jobs:
                time.sleep(min(end - now, 0.05))


class TieredCheckpointMonitor(Callback):
    """Logs what :class:`TieredCheckpointIO` does as metrics, after every training batch.

    ``tiered/save_wait_s`` (how long training waited for the last save), ``tiered/uploads_pending``
    and, once a checkpoint is durable in GCS, ``tiered/durable_after_s`` (seconds from the start of
    its save to its publish). Add it to ``Trainer(callbacks=[...])``; with another CheckpointIO it
    logs nothing.
    """

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Log the plugin's :class:`TieredStats` as ``tiered/*`` step metrics (on rank zero)."""
        from lightning_storage_plugins.preflight import storage_plugin

        plugin = storage_plugin(trainer.strategy.checkpoint_io)
        if not isinstance(plugin, TieredCheckpointIO):
            return
        stats = plugin.stats()
        metrics = {"tiered/uploads_pending": float(stats.uploads_pending)}
        if stats.last_save_s is not None:
            metrics["tiered/save_wait_s"] = stats.last_save_s
        if stats.last_durable_s is not None:
            metrics["tiered/durable_after_s"] = stats.last_durable_s
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

