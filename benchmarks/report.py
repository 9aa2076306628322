"""Timing and reporting helpers shared by every benchmark runner: medians, peak RSS, tables, JSON."""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

RSS_SAMPLE_INTERVAL_S = 0.01
MB = 1e6
PROJECT_LOGGERS = ("benchmarks", "lightning_storage_plugins", "dataflux_ckpt", "fastpersist", "smartredis_io")


def configure_logging(level: int = logging.INFO) -> None:
    """Print this project's records at ``level`` and other libraries' warnings, each record once."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(
        lambda record: record.levelno >= logging.WARNING or record.name.startswith(PROJECT_LOGGERS)
    )
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.WARNING, level))
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level)


def timed(
    run: Callable[[], Any], repeat: int, before: Callable[[], None] = lambda: None
) -> tuple[float, Any]:
    """Median seconds of ``repeat`` runs (``before`` runs untimed ahead of each) and the last result."""
    times, result = [], None
    for _ in range(repeat):
        before()
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def median_seconds(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median wall-clock seconds of ``repeat`` calls of ``fn``."""
    return timed(fn, repeat)[0]


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or None when either is missing or the reference is zero."""
    if value is None or not reference:
        return None
    return value / reference


class PeakRSS:
    """Sample this process' resident set size in a thread; ``peak_mb`` after the block.

    A sampler rather than ``ru_maxrss`` because the latter cannot be reset between measurements.
    """

    def __init__(self, interval_s: float = RSS_SAMPLE_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._process = psutil.Process(os.getpid())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_mb = 0.0
        self.peak_mb = 0.0

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak_mb = max(self.peak_mb, self._process.memory_info().rss / MB)

    def __enter__(self) -> PeakRSS:
        self.start_mb = self.peak_mb = self._process.memory_info().rss / MB
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak_mb = max(self.peak_mb, self._process.memory_info().rss / MB)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> str:
    """A plain-text table of ``rows``; ``columns`` maps row keys to header titles."""
    headers = list(columns.values())
    body = [[_cell(row.get(key)) for key in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = [
        " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
        "-+-".join("-" * w for w in widths),
    ]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


def write_json(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """Write ``rows`` as a JSON list of objects, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(rows), indent=2) + "\n")


def format_markdown_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> str:
    """A GitHub-flavoured markdown table of ``rows``; ``columns`` maps row keys to header titles."""
    lines = [
        "| " + " | ".join(columns.values()) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(_cell(row.get(key)) for key in columns) + " |" for row in rows]
    return "\n".join(lines)


def latencies_seconds(fn: Callable[[], object], calls: int) -> list[float]:
    """Wall-clock seconds of each of ``calls`` calls of ``fn`` (for medians and percentiles of latency)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times
