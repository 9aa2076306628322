"""Typed errors of the GCS checkpoint plugin."""

from __future__ import annotations


class DataCorruptionError(IOError):
    """The bytes stored or received do not match their crc32c checksum."""


class TransferError(IOError):
    """An upload or download failed for good (after retries); the message names bucket, key and part."""


class HttpStatusError(IOError):
    """A GCS HTTP request answered with an error status."""

    def __init__(self, status: int, what: str, body: str = "") -> None:
        super().__init__(f"{what}: HTTP {status} {body[:300]}".rstrip())
        self.status = status
