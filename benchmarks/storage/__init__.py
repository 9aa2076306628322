"""Storage characterization (fio profiles) and checkpoint stall / accelerator utilization (AU).

``python -m benchmarks.storage fio --help`` and ``python -m benchmarks.storage au --help``.
"""

from __future__ import annotations

import re

from benchmarks.report import GiB, KiB, MiB, split_choices

__all__ = ["GiB", "KiB", "MiB", "format_size", "parse_size", "split_choices"]

_SIZE_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional binary suffix (``512K``, ``64M``, ``1G``, ``1GiB``).

    Raises:
        ValueError: ``text`` is not such a size, or is not positive.
    """
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 4K, 64M, 1G)")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


def format_size(size: int) -> str:
    """``size`` bytes in the largest binary unit that divides it (``1G``, ``64M``, ``4K``, ``100``)."""
    for suffix in ("T", "G", "M", "K"):
        unit = _SIZE_UNITS[suffix]
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
