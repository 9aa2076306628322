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
import threading

__all__ = ["plain_text", "warn_once"]

# ECMA-48 control sequences (colours, bold: ``\x1b[1m``) and the other C0/C1 escapes.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\x9b]")
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def plain_text(text: str) -> str:
    """``text`` without terminal escape sequences or control characters (newlines and tabs stay)."""
    return _ESCAPES.sub("", text)


def global_rank() -> int:
    """This process' global rank: Lightning's ``rank_zero_only.rank`` where Lightning is present (the
    strategy sets it), else the launcher's ``RANK`` variable, else 0."""
    try:
        from lightning.fabric.utilities.rank_zero import rank_zero_only
    except ImportError:
        return int(os.environ.get("RANK", 0) or 0)
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def warn_once(logger: logging.Logger, message: str, *args: object) -> None:
    """Log ``message % args`` as a warning the first time this process meets it, on global rank zero
    only (other ranks log it at debug level, once)."""
    text = message % args if args else message
    with _warned_lock:
        if (logger.name, text) in _warned:
            return
        _warned.add((logger.name, text))
    logger.log(logging.WARNING if global_rank() == 0 else logging.DEBUG, "%s", text)
