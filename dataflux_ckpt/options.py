"""``TransferOptions``: how checkpoints move to and from Google Cloud Storage, checked once.

One frozen object serves :class:`~dataflux_ckpt.DatafluxCheckpointIO`, the DCP
:class:`~dataflux_ckpt.DatafluxStorageWriter` / :class:`~dataflux_ckpt.DatafluxStorageReader` and the
sharded strategies; each takes the fields that concern it and ignores the rest::

    options = TransferOptions(chunk_size=64 * 2**20, max_workers=16, deadline_s=3600)
    DatafluxCheckpointIO(options=options)
    DatafluxStorageWriter("gs://bucket/run/step-100", options=options)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from dataflux_ckpt.gcs import REQUEST_TIMEOUT_S
from dataflux_ckpt.retry import RetryPolicy
from dataflux_ckpt.upload import CLEANUP_TIMEOUT_S, DEADLINE_S, UPLOAD_MODES

__all__ = [
    "CHUNK_SIZE_BYTES",
    "COALESCE_GAP_BYTES",
    "CRC_BLOCK_BYTES",
    "FIELDS",
    "MAX_WORKERS",
    "RESUMABLE_CHUNK_MULTIPLE_BYTES",
    "STREAM_CHUNK_SIZE_BYTES",
    "TransferOptions",
    "option_property",
    "resolve_options",
]

CHUNK_SIZE_BYTES = 32 * 2**20
MAX_WORKERS = 8
# Without the transfer manager each resumable-upload request carries this much. Larger requests
# mean fewer round trips; fake-gcs-server also re-hashes the whole object on every request.
STREAM_CHUNK_SIZE_BYTES = 128 * 2**20
# GCS refuses a resumable-upload request (but the last) whose size is not a multiple of this.
RESUMABLE_CHUNK_MULTIPLE_BYTES = 256 * 2**10
CRC_BLOCK_BYTES = 1 * 2**20
# Items closer than this in one object are fetched by one GET (the gap's bytes are read and dropped).
COALESCE_GAP_BYTES = 1 * 2**20


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is an int subclass; True as a part size is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"TransferOptions.{name} must be an int, not {type(value).__name__} {value!r}")
    if value < minimum:
        bound = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"TransferOptions.{name} must be {bound}, not {value!r}")


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"TransferOptions.{name} must be a number of seconds, not {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"TransferOptions.{name} must be a positive, finite number of seconds, not {value!r}")


@dataclass(frozen=True)
class TransferOptions:
    """How checkpoints move to and from GCS; every field is checked when the object is made.

    Raises:
        TypeError: a field has the wrong type (a bool where a number is expected, a float where
            a byte count is expected, a ``retry`` that is not a :class:`RetryPolicy`); the message
            names the field and the value.
        ValueError: a field is out of range; the message names the field and the value.
    """

    chunk_size: int = CHUNK_SIZE_BYTES
    """Bytes per uploaded part and per ranged read. A save holds about ``(max_workers + 1) x
    chunk_size`` in memory. Under GCS's 5 MiB minimum part, ``upload_mode="auto"`` uses composite
    uploads."""

    max_workers: int = MAX_WORKERS
    """Concurrent part uploads / ranged reads (per rank, for DCP checkpoints)."""

    stream_chunk_size: int = STREAM_CHUNK_SIZE_BYTES
    """Bytes per request of the resumable upload that ``DatafluxCheckpointIO(use_transfer_manager=False)``
    makes; a multiple of 256 KiB. Up to two such buffers are alive during a save."""

    upload_mode: str = "auto"
    """``"auto"`` (probe XML multipart once per bucket, else composite uploads; composite when
    ``chunk_size`` is under 5 MiB), ``"xml"`` or ``"composite"``."""

    block_size: int = CRC_BLOCK_BYTES
    """Bytes covered by each crc32c a DCP writer records: the granularity of verified partial reads."""

    coalesce_gap: int = COALESCE_GAP_BYTES
    """A DCP reader fetches items of one object closer than this many bytes with one GET (the gap's
    bytes are read and dropped); ``0`` coalesces only adjacent items."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """How each request (a part, a range, a compose) is retried."""

    deadline_s: float = DEADLINE_S
    """Every public operation (a save, a load, a removal, a listing; a DCP rank's shard, metadata,
    clean-up) finishes within this many seconds, or fails with ``DeadlineExceededError``."""

    request_timeout_s: float = REQUEST_TIMEOUT_S
    """How long one request may wait for the server (per socket operation)."""

    cleanup_timeout_s: float = CLEANUP_TIMEOUT_S
    """How long clean-up after a failed save may take (aborting its upload, deleting its part objects),
    and how long closing waits for background deletions."""

    def __post_init__(self) -> None:
        for name in ("chunk_size", "max_workers", "stream_chunk_size", "block_size"):
            _check_int(name, getattr(self, name), 1)
        if self.stream_chunk_size % RESUMABLE_CHUNK_MULTIPLE_BYTES:
            raise ValueError(f"TransferOptions.stream_chunk_size must be a multiple of {RESUMABLE_CHUNK_MULTIPLE_BYTES} "
                             f"bytes (GCS's resumable-upload granularity), not {self.stream_chunk_size!r}")
        _check_int("coalesce_gap", self.coalesce_gap, 0)
        if not isinstance(self.upload_mode, str):
            raise TypeError(f"TransferOptions.upload_mode must be a str, not {type(self.upload_mode).__name__} "
                            f"{self.upload_mode!r}")
        if self.upload_mode not in UPLOAD_MODES:
            raise ValueError(f"TransferOptions.upload_mode must be one of {UPLOAD_MODES}, not {self.upload_mode!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise TypeError(f"TransferOptions.retry must be a RetryPolicy, not {type(self.retry).__name__} "
                            f"{self.retry!r}")
        for name in ("deadline_s", "request_timeout_s", "cleanup_timeout_s"):
            _check_seconds(name, getattr(self, name))

    def replace(self, **changes: Any) -> TransferOptions:
        """A copy with ``changes`` applied (and checked like a new object).

        Raises:
            TypeError, ValueError: as the constructor.
        """
        return dataclasses.replace(self, **changes)


# The names of the options, as keyword arguments.
FIELDS = frozenset(f.name for f in dataclasses.fields(TransferOptions))


def resolve_options(owner: str, options: TransferOptions | None, **given: Any) -> TransferOptions:
    """The options of ``owner``: ``options``, or one made from the individual keyword arguments
    ``given`` (those that are ``None`` were not given).

    Raises:
        TypeError: ``options`` is not a :class:`TransferOptions`, or an individual argument differs
            from the same field of ``options`` (give it in one place).
        ValueError: as :class:`TransferOptions`.
    """
    given = {name: value for name, value in given.items() if value is not None}
    if options is None:
        return TransferOptions(**given)
    if not isinstance(options, TransferOptions):
        raise TypeError(f"{owner}: options must be a TransferOptions, not {type(options).__name__} {options!r}")
    conflicts = [f"{name}={value!r} (options.{name}={getattr(options, name)!r})"
                 for name, value in given.items() if getattr(options, name) != value]
    if conflicts:
        raise TypeError(f"{owner}: {', '.join(conflicts)} conflicts with the options given; set each in one "
                        "place (options.replace(...) makes a changed copy)")
    return options


def option_property(name: str, doc: str) -> property:
    """A read-only attribute that reads the field ``name`` of the owner's ``options``."""
    return property(lambda owner: getattr(owner.options, name), doc=doc)
