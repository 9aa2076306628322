"""How the plugins speak to users: warnings once per process on rank zero, and plain-text messages.

Under DDP every rank runs the plugins' code; a warning logged there would repeat once per rank (and
once per plugin instance). :func:`warn_once` logs it once per process, on global rank zero only,
as Lightning's own ``rank_zero_warn`` does; other ranks log it at debug level. Texts that come from
other libraries (torch's weights-only error carries terminal colour codes) go through
:func:`plain_text` before they reach an exception.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

__all__ = ["global_rank", "plain_text", "warn", "warn_once"]

# ECMA-48 control sequences (colours, bold: ``\x1b[1m``), operating-system commands (a terminal's
# title: ``\x1b]0;...\x07``), the other escapes, and control characters but newline and tab.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]"
                      r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\x9b]")
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def plain_text(text: str) -> str:
    """``text`` without terminal escape sequences or control characters (newlines and tabs stay)."""
    return _ESCAPES.sub("", text)


def global_rank() -> int:
    """This process' global rank: Lightning's ``rank_zero_only.rank`` where Lightning is in use (its
    strategies set it; Lightning is not imported for this), else the launcher's ``RANK``, else 0."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    rank = getattr(getattr(rank_zero, "rank_zero_only", None), "rank", None)
    if rank is None:
        rank = os.environ.get("RANK") or 0
    return int(rank)


def warn(logger: logging.Logger, message: str, *args: object) -> None:
    """Log ``message % args`` as a warning on global rank zero (at debug level on other ranks)."""
    logger.log(logging.WARNING if global_rank() == 0 else logging.DEBUG, message, *args)


def warn_once(logger: logging.Logger, message: str, *args: object) -> None:
    """Log ``message % args`` as a warning the first time this process meets it, on global rank zero
    only (other ranks log it at debug level, once)."""
    text = message % args if args else message
    with _warned_lock:
        if (logger.name, text) in _warned:
            return
        _warned.add((logger.name, text))
    warn(logger, "%s", text)
