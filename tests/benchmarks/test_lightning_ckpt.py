"""`python -m benchmarks.lightning_ckpt` end to end, on tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import lightning_ckpt
from tests.support.processes import foreground_sigint

ROOT = Path(__file__).resolve().parents[2]
JSON_KEYS = {"type", "layers", "size_mb", "save_s", "save_mbps", "load_s", "load_mbps", "peak_rss_mb"}
SERVICE_NAMES = {"fake-gcs-server", "redis-server"}


def _bench(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if k not in ("CKPT_DIR_PATH", "DATAFLUX_CKPT")}
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.lightning_ckpt", *args],
        cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=foreground_sigint, **kwargs,
    )


def test_help_lists_the_seed_variables():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.lightning_ckpt", "--help"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout
    for word in ("CKPT_DIR_PATH", "STEPS", "LAYERS", "PROJECT", "DATAFLUX_CKPT", "USE_TRANSFER_MANAGER",
                 "--compare", "--json"):
        assert word in out


def test_flags_win_over_environment(monkeypatch):
    monkeypatch.setenv("STEPS", "7")
    monkeypatch.setenv("LAYERS", "3")
    monkeypatch.setenv("USE_TRANSFER_MANAGER", "0")
    args = lightning_ckpt.parse_args(["--steps", "2"])
    assert (args.steps, args.layers, args.use_transfer_manager) == (2, 3, False)


def test_seed_selection_of_rows(monkeypatch):
    monkeypatch.delenv("CKPT_DIR_PATH", raising=False)
    names = lambda argv: [t.key for t in lightning_ckpt.select_types(lightning_ckpt.parse_args(argv))]  # noqa: E731
    assert names([]) == ["torch-local", "torch-gcsfs"]
    assert names(["--ckpt-dir", "gs://bucket/x"]) == ["torch-gcsfs"]
    assert names(["--ckpt-dir", "/tmp/x"]) == ["torch-local"]
    assert names(["--dataflux", "--no-use-transfer-manager"]) == ["dataflux-no-tm"]
    with pytest.raises(SystemExit, match="unknown --types"):
        names(["--types", "nope"])


@pytest.mark.slow
def test_embedded_default_prints_averages_table_and_json(tmp_path):
    out_json = tmp_path / "rows.json"
    proc = _bench("--json", str(out_json), env={"LAYERS": "1", "STEPS": "2"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert out.count("Average time to save one checkpoint:") == 2
    assert out.count("Average time to load one checkpoint:") == 2
    assert "TorchCheckpointIO (local)" in out and "TorchCheckpointIO (gcsfs)" in out
    rows = json.loads(out_json.read_text())
    assert [r["type"] for r in rows] == ["TorchCheckpointIO (local)", "TorchCheckpointIO (gcsfs)"]
    for row in rows:
        assert JSON_KEYS <= row.keys()
        assert row["layers"] == 1 and row["size_mb"] > 1 and row["save_mbps"] > 0 and row["load_mbps"] > 0
        assert len(row["save_times_s"]) == len(row["load_times_s"]) == 2
        assert row["save_median_s"] == pytest.approx(sum(row["save_times_s"]) / 2)
        assert 0 <= row["save_extra_rss_mb"] <= row["peak_rss_mb"]


@pytest.mark.parametrize("backend", ["memory", "filesystem"])
def test_compare_measures_ceilings_and_ratios(tmp_path, backend):
    out_json = tmp_path / "rows.json"
    proc = _bench("--compare", "--types", "torch-gcsfs,dataflux-tm", "--gcs-emulator-backend", backend,
                  "--json", str(out_json), env={"LAYERS": "1", "STEPS": "1"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert f"({backend} backend)" in out
    baseline, dataflux = json.loads(out_json.read_text())
    assert baseline["save_vs_baseline"] == baseline["load_vs_baseline"] == 1.0
    for key in ("ceiling_save_mbps", "ceiling_composite_save_mbps", "ceiling_load_mbps"):
        assert dataflux[key] > 0 and dataflux[key] == baseline[key]
    assert dataflux["save_vs_ceiling"] == pytest.approx(dataflux["save_median_mbps"] / dataflux["ceiling_save_mbps"])
    assert dataflux["save_vs_composite_ceiling"] == pytest.approx(
        dataflux["save_median_mbps"] / dataflux["ceiling_composite_save_mbps"])
    assert dataflux["load_vs_ceiling"] == pytest.approx(dataflux["load_median_mbps"] / dataflux["ceiling_load_mbps"])
    assert "Comp. ceil. MB/s" in out


def _service_children(pid: int) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(pid).children(recursive=True) if c.name() in SERVICE_NAMES]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_sigint_leaves_no_service_behind():
    proc = _bench("--types", "torch-gcsfs,smartredis", "--steps", "1000", env={"LAYERS": "1"})
    try:
        deadline = time.monotonic() + 120
        services: list[psutil.Process] = []
        while {p.name() for p in services} != SERVICE_NAMES:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "services did not start"
            time.sleep(0.2)
            services = _service_children(proc.pid)
        time.sleep(2)  # inside the fit / save loop
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        gone, alive = psutil.wait_procs(services, timeout=10)
        assert not alive, f"left behind: {alive}"
    finally:
        proc.kill()
