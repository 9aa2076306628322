"""``process_results``: every run's timings into one CSV, and plots, in ``SCALING_DIR/results/``.

Columns of the CSV: the run's name, command and date, its attributes (``clients``, ``db_nodes``,
``tensor_bytes``, ...), the versions it ran with (``*_version``), then ``FUNCTION_min``, ``_mean``,
``_max`` and ``_median`` for every function timed (``put_tensor``, ``unpack_tensor``, ``loop_time``,
...), and for throughput runs the aggregate GB/s of our client and of raw redis-py and their ratio.

Plots (PNG): ``box_FUNCTION.png``, one box per run of that function's times, and for throughput
runs ``throughput_dbN.png``: aggregate GB/s against tensor size, one line per client count, raw
redis-py dashed, the published SmartRedis client dotted, one figure per database size. The
published client's functions are timed as ``smartredis_FUNCTION`` (inference and aggregation runs
alternate it with ours round by round).
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import GB, format_markdown_table
from benchmarks.smartsim_scaling.launch import RUN_FILE, read_run

log = logging.getLogger(__name__)

RESULTS_DIR = "results"
CSV_NAME = "scaling_results.csv"
THROUGHPUT_TABLE = "throughput_table.md"
STATS = ("min", "mean", "max", "median")
# attributes that tell runs apart in plot labels, with their short tags (SmartSim-Scaling's run-name tags)
LABEL_TAGS = {
    "db_nodes": "DBN", "workers": "W", "clients": "C", "client_threads": "THR", "batch_size": "BS",
    "tensors_per_dataset": "TPD", "tensor_bytes": "TB",
}


# --------------------------------------------------------------------------------------------
# One run


def read_timings(run_dir: Path) -> dict[str, list[float]]:
    """Every ``rank,function,seconds`` row of the run's timing CSVs, grouped by function."""
    times: dict[str, list[float]] = defaultdict(list)
    for path in sorted(Path(run_dir).glob("*rank_*_timing.csv")):
        for line in path.read_text().splitlines():
            if line.strip():
                _, function, seconds = line.rsplit(",", 2)
                times[function].append(float(seconds))
    return dict(times)


def aggregate_gbps(nbytes: float, iterations: int, loop_times: Sequence[float]) -> float | None:
    """SmartSim-Scaling's aggregate throughput: ``nbytes * iterations / loop_time`` summed over clients, in GB/s."""
    if not loop_times:
        return None
    return sum(nbytes * iterations / t for t in loop_times) / GB


def significant(row: Mapping[str, Any], digits: int = 4) -> dict[str, Any]:
    """``row`` with its floats as strings of ``digits`` significant digits, for tables."""
    return {k: f"{v:.{digits}g}" if isinstance(v, float) else v for k, v in row.items()}


