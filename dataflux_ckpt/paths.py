"""Parsing of ``gs://bucket/key`` checkpoint paths."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

SCHEMES = ("gs", "gcs")
# ``gs://bucket/key``; also ``gs:/bucket/key``, which is what ``pathlib.Path("gs://bucket/key")`` becomes.
_PATH_RE = re.compile(r"^(?P<scheme>[A-Za-z0-9+.-]+):/{1,2}(?P<bucket>[^/]+)/(?P<key>.+)$")


class GcsPath(NamedTuple):
    """A bucket and an object key."""

    bucket: str
    key: str

    @property
    def uri(self) -> str:
        """``gs://bucket/key``."""
        return f"gs://{self.bucket}/{self.key}"

    def __str__(self) -> str:
        return self.uri


def parse_gcs_path(path: str | os.PathLike[str]) -> GcsPath:
    """Split ``gs://bucket/key`` (or ``gcs://``, or a ``pathlib.Path`` of either) into bucket and key.

    Raises:
        ValueError: if ``path`` is not a GCS object path; the message names the path.
    """
    text = os.fspath(path)
    if not isinstance(text, str):
        raise ValueError(f"not a GCS object path: {path!r} (expected gs://bucket/key)")
    match = _PATH_RE.match(text)
    if match is None or match["scheme"].lower() not in SCHEMES or match["key"].strip("/") == "":
        raise ValueError(f"not a GCS object path: {text!r} (expected gs://bucket/key)")
    return GcsPath(match["bucket"], match["key"])


_PREFIX_RE = re.compile(r"^(?P<scheme>[A-Za-z0-9+.-]+):/{1,2}(?P<bucket>[^/]+)(?:/(?P<key>.*))?$")


def parse_gcs_prefix(path: str | os.PathLike[str]) -> GcsPath:
    """Split ``gs://bucket/prefix`` (the prefix may be empty: ``gs://bucket``) into bucket and prefix.

    Raises:
        ValueError: if ``path`` is not a ``gs://`` path; the message names it.
    """
    text = os.fspath(path)
    match = _PREFIX_RE.match(text) if isinstance(text, str) else None
    if match is None or match["scheme"].lower() not in SCHEMES:
        raise ValueError(f"not a GCS path: {path!r} (expected gs://bucket or gs://bucket/prefix)")
    return GcsPath(match["bucket"], match["key"] or "")


# GCS's bucket naming rules: 3 to 63 characters (up to 222 with dots, each dot-separated part at
# most 63), lower-case letters, digits, '-', '_' and '.', starting and ending with a letter or digit.
_BUCKET_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{1,220})[a-z0-9]$")


def check_bucket_name(bucket: str) -> str:
    """``bucket`` if it follows GCS's bucket naming rules.

    Raises:
        ValueError: the name cannot be a GCS bucket's (the message names it and the rule it breaks).
    """
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"{bucket!r} is not a valid GCS bucket name: bucket names have 3 to 63 characters "
                         "(222 with dots), lower-case letters, digits, '-', '_' and '.', and start and end "
                         "with a letter or digit")
    parts = bucket.split(".")
    if max(len(part) for part in parts) > 63 or ("." not in bucket and len(bucket) > 63):
        raise ValueError(f"{bucket!r} is not a valid GCS bucket name: each dot-separated part has at most 63 "
                         "characters")
    return bucket
