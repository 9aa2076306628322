"""Typed errors of the GCS checkpoint plugin; every message names the ``gs://`` object concerned."""

from __future__ import annotations

from lightning_storage_plugins.errors import ConcurrentWriteError as SharedConcurrentWriteError
from lightning_storage_plugins.errors import InvalidCheckpointError as SharedInvalidCheckpointError


class DataCorruptionError(IOError):
    """The bytes stored or received do not match their crc32c checksum."""


class TransferError(IOError):
    """An upload or download failed for good (after retries); the message names bucket, key and part."""


class DeadlineExceededError(TransferError, TimeoutError):
    """A public operation (save, load, remove, list) did not finish within its deadline.

    Attributes:
        operation: what ran out of time (``"save"``, ``"load"``...).
        target: the ``gs://`` path or prefix it worked on.
        deadline_s: the deadline it had, in seconds.
    """

    def __init__(self, operation: str, target: str, deadline_s: float, detail: str = "") -> None:
        message = f"{operation} of {target} did not finish within its deadline of {deadline_s:g} s"
        super().__init__(f"{message}: {detail}" if detail else message)
        self.operation, self.target, self.deadline_s = operation, target, deadline_s


class ConcurrentWriteError(TransferError, SharedConcurrentWriteError):
    """Another writer replaced the object while this save ran; this save published nothing.

    Also the ``ConcurrentWriteError`` all plugins share (``lightning_storage_plugins.errors``).

    Attributes:
        target: the ``gs://`` path both wrote to.
    """

    def __init__(self, target: str, detail: str = "") -> None:
        message = (f"{target} was replaced by another writer while this save ran (its generation "
                   f"precondition failed); this save published nothing")
        super().__init__(f"{message}: {detail}" if detail else message)
        self.target, self.detail = target, detail

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # DCP pickles a rank's error for the others
        return type(self), (self.target, self.detail)


class BucketNotFoundError(FileNotFoundError):
    """The bucket of a ``gs://`` path does not exist (or is not visible with these credentials)."""


class InvalidCheckpointError(SharedInvalidCheckpointError):
    """A stored object is not a loadable torch checkpoint (empty, truncated, or not torch's format).

    Also the ``InvalidCheckpointError`` all plugins share (``lightning_storage_plugins.errors``).
    """


class HttpStatusError(IOError):
    """A GCS HTTP request answered with an error status."""

    def __init__(self, status: int, what: str, body: str = "") -> None:
        super().__init__(f"{what}: HTTP {status} {body[:300]}".rstrip())
        self.status = status


class InvalidObjectNameError(ValueError):
    """A ``gs://`` path whose bucket or object name GCS could not store as written.

    Raised before any request: a name with a ``.`` or ``..`` segment would name different objects
    in different APIs (HTTP stacks collapse such segments in URL paths but not in query strings),
    and control characters cannot be carried in the XML API's answers.
    """

    def __init__(self, bucket: str, name: str, reason: str) -> None:
        super().__init__(f"invalid GCS name gs://{bucket}/{name!r}: {reason}")
        self.bucket = bucket
        self.name = name
        self.reason = reason


class InvalidBucketNameError(InvalidObjectNameError):
    """A ``gs://`` path whose bucket name breaks GCS's bucket naming rules; raised before any request."""

    def __init__(self, bucket: str, reason: str) -> None:
        ValueError.__init__(self, f"{bucket!r} is not a valid GCS bucket name: {reason}")
        self.bucket = bucket
        self.name = ""
        self.reason = reason


class UnsupportedSchemeError(ValueError):
    """A path with a scheme other than ``gs://`` where a GCS path is expected."""

    def __init__(self, path: str, scheme: str) -> None:
        super().__init__(f"unsupported scheme {scheme + '://'!r} in {path!r}: GCS paths are written gs://bucket/key")
        self.path = path
        self.scheme = scheme
