"""Timing and reporting helpers shared by every benchmark runner: medians, peak RSS, tables, JSON, charts.

Units, the same in every runner, its tables, JSON keys and charts: ``KB``, ``MB`` and ``GB`` are
decimal (10^3, 10^6, 10^9 bytes; "MB/s" and "GB/s" too), ``KiB``, ``MiB`` and ``GiB`` binary (2^10,
2^20, 2^30). Use :func:`per_second` for rates.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import psutil

RSS_SAMPLE_INTERVAL_S = 0.01
KB = 10**3
MB = 10**6
GB = 10**9
KiB = 2**10
MiB = 2**20
GiB = 2**30
PROJECT_LOGGERS = ("benchmarks", "lightning_storage_plugins", "dataflux_ckpt", "fastpersist", "smartredis_io")


# Libraries that print through handlers of their own, which the root logger's level does not reach.
SELF_PRINTING_LOGGERS = ("DeepSpeed",)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_self_printing_loggers() -> None:
    """Let libraries that print through their own handlers (DeepSpeed) show only their errors."""
    for name in SELF_PRINTING_LOGGERS:
        logging.getLogger(name).addFilter(_errors_only)  # kept when the library sets its level


def configure_logging(level: int = logging.INFO) -> None:
    """Print this project's records at ``level`` and other libraries' warnings, each record once
    (DeepSpeed's own console output: errors only, unless ``level`` is DEBUG)."""
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
    if level > logging.DEBUG:
        quiet_self_printing_loggers()


def timed(
    run: Callable[[], Any], repeat: int, before: Callable[[], None] = lambda: None
) -> tuple[float, Any]:
    """Median seconds of ``repeat`` runs (``before`` runs untimed ahead of each) and the last result.

    The previous run's result is freed before the clock starts, so no run pays for another's memory.
    """
    times, result = [], None
    for _ in range(repeat):
        result = None
        before()
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def median_seconds(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median wall-clock seconds of ``repeat`` calls of ``fn``."""
    return timed(fn, repeat)[0]


def per_second(nbytes: float, seconds: float, unit: int = MB) -> float:
    """``nbytes`` moved in ``seconds`` as ``unit``/s (``MB`` by default: decimal MB/s); 0 for no time."""
    return nbytes / unit / seconds if seconds > 0 else 0.0


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, minimum and maximum of ``values`` (at least one), for a table's "median (min-max)"."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def split_choices(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    """The comma-separated names in ``text``, each one of ``allowed`` and named once.

    Raises:
        SystemExit: a name is unknown or repeated, or none is given (the message names ``flag``). A
            runner keys a row's paths, objects and results by its name, so a repeat would share them.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise SystemExit(f"unknown {flag} {unknown}; choose from {', '.join(allowed)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SystemExit(f"{flag} names {', '.join(repeated)} more than once")
    return names


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


class CpuMeter:
    """CPU seconds (user + system) used by a set of processes: a benchmark and the services it drives.

    ``watch`` adds a process by name; ``snapshot`` reads them all; ``since(snapshot)`` is what each
    used from then on. A process that has exited counts as having used nothing more.
    """

    def __init__(self) -> None:
        self._processes: dict[str, psutil.Process] = {}

    def watch(self, name: str, pid: int | None) -> None:
        if pid is not None:
            self._processes[name] = psutil.Process(pid)

    def snapshot(self) -> dict[str, float]:
        seen = {}
        for name, process in self._processes.items():
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            seen[name] = times.user + times.system
        return seen

    def since(self, before: Mapping[str, float]) -> dict[str, float]:
        now = self.snapshot()
        return {name: now[name] - before[name] for name in before if name in now}


class RowProgress:
    """The progress of one benchmark row: a bar on a terminal, else one plain line once it is done.

    Output sent to a file or a pipe (a CI log, ``tee``) gets no cursor movement: each finished row
    writes ``name: N ops in S s``, and nothing is redrawn. Made by :func:`row_progress`.
    """

    def __init__(self, name: str, total: int, unit: str, stream: TextIO, bar: Any = None) -> None:
        self.name, self.total, self.unit = name, total, unit
        self._stream, self._bar = stream, bar
        self._done = 0
        self._start = time.perf_counter()

    def update(self, count: int = 1) -> None:
        """``count`` more of the row's operations have finished."""
        self._done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self._done == self.total:
            seconds = time.perf_counter() - self._start
            self._stream.write(f"{self.name}: {self._done} {self.unit}s in {seconds:.1f} s\n")
            self._stream.flush()

    def close(self) -> None:
        """End the bar (a row stopped before it finished writes nothing more)."""
        if self._bar is not None:
            self._bar.close()


def row_progress(names: Sequence[str], totals: Sequence[int], unit: str = "op",
                 stream: TextIO | None = None) -> list[RowProgress]:
    """One :class:`RowProgress` per row, on ``stream`` (default: standard error): tqdm bars, one line
    each, where the stream is a terminal; plain lines, one per finished row, anywhere else."""
    stream = stream if stream is not None else sys.stderr
    width = max((len(name) for name in names), default=0)
    if not stream.isatty():
        return [RowProgress(name, total, unit, stream) for name, total in zip(names, totals, strict=True)]
    from tqdm import tqdm

    return [RowProgress(name, total, unit, stream, tqdm(total=total, desc=name.ljust(width), unit=unit, position=index,
                                                         leave=True, file=stream, dynamic_ncols=True))
            for index, (name, total) in enumerate(zip(names, totals, strict=True))]


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


def bar_chart(
    path: str | os.PathLike[str],
    labels: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    spreads: Mapping[str, Sequence[tuple[float, float] | None]] | None = None,
    lines: Sequence[tuple[str, float, str]] = (),
    title: str = "",
    xlabel: str = "",
) -> Path:
    """Write a horizontal grouped bar chart as PNG: one group per label, one bar per series.

    Args:
        path: the PNG to write (parent directories are created).
        labels: one group per label, top to bottom.
        series: bar values per series name, one per label (None: no bar).
        spreads: per series, ``(low, high)`` whiskers per label (None: none).
        lines: ``(name, value, series)`` reference lines (ceilings), drawn across the chart in the
            colour of ``series``.
        title: chart title.
        xlabel: value axis label.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(series)
    height = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(10, 2.2 + 0.45 * len(labels) * max(len(names), 1)), layout="constrained")
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    for i, name in enumerate(names):
        positions = [g + (i - (len(names) - 1) / 2) * height for g in range(len(labels))]
        values = [v if v is not None else 0.0 for v in series[name]]
        xerr = None
        whiskers = (spreads or {}).get(name)
        if whiskers:
            xerr = [[max(v - (w[0] if w else v), 0.0) for v, w in zip(values, whiskers, strict=True)],
                    [max((w[1] if w else v) - v, 0.0) for v, w in zip(values, whiskers, strict=True)]]
        ax.barh(positions, values, height=height * 0.95, color=colors[name], label=name, xerr=xerr,
                error_kw={"elinewidth": 0.8, "capsize": 2})
        ends = [max(v, w[1]) if w else v for v, w in zip(values, whiskers or [None] * len(values), strict=True)]
        for y, value, end in zip(positions, series[name], ends, strict=True):
            if value is not None:
                ax.text(end, y, f" {value:.0f}", va="center", fontsize=7)
    styles = ["--", ":", "-.", (0, (5, 1)), (0, (1, 1))]
    for j, (name, value, of_series) in enumerate(lines):
        ax.axvline(value, color=colors.get(of_series, "grey"), linestyle=styles[j % len(styles)], linewidth=1.2,
                   label=f"{name}: {value:.0f}")
    ax.set_yticks(range(len(labels)), labels=labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title("\n".join(textwrap.wrap(title, 95)), fontsize=9)
    fig.legend(fontsize=7, loc="outside lower center", ncols=2)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
