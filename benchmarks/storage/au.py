"""au: accelerator utilization (AU) of a training loop that checkpoints through each plugin.

A simulated accelerator step is a sleep of ``--compute-ms`` (as MLPerf Storage simulates training);
every ``--every`` steps the model state (random float32 tensors of ``--model-size`` bytes in all) is
saved through the plugin, synchronously ("sync"), through Lightning's ``AsyncCheckpointIO`` ("async"),
or through the plugin's own async path where it has one ("native-async"). The stall is the time the
loop spends inside ``save_checkpoint`` plus, for async modes, the wait for the last save at the end
(``teardown``), so an async run is charged for everything it left unfinished. "stall/save" is the
whole stall over the number of saves; "in call" leaves the final wait out (what each save call costs).

    AU = compute / (compute + stall), compute = steps x compute-ms;  AU < 90 % is a fail (MLPerf Storage).

One untimed warm-up save per plugin and mode opens connections and files first. After each run the
last checkpoint is loaded back and checked (step and first tensor). Ratios: "x torch sync" is the stall
per save over that of the baseline (Lightning's TorchCheckpointIO, sync); "x raw write" is the stall per
save over a plain sequential write + fsync of the same bytes to the local work directory (its ceiling).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from benchmarks.plugins import PLUGINS, Plugin, ServiceOptions, Services
from benchmarks.report import MiB, format_table, median_seconds, ratio, write_json
from benchmarks.storage import parse_size, split_choices
from lightning_storage_plugins.services import MissingBinaryError

log = logging.getLogger(__name__)

AU_PASS_PERCENT = 90.0
DEFAULT_STEPS = 40
DEFAULT_EVERY = 10
DEFAULT_COMPUTE_MS = 250.0
DEFAULT_MODEL_SIZE = "256M"
DEFAULT_TENSORS = 16
FLOAT32_BYTES = 4
MS_PER_S = 1000.0
RAW_WRITE_REPEATS = 3
BASELINE = ("torch-local", "sync")
MODES = ("sync", "async", "native-async")
DEFAULT_MODES = ",".join(MODES)
# The plugins measured by default (any key of benchmarks.plugins.PLUGINS can be asked for).
DEFAULT_PLUGINS = ("torch-local", "fastpersist", "dataflux-tm", "smartredis")
# A plugin whose package or service binary is missing is reported as unavailable, with the reason.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (ImportError, MissingBinaryError)

# Keys of every JSON row (the tests check them).
AU_JSON_KEYS = (
    "benchmark", "plugin", "mode", "status", "reason", "steps", "every", "compute_ms", "saves",
    "checkpoint_bytes", "compute_s", "stall_s", "final_wait_s", "stall_per_save_s", "call_stall_per_save_s",
    "max_stall_s",
    "au_percent", "passed", "wall_s", "verified", "raw_write_s", "stall_per_save_vs_baseline",
    "stall_per_save_vs_raw_write",
)


@dataclass(frozen=True)
class LoopConfig:
    """The training-like loop: ``steps`` sleeps of ``compute_s``, a save every ``every`` steps."""

    steps: int
    every: int
    compute_s: float

    @property
    def compute_total_s(self) -> float:
        return self.steps * self.compute_s


def make_state(total_bytes: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A model state of random float32 tensors, ``total_bytes`` in all (rounded down to whole floats)."""
    elements = max(total_bytes // FLOAT32_BYTES, tensors)
    generator = torch.Generator().manual_seed(seed)
    sizes = [elements // tensors] * tensors
    sizes[-1] += elements - sum(sizes)
    return {f"layer{i}.weight": torch.rand(n, generator=generator) for i, n in enumerate(sizes)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of tensor data in ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


def checkpoint_at(state: dict[str, torch.Tensor], step: int) -> dict[str, Any]:
    """A Lightning-shaped checkpoint of ``state`` at ``step``."""
    return {"state_dict": state, "global_step": step, "epoch": 0}


def writer_for(
    io: CheckpointIO, mode: str, native_async: Callable[[CheckpointIO], CheckpointIO] | None = None
) -> CheckpointIO:
    """The CheckpointIO the loop saves through in ``mode``.

    Raises:
        NotImplementedError: ``native-async`` for a plugin without its own async path.
    """
    if mode == "sync":
        return io
    if mode == "async":
        return AsyncCheckpointIO(io)
    if mode == "native-async" and native_async is not None:
        return native_async(io)
    raise NotImplementedError(f"mode {mode!r} is not offered by this plugin")


def run_loop(
    io: CheckpointIO, path: str, mode: str, state: dict[str, torch.Tensor], cfg: LoopConfig,
    native_async: Callable[[CheckpointIO], CheckpointIO] | None = None,
) -> dict[str, Any]:
    """Run the loop once, saving to ``path`` through ``io`` in ``mode``; the measured row."""
    io.save_checkpoint(checkpoint_at(state, 0), path)  # warm-up: connections, files, buckets
    writer = writer_for(io, mode, native_async)
    stalls: list[float] = []
    last_saved = 0
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        time.sleep(cfg.compute_s)
        if step % cfg.every == 0:
            t0 = time.perf_counter()
            writer.save_checkpoint(checkpoint_at(state, step), path)
            stalls.append(time.perf_counter() - t0)
            last_saved = step
    t0 = time.perf_counter()
    if writer is not io:
        writer.teardown()  # waits for every pending save; charged as stall
    final_wait_s = time.perf_counter() - t0
    wall_s = time.perf_counter() - start
    stall_s = sum(stalls) + final_wait_s
    compute_s = cfg.compute_total_s
    au = 100.0 * compute_s / (compute_s + stall_s) if compute_s + stall_s > 0 else 100.0
    return {
        "mode": mode,
        "status": "ok",
        "reason": "",
        "steps": cfg.steps,
        "every": cfg.every,
        "compute_ms": cfg.compute_s * MS_PER_S,
        "saves": len(stalls),
        "checkpoint_bytes": state_bytes(state),
        "compute_s": compute_s,
        "stall_s": stall_s,
        "final_wait_s": final_wait_s,
        "stall_per_save_s": stall_s / len(stalls) if stalls else 0.0,
        "call_stall_per_save_s": sum(stalls) / len(stalls) if stalls else 0.0,
        "max_stall_s": max([*stalls, final_wait_s]),
        "au_percent": au,
        "passed": au >= AU_PASS_PERCENT,
        "wall_s": wall_s,
        "verified": verify(io, path, state, last_saved),
    }


def verify(io: CheckpointIO, path: str, state: dict[str, torch.Tensor], step: int) -> bool:
    """Whether the checkpoint at ``path`` is the one saved at ``step`` (step and first tensor match)."""
    loaded = io.load_checkpoint(path)
    name = next(iter(state))
    return loaded["global_step"] == step and torch.equal(loaded["state_dict"][name], state[name])


def missing_row(mode: str, status: str, reason: str) -> dict[str, Any]:
    """A row for a plugin and mode that could not be measured."""
    return {"mode": mode, "status": status, "reason": reason}


def run_plugin(
    name: str, plugin: Plugin, modes: Sequence[str], state: dict[str, torch.Tensor], cfg: LoopConfig,
    workdir: Path,
) -> list[dict[str, Any]]:
    """Every mode of one plugin, with its service up once for all of them."""
    rows: list[dict[str, Any]] = []
    try:
        reason = plugin.unavailable_reason()
        if reason:
            raise ImportError(reason)
        with Services(ServiceOptions(local_dir=str(workdir / name))) as services:
            io = plugin.make(services, "auto")
            root = services.directory(plugin.storage)
            for mode in modes:
                if plugin.storage == "local":
                    Path(root, mode).mkdir(parents=True, exist_ok=True)  # some writers refuse a missing directory
                if mode == "native-async" and plugin.native_async is None:
                    rows.append(missing_row(mode, "n/a", "no async path of its own (native-async not measured)"))
                    continue
                log.info("au: %s %s", name, mode)
                try:
                    rows.append(run_loop(io, f"{root}/{mode}/last.ckpt", mode, state, cfg, plugin.native_async))
                except Exception as err:  # one failing mode must not hide the others
                    log.exception("au: %s %s failed", name, mode)
                    rows.append(missing_row(mode, "error", f"{type(err).__name__}: {err}"))
            io.teardown()
    except UNAVAILABLE_ERRORS as err:
        log.warning("au: %s unavailable: %s", name, err)
        rows = [missing_row(mode, "unavailable", f"{type(err).__name__}: {err}") for mode in modes]
    except Exception as err:
        log.exception("au: %s failed", name)
        done = {r["mode"] for r in rows}
        rows += [missing_row(m, "error", f"{type(err).__name__}: {err}") for m in modes if m not in done]
    return [{"benchmark": "storage.au", "plugin": name, **row} for row in rows]


def raw_write_seconds(directory: Path, size: int) -> float:
    """The ceiling: median seconds to write ``size`` bytes sequentially to ``directory`` and fsync."""
    path = directory / "raw-write.bin"
    block = os.urandom(min(size, 8 * MiB))

    def write() -> None:
        with open(path, "wb") as f:
            for offset in range(0, size, len(block)):
                f.write(block[: min(len(block), size - offset)])
            f.flush()
            os.fsync(f.fileno())

    try:
        return median_seconds(write, RAW_WRITE_REPEATS)
    finally:
        path.unlink(missing_ok=True)


def add_ratios(rows: list[dict[str, Any]], raw_write_s: float) -> None:
    """Stall per save relative to the baseline (torch, sync) and to the raw local write (ceiling)."""
    base = next((r for r in rows if (r["plugin"], r["mode"]) == BASELINE and r["status"] == "ok"), None)
    for row in rows:
        per_save = row.get("stall_per_save_s")
        row["raw_write_s"] = raw_write_s
        row["stall_per_save_vs_baseline"] = ratio(per_save, base["stall_per_save_s"] if base else None)
        row["stall_per_save_vs_raw_write"] = ratio(per_save, raw_write_s)
        for key in AU_JSON_KEYS:
            row.setdefault(key, None)


TABLE_COLUMNS = {
    "plugin": "plugin",
    "mode": "mode",
    "saves": "saves",
    "stall_per_save_s": "stall/save s",
    "call_stall_per_save_s": "in call s",
    "max_stall_s": "max stall s",
    "final_wait_s": "final wait s",
    "au_percent": "AU %",
    "result": "AU>=90%",
    "stall_per_save_vs_baseline": "x torch sync",
    "stall_per_save_vs_raw_write": "x raw write",
    "verified": "verified",
}


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    """The AU table, then why each plugin or mode that was not measured was not."""
    shown, unavailable = [], set()
    for r in rows:
        if r["status"] == "n/a" or r["plugin"] in unavailable:
            continue
        if r["status"] == "unavailable":  # one line for the whole plugin
            unavailable.add(r["plugin"])
            r = {**r, "mode": "-"}
        shown.append({**r, "result": ("PASS" if r["passed"] else "FAIL") if r["status"] == "ok" else r["status"]})
    lines = [format_table(shown, TABLE_COLUMNS)]
    reasons = {(r["plugin"], r["status"], r["reason"]): None for r in rows if r["status"] != "ok"}
    lines += [f"{plugin}: {status}: {reason}" for plugin, status, reason in reasons]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``au`` subcommand's flags."""
    parser.add_argument("--plugins", default=",".join(DEFAULT_PLUGINS),
                        help=f"comma-separated plugins (default %(default)s), any of: {', '.join(PLUGINS)}")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated subset of: {', '.join(MODES)} (native-async is measured "
                             "where a plugin has its own async path)")
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY, help="checkpoint every N steps (default %(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per run (default %(default)s)")
    parser.add_argument("--compute-ms", type=float, default=DEFAULT_COMPUTE_MS,
                        help="simulated accelerator time per step, in ms (a sleep; default %(default)s)")
    parser.add_argument("--model-size", type=parse_size, default=DEFAULT_MODEL_SIZE,
                        help="bytes of model state, e.g. 64M, 1G (random float32 tensors; default %(default)s)")
    parser.add_argument("--tensors", type=int, default=DEFAULT_TENSORS, help="tensors in the model state (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="directory for local checkpoints (default: a temporary directory, removed after)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON to this path")


def main(args: argparse.Namespace) -> int:
    """Measure every plugin and mode, print the table; 1 if a measurement failed, else 0."""
    plugins = split_choices(args.plugins, list(PLUGINS), "--plugins")
    modes = split_choices(args.modes, MODES, "--modes")
    if args.steps < 1 or args.every < 1 or args.compute_ms < 0 or args.tensors < 1:
        raise SystemExit("--steps, --every and --tensors must be positive, --compute-ms not negative")
    cfg = LoopConfig(args.steps, args.every, args.compute_ms / MS_PER_S)
    state = make_state(args.model_size, args.tensors)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="storage-au-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        raw_write_s = raw_write_seconds(workdir, state_bytes(state))
        rows = [row for name in plugins for row in run_plugin(name, PLUGINS[name], modes, state, cfg, workdir)]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    add_ratios(rows, raw_write_s)
    print(f"AU: {cfg.steps} steps x {args.compute_ms:g} ms compute, a save every {cfg.every} steps, "
          f"model state {state_bytes(state) / MiB:.0f} MiB in {len(state)} tensors; "
          f"raw local write of the same bytes {raw_write_s:.3f} s (median of {RAW_WRITE_REPEATS})\n")
    print(format_rows(rows))
    if args.json:
        write_json(args.json, rows)
    return 1 if any(r["status"] == "error" for r in rows) else 0
