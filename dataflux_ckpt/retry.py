"""Retries with exponential backoff for transient GCS failures (429, 5xx, connection resets)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import requests
from google.api_core import exceptions as api_exceptions
from google.cloud.storage import exceptions as media_exceptions

from dataflux_ckpt.errors import DataCorruptionError, HttpStatusError

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_RETRYABLE_API_ERRORS = (
    api_exceptions.TooManyRequests,
    api_exceptions.InternalServerError,
    api_exceptions.BadGateway,
    api_exceptions.ServiceUnavailable,
    api_exceptions.GatewayTimeout,
)
_RETRYABLE_TRANSPORT_ERRORS = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    ConnectionError,
    TimeoutError,
    # A part whose bytes arrived damaged is sent again.
    DataCorruptionError,
    media_exceptions.DataCorruption,
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another attempt."""
    if isinstance(exc, _RETRYABLE_TRANSPORT_ERRORS + _RETRYABLE_API_ERRORS):
        return True
    if isinstance(exc, HttpStatusError):
        return exc.status in RETRYABLE_STATUS
    if isinstance(exc, media_exceptions.InvalidResponse):
        return getattr(exc.response, "status_code", None) in RETRYABLE_STATUS
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently one request (a part, a range, a compose) is retried."""

    attempts: int = 6
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    multiplier: float = 2.0

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn``, retrying transient failures; the last failure propagates."""
        delay_s = self.initial_backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if attempt >= self.attempts or not is_transient(exc):
                    raise
                sleep_s = delay_s * random.uniform(0.5, 1.0)
                log.warning("%s failed (attempt %d/%d): %s; retrying in %.2f s",
                            what, attempt, self.attempts, exc, sleep_s)
                time.sleep(sleep_s)
                delay_s = min(delay_s * self.multiplier, self.max_backoff_s)
        raise AssertionError("unreachable")
