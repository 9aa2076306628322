"""Helpers for tests that start and signal real processes."""

from __future__ import annotations

import signal


def foreground_sigint() -> None:
    """``preexec_fn`` giving a child the SIGINT disposition of a foreground process.

    Python raises KeyboardInterrupt on SIGINT only if SIGINT was not ignored when it started, and a
    shell starts background jobs (CI runners among them) with SIGINT ignored.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
