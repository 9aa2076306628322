"""Parsing of ``gs://bucket/key`` checkpoint paths, and the one place object names become URLs.

Every request URL that names a bucket or an object is built here, from names checked here, so that
one ``gs://`` path names the same object in the JSON API, the XML API and every read.
"""

from __future__ import annotations

import os
import re
import unicodedata
from typing import NamedTuple
from urllib.parse import quote

from dataflux_ckpt.errors import InvalidBucketNameError, InvalidObjectNameError, UnsupportedSchemeError

SCHEMES = ("gs",)
# ``gs://bucket/key``; also ``gs:/bucket/key``, which is what ``pathlib.Path("gs://bucket/key")`` becomes.
_PATH_RE = re.compile(r"^(?P<scheme>[A-Za-z0-9+.-]+):/{1,2}(?P<bucket>[^/]+)/(?P<key>.+)\Z", re.DOTALL)


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
    """Split ``gs://bucket/key`` (or a ``pathlib.Path`` of one) into bucket and key.

    Raises:
        UnsupportedSchemeError: another scheme (``gcs://`` included); the message names it.
        InvalidBucketNameError: the bucket name breaks GCS's naming rules.
        InvalidObjectNameError: the object name cannot be stored as written.
        ValueError: if ``path`` is not a GCS object path; the message names the path.
    """
    text = os.fspath(path)
    if not isinstance(text, str):
        raise ValueError(f"not a GCS object path: {path!r} (expected gs://bucket/key)")
    match = _PATH_RE.match(text)
    _check_scheme(text, match)
    if match is None or match["key"].strip("/") == "":
        raise ValueError(f"not a GCS object path: {text!r} (expected gs://bucket/key)")
    return GcsPath(check_bucket_name(match["bucket"]), check_object_name(match["bucket"], match["key"]))


_PREFIX_RE = re.compile(r"^(?P<scheme>[A-Za-z0-9+.-]+):/{1,2}(?P<bucket>[^/]+)(?:/(?P<key>.*))?\Z", re.DOTALL)


def parse_gcs_prefix(path: str | os.PathLike[str]) -> GcsPath:
    """Split ``gs://bucket/prefix`` (the prefix may be empty: ``gs://bucket``) into bucket and prefix.

    Raises:
        UnsupportedSchemeError: another scheme (``gcs://`` included); the message names it.
        InvalidBucketNameError: the bucket name breaks GCS's naming rules.
        ValueError: if ``path`` is not a ``gs://`` path; the message names it.
    """
    text = os.fspath(path)
    match = _PREFIX_RE.match(text) if isinstance(text, str) else None
    _check_scheme(text, match)
    if match is None:
        raise ValueError(f"not a GCS path: {path!r} (expected gs://bucket or gs://bucket/prefix)")
    bucket, prefix = check_bucket_name(match["bucket"]), match["key"] or ""
    if prefix:
        check_object_name(bucket, prefix)
    return GcsPath(bucket, prefix)


def _check_scheme(text: object, match: re.Match[str] | None) -> None:
    # Only gs://: gcs:// is fsspec's alias, which Lightning and our checkpoints' own URIs never write,
    # so a path using it would name the same object two ways.
    if match is not None and match["scheme"].lower() not in SCHEMES:
        raise UnsupportedSchemeError(str(text), match["scheme"])


# GCS's limit on an object name, in UTF-8 bytes.
MAX_OBJECT_NAME_BYTES = 1024
# GCS's bucket naming rules: 3 to 63 characters, or up to 222 with dots, each dot-separated part at
# most 63; lower-case letters, digits, '-', '_' and '.'; starting and ending with a letter or digit.
_BUCKET_RE = re.compile(r"^[a-z0-9](?:[a-z0-9._-]*[a-z0-9])?$")
BUCKET_NAME_MIN = 3
BUCKET_NAME_MAX = 63
DOTTED_BUCKET_NAME_MAX = 222
BUCKET_NAME_PART_MAX = 63


