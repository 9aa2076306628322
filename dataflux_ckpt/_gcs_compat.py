"""Every use of a private API of google-cloud-storage, requests or urllib3, in one place.

Each function checks that what it relies on is still there and fails with
:class:`UnsupportedDependencyError` (naming the package, its version and the missing piece) when an
upgrade took it away, instead of failing obscurely in the middle of a save. ``tests/dataflux_ckpt/
test_gcs_compat.py`` runs each against the installed packages.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import requests


class UnsupportedDependencyError(RuntimeError):
    """An installed dependency no longer has an internal this package relies on."""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _unsupported(package: str, missing: str) -> UnsupportedDependencyError:
    return UnsupportedDependencyError(
        f"{package} {_version(package)} has no {missing}, which dataflux_ckpt relies on; "
        f"install a {package} version this release supports"
    )


def authorized_session(client: Any) -> requests.Session:
    """The storage client's own authorized ``requests`` session (credentials, token refresh, mTLS).

    Private: ``google.cloud.client.Client._http``.
    """
    session = getattr(client, "_http", None)
    if not isinstance(session, requests.Session):
        raise _unsupported("google-cloud-storage", "Client._http (an authorized requests.Session)")
    return session


def api_endpoint(client: Any) -> str:
    """The base URL the client sends requests to, without a trailing slash: GCS, its mTLS endpoint,
    a ``client_options`` endpoint or ``STORAGE_EMULATOR_HOST``.

    Private: ``Client._connection`` and its ``get_api_base_url_for_mtls()`` / ``API_BASE_URL``, as
    google-cloud-storage's own ``blob._get_host_name`` reads them.
    """
    connection = getattr(client, "_connection", None)
    if connection is None:
        raise _unsupported("google-cloud-storage", "Client._connection")
    if hasattr(connection, "get_api_base_url_for_mtls"):
        url = connection.get_api_base_url_for_mtls()
    else:
        url = getattr(connection, "API_BASE_URL", None)
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise _unsupported("google-cloud-storage", "Connection.API_BASE_URL (an http(s) URL)")
    return url.rstrip("/")


def pool_size(session: requests.Session, url: str) -> int | None:
    """How many connections the session's adapter for ``url`` keeps; ``None`` when it does not say.

    Private: ``requests.adapters.HTTPAdapter._pool_maxsize``.
    """
    size = getattr(session.get_adapter(url), "_pool_maxsize", None)
    return size if isinstance(size, int) else None


def raw_body_reader(response: requests.Response) -> Any:
    """What to ``readinto`` a streamed response body from, with as few copies as possible.

    For a body without content encoding, the ``http.client`` response under urllib3 receives
    straight into the caller's buffer (urllib3's own ``readinto`` reads into a temporary and copies);
    otherwise urllib3's decoding reader. Private: ``urllib3.response.HTTPResponse._fp``.
    """
    raw = response.raw
    inner = getattr(raw, "_fp", None)
    encoding = response.headers.get("Content-Encoding", "identity").lower()
    if encoding == "identity" and hasattr(inner, "readinto"):
        return inner
    if not hasattr(raw, "readinto") or not hasattr(raw, "decode_content"):
        raise _unsupported("urllib3", "HTTPResponse.readinto and decode_content")
    raw.decode_content = True  # what requests asks for when it iterates a body itself
    return raw


def release_read_connection(response: requests.Response, reader: Any) -> None:
    """Hand ``response``'s connection back to its session's pool once ``reader`` (from
    :func:`raw_body_reader`) has read the whole body, so that the next request reuses it (on GCS: no
    new TLS handshake per range).

    urllib3 pools a connection by itself only when the body was read through urllib3; a body read from
    the ``http.client`` response under it would close the connection with the response. A body not read
    to its end keeps that behaviour: the connection is closed, never reused with bytes still in flight.
    Private: ``urllib3.response.HTTPResponse._fp`` (``release_conn`` is public).
    """
    raw = response.raw
    if reader is getattr(raw, "_fp", None) and reader.isclosed():
        raw.release_conn()