def _median(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def derived(attributes: Mapping[str, Any], times: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Per-command figures computed from the timings (throughput: GB/s of ours, of raw redis-py and of the
    published SmartRedis client, and their ratios)."""
    out: dict[str, Any] = {}
    loop = times.get("loop_time")
    iterations = attributes.get("iterations")
    if loop and iterations:
        # an aggregation consumer shares its iterations between the libraries: one get_list each
        per_loop = len(times["get_list"]) if times.get("get_list") else iterations
        out["loop_ms_per_iter"] = _median(loop) / per_loop * 1e3
    if "redis_loop_time" in times and attributes.get("tensor_bytes"):
        ours = aggregate_gbps(attributes["tensor_bytes"], iterations, loop)
        raw = aggregate_gbps(attributes["tensor_bytes"], iterations, times["redis_loop_time"])
        out.update(
            throughput_gbps=ours,
            redis_loop_ms_per_iter=_median(times["redis_loop_time"]) / iterations * 1e3,
            redis_gbps=raw,
            ratio_to_redis=ours / raw if ours is not None and raw else None,
        )
    published = times.get("smartredis_loop_time")
    if published and iterations:
        per_loop = len(times["smartredis_get_list"]) if times.get("smartredis_get_list") else iterations
        out["smartredis_loop_ms_per_iter"] = _median(published) / per_loop * 1e3
        if attributes.get("tensor_bytes") and "redis_loop_time" in times:
            gbps = aggregate_gbps(attributes["tensor_bytes"], iterations, published)
            out.update(smartredis_gbps=gbps,
                       smartredis_to_ours=gbps / out["throughput_gbps"] if gbps and out.get("throughput_gbps") else None)
    if "get_list" in times and attributes.get("tensor_bytes"):
        list_bytes = attributes["producers"] * attributes["tensors_per_dataset"] * attributes["tensor_bytes"]
        out["get_list_gbps"] = list_bytes / _median(times["get_list"]) / GB
    return out


def run_row(run_dir: Path) -> dict[str, Any]:
    """One CSV row: the run's identity, attributes, versions, per-function statistics and derived figures."""
    spec = read_run(run_dir)
    times = read_timings(run_dir)
    if not times:
        raise ValueError("no timing files (the run did not finish)")
    row: dict[str, Any] = {"name": spec["name"], "command": spec["command"], "date": spec["date"]}
    row.update(spec["attributes"])
    row.update(spec.get("system", {}))
    row.update({f"{key}_version": value for key, value in spec["versions"].items()})
    for function, values in sorted(times.items()):
        row.update({
            f"{function}_min": min(values),
            f"{function}_mean": statistics.fmean(values),
            f"{function}_max": max(values),
            f"{function}_median": statistics.median(values),
        })
    row.update(derived(spec["attributes"], times))
    return row


# --------------------------------------------------------------------------------------------
# All runs


def find_runs(scaling_dir: Path) -> list[Path]:
    return sorted(p.parent for p in Path(scaling_dir).glob(f"*/{RUN_FILE}"))


def collect(scaling_dir: Path, overwrite: bool = True):
    """The DataFrame of every run under ``scaling_dir``, merged with the existing CSV unless ``overwrite``."""
    import pandas as pd

    csv_path = Path(scaling_dir) / RESULTS_DIR / CSV_NAME
    rows = []
    for run_dir in find_runs(scaling_dir):
        try:
            rows.append(run_row(run_dir))
        except (OSError, ValueError, KeyError) as exc:  # an unfinished or broken run: say so, go on
            log.warning("skipping %s: %s", run_dir, exc)
    frame = pd.DataFrame(rows)
    if not overwrite and csv_path.exists():
        old = pd.read_csv(csv_path)
        if not frame.empty:
            old = old[~old["name"].isin(frame["name"])]
        frame = pd.concat([old, frame], ignore_index=True)
    return frame


def _varying_label(frame, index: int) -> str:
    parts = []
    for key, tag in LABEL_TAGS.items():
        if key in frame and frame[key].nunique(dropna=True) > 1:
            parts.append(f"{tag}{frame[key].iloc[index]}")
    return " ".join(parts) or str(frame["name"].iloc[index])


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _box_plots(frame, scaling_dir: Path, out_dir: Path, plt) -> list[Path]:
    present = frame[frame["name"].map(lambda n: (Path(scaling_dir) / n / RUN_FILE).exists())]
    if present.empty:
        return []
    order = [k for k in LABEL_TAGS if k in present]
    present = present.sort_values(order).reset_index(drop=True)
    samples = [read_timings(Path(scaling_dir) / name) for name in present["name"]]
    labels = [_varying_label(present, i) for i in range(len(present))]
    functions = sorted({f for s in samples for f in s if f != "main()"})
    paths = []
    for function in functions:
        data = [(label, s[function]) for label, s in zip(labels, samples, strict=True) if s.get(function)]
        fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(data) + 2), 4.5))
        ax.boxplot([d for _, d in data], showfliers=True)
        ax.set_xticks(range(1, len(data) + 1), [lbl for lbl, _ in data], rotation=75, fontsize=7)
        ax.set_ylabel("seconds")
        ax.set_title(f"{function} across runs")
        if all(min(d) > 0 for _, d in data):
            ax.set_yscale("log")
        paths.append(_save(fig, out_dir / f"box_{function.replace('()', '').strip('_')}.png", plt))
    return paths


