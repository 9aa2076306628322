"""Listing a directory that live processes are changing."""
from __future__ import annotations

import os
from pathlib import Path


def files_under(root: str | Path) -> list[str]:
    """Every file under ``root`` (links included), relative to it, sorted.

    A directory removed or renamed while it is listed (a save's staging directory, published under its
    final name) is passed over: ``os.walk`` ignores the error, where ``Path.rglob`` raises it before
    Python 3.13.
    """
    return sorted(os.path.relpath(os.path.join(directory, name), root)
                  for directory, _, names in os.walk(root) for name in names)