def check_bucket_name(bucket: str) -> str:
    """``bucket``, if it follows GCS's bucket naming rules.

    Raises:
        InvalidBucketNameError: not 3 to 63 characters (222 with dots, each dot-separated part at most
            63), or characters other than lower-case letters, digits, ``-``, ``_`` and ``.``, or not
            starting and ending with a letter or digit. The message names the bucket and the rule.
    """
    if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket):
        raise InvalidBucketNameError(bucket, "a bucket name has only lower-case letters, digits, '-', '_' and '.', "
                                             "and starts and ends with a letter or digit")
    limit = DOTTED_BUCKET_NAME_MAX if "." in bucket else BUCKET_NAME_MAX
    if not BUCKET_NAME_MIN <= len(bucket) <= limit:
        raise InvalidBucketNameError(bucket, f"it has {len(bucket)} characters; a bucket name has {BUCKET_NAME_MIN} "
                                             f"to {BUCKET_NAME_MAX} ({DOTTED_BUCKET_NAME_MAX} with dots)")
    longest = max(bucket.split("."), key=len)
    if len(longest) > BUCKET_NAME_PART_MAX:
        raise InvalidBucketNameError(bucket, f"the dot-separated part {longest[:20]!r}... has {len(longest)} "
                                             f"characters; each has at most {BUCKET_NAME_PART_MAX}")
    return bucket


def check_object_name(bucket: str, name: str) -> str:
    """``name``, if it names one and the same object in every GCS API.

    Raises:
        InvalidObjectNameError: the name is empty, is longer than 1024 UTF-8 bytes, has a ``.`` or
            ``..`` segment (between slashes, or at either end), or holds a control character (NUL, CR,
            LF, any Unicode ``Cc``) or an unpaired surrogate.
    """
    if not name:
        raise InvalidObjectNameError(bucket, name, "the object name is empty")
    for char in name:
        if unicodedata.category(char) == "Cc":
            raise InvalidObjectNameError(bucket, name, f"control character {char!r} in the object name")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidObjectNameError(bucket, name, "the object name is not valid Unicode "
                                                   "(an unpaired surrogate)") from None
    if size > MAX_OBJECT_NAME_BYTES:
        raise InvalidObjectNameError(bucket, name, f"the object name has {size} UTF-8 bytes; "
                                                   f"GCS allows {MAX_OBJECT_NAME_BYTES}")
    for segment in name.split("/"):
        if segment in (".", ".."):
            raise InvalidObjectNameError(bucket, name, f"{segment!r} as a path segment (HTTP clients collapse "
                                                       "it in URL paths, so it would name another object)")
    return name


def encode(text: str) -> str:
    """``text`` percent-encoded as one URL path segment or query value (``/`` encoded too)."""
    return quote(text, safe="")


def bucket_url_path(bucket: str) -> str:
    """The JSON API path of a bucket."""
    return f"/storage/v1/b/{encode(check_bucket_name(bucket))}"


def object_url_path(bucket: str, name: str) -> str:
    """The JSON API path of an object's metadata."""
    return f"{bucket_url_path(bucket)}/o/{encode(check_object_name(bucket, name))}"


def media_url_path(bucket: str, name: str) -> str:
    """The JSON API path (with query) of an object's bytes."""
    return f"/download{object_url_path(bucket, name)}?alt=media"


def upload_url_path(bucket: str, name: str, upload_type: str) -> str:
    """The JSON API upload path (with query) for a ``media`` or ``resumable`` upload to an object."""
    return (f"/upload{bucket_url_path(bucket)}/o?uploadType={encode(upload_type)}"
            f"&name={encode(check_object_name(bucket, name))}")


def xml_url_path(bucket: str, name: str) -> str:
    """The XML API path of an object; ``/`` stays literal, which is safe once dot segments are refused."""
    return f"/{encode(check_bucket_name(bucket))}/{quote(check_object_name(bucket, name), safe='/')}"