def _size_label(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def _throughput_plots(frame, out_dir: Path, plt) -> list[Path]:
    if "throughput_gbps" not in frame:
        return []
    data = frame[frame["throughput_gbps"].notna()]
    paths = []
    for db_nodes, group in data.groupby("db_nodes"):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, (clients, by_clients) in enumerate(group.groupby("clients")):
            columns = ["throughput_gbps", "redis_gbps", *(["smartredis_gbps"] if "smartredis_gbps" in group else [])]
            curve = by_clients.groupby("tensor_bytes")[columns].median().sort_index()
            color = f"C{i}"
            who = f"{clients} client{'s' if clients != 1 else ''}"
            ax.plot(curve.index, curve["throughput_gbps"], ".-", color=color, label=f"{who}: smartredis_io")
            ax.plot(curve.index, curve["redis_gbps"], "x--", color=color, alpha=0.6,
                    label=f"{who}: raw redis-py SET/GET")
            if "smartredis_gbps" in curve and curve["smartredis_gbps"].notna().any():
                ax.plot(curve.index, curve["smartredis_gbps"], "s:", color=color, alpha=0.8,
                        label=f"{who}: published SmartRedis 0.6.1 (module)")
        sizes = sorted(group["tensor_bytes"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_size_label(s) for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("tensor size")
        ax.set_ylabel("aggregate throughput [GB/s]")
        kind = "standalone" if int(db_nodes) == 1 else f"{int(db_nodes)}-shard cluster"
        ax.set_title(f"put_tensor + unpack_tensor throughput, {kind} Redis")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / f"throughput_db{int(db_nodes)}.png", plt))
    return paths


def throughput_table(frame) -> str:
    """Markdown: loop time and GB/s against tensor size per database size and client count, with ratio."""
    if "throughput_gbps" not in frame:
        return ""
    data = frame[frame["throughput_gbps"].notna()].sort_values(["db_nodes", "clients", "tensor_bytes"])
    rows = [
        {
            "db": "standalone" if int(r.db_nodes) == 1 else f"cluster x{int(r.db_nodes)}",
            "clients": int(r.clients),
            "tensor": _size_label(r.tensor_bytes),
            "loop": r.loop_time_median,
            "ms": r.loop_ms_per_iter,
            "gbps": r.throughput_gbps,
            "raw_ms": r.redis_loop_ms_per_iter,
            "raw_gbps": r.redis_gbps,
            "ratio": r.ratio_to_redis,
            "published_gbps": getattr(r, "smartredis_gbps", None),
            "published_ratio": getattr(r, "smartredis_to_ours", None),
        }
        for r in data.itertuples()
    ]
    return format_markdown_table([significant(r) for r in rows], {
        "db": "database", "clients": "clients", "tensor": "tensor",
        "loop": "loop_time (s, median)", "ms": "ms / iteration", "gbps": "GB/s",
        "raw_ms": "redis-py ms / iteration", "raw_gbps": "redis-py GB/s", "ratio": "ratio to redis-py",
        "published_gbps": "SmartRedis 0.6.1 GB/s", "published_ratio": "SmartRedis / smartredis_io",
    })


def process_results(scaling_dir: str | Path, overwrite: bool = True) -> dict[str, Any]:
    """Write the CSV, the plots and (for throughput) the markdown table; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling_dir = Path(scaling_dir)
    if not scaling_dir.is_dir():
        raise FileNotFoundError(f"scaling directory {scaling_dir} does not exist")
    out_dir = scaling_dir / RESULTS_DIR
    out_dir.mkdir(exist_ok=True)
    frame = collect(scaling_dir, overwrite)
    if frame.empty:
        raise ValueError(f"no runs (directories with {RUN_FILE}) under {scaling_dir}")
    csv_path = out_dir / CSV_NAME
    frame.to_csv(csv_path, index=False)
    plots = _box_plots(frame, scaling_dir, out_dir, plt) + _throughput_plots(frame, out_dir, plt)
    table = throughput_table(frame)
    table_path = None
    if table:
        table_path = out_dir / THROUGHPUT_TABLE
        table_path.write_text(table + "\n")
    log.info("%d runs -> %s, %d plots", len(frame), csv_path, len(plots))
    return {"csv": csv_path, "plots": plots, "table": table, "table_path": table_path, "runs": len(frame)}
