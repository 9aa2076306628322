"""Retries with exponential backoff for transient GCS failures (429, 5xx, connection resets), and
the deadline of a public operation, which bounds every request and every retry inside it."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import requests

from dataflux_ckpt.errors import DataCorruptionError, DeadlineExceededError, HttpStatusError

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_RETRYABLE_TRANSPORT_ERRORS = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    ConnectionError,
    TimeoutError,
    # A part whose bytes arrived damaged is sent again.
    DataCorruptionError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another attempt."""
    if isinstance(exc, DeadlineExceededError):
        return False
    if isinstance(exc, _RETRYABLE_TRANSPORT_ERRORS):
        return True
    if isinstance(exc, HttpStatusError):
        return exc.status in RETRYABLE_STATUS
    return False


class Deadline:
    """The end of one public operation (a save, a load...): requests get at most the time left, and
    retries stop there with a :class:`DeadlineExceededError` naming the operation and target.

    Args:
        seconds: how long the operation may take from now.
        operation: what is running, for the error (``"save"``, ``"load"``...).
        target: the ``gs://`` path or prefix it works on.
    """

    def __init__(self, seconds: float, operation: str, target: str) -> None:
        if not seconds > 0:
            raise ValueError(f"a deadline must be positive, not {seconds!r}")
        self.seconds, self.operation, self.target = seconds, operation, target
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left (negative once expired)."""
        return self._end - time.monotonic()

    def expired(self) -> bool:
        """Whether no time is left."""
        return self.remaining() <= 0

    def exceeded(self, detail: str = "") -> DeadlineExceededError:
        """The error to raise now that the deadline has passed."""
        return DeadlineExceededError(self.operation, self.target, self.seconds, detail)

    def check(self, detail: str = "") -> None:
        """Raise :class:`DeadlineExceededError` if the deadline has passed."""
        if self.expired():
            raise self.exceeded(detail)

    def timeout(self, connect_s: float, read_s: float) -> tuple[float, float]:
        """A ``requests`` timeout that ends no later than the deadline.

        Raises:
            DeadlineExceededError: no time is left.
        """
        left = self.remaining()
        if left <= 0:
            raise self.exceeded()
        return min(connect_s, left), min(read_s, left)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently one request (a part, a range, a compose) is retried.

    Args:
        attempts: tries per request, the first included.
        initial_backoff_s: pause after the first failure; each further pause is ``multiplier``
            times longer, up to ``max_backoff_s`` (each randomized down by up to half).
    """

    attempts: int = 6
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError(f"invalid retry policy {self!r}: attempts >= 1, backoffs >= 0 and multiplier >= 1")

    def call(self, fn: Callable[[], T], what: str, deadline: Deadline | None = None) -> T:
        """Run ``fn``, retrying transient failures; the last failure propagates.

        Raises:
            DeadlineExceededError: ``deadline`` passed before ``fn`` succeeded (chained to the last
                failure, if any).
        """
        delay_s = self.initial_backoff_s
        for attempt in range(1, self.attempts + 1):
            if deadline is not None:
                deadline.check(what)
            try:
                return fn()
            except DeadlineExceededError:
                raise
            except Exception as exc:
                if deadline is not None and deadline.expired():
                    raise deadline.exceeded(f"{what}: {exc}") from exc
                if attempt >= self.attempts or not is_transient(exc):
                    raise
                sleep_s = delay_s * random.uniform(0.5, 1.0)
                if deadline is not None:
                    sleep_s = min(sleep_s, max(deadline.remaining(), 0.0))
                log.warning("%s failed (attempt %d/%d): %s; retrying in %.2f s",
                            what, attempt, self.attempts, exc, sleep_s)
                time.sleep(sleep_s)
                delay_s = min(delay_s * self.multiplier, self.max_backoff_s)
        raise AssertionError("unreachable")
