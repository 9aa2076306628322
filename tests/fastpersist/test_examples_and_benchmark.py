"""The DeepNVMe-style example scripts and the FastPersist benchmark, each run once on small sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "deepnvme"
GPU_EXAMPLES = [
    ("py_load_gpu_tensor", "--input_file"),
    ("aio_load_gpu_tensor", "--input_file"),
    ("gds_load_gpu_tensor", "--input_file"),
    ("py_store_gpu_tensor", "--nvme_folder"),
    ("aio_store_gpu_tensor", "--nvme_folder"),
    ("gds_store_gpu_tensor", "--nvme_folder"),
]
SUMMARY_LINE = r"^\S+\s+-- \d+\.\d\d GB, \d+\.\d\d secs, \d+\.\d\d GB/s$"


def run(*cmd: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_store_then_load_scripts_report_throughput_and_validate(ckpt_dir: Path, aio_engine: str) -> None:
    stored = run("bash", str(EXAMPLES / "run_store_tensor.sh"), str(ckpt_dir), "4", "1")
    assert stored.returncode == 0, stored.stderr[-2000:]
    for name in ("py_store_cpu_tensor", "aio_store_cpu_tensor"):
        assert (
            f"{name} -- 0.00 GB" in stored.stdout
            and (ckpt_dir / f"{name}_4MB.pt").stat().st_size == 4 * 1024**2
        )
    assert "aio_store_cpu_tensor validation success" in stored.stdout
    loaded = run(
        "bash", str(EXAMPLES / "run_load_tensor.sh"), str(ckpt_dir / "aio_store_cpu_tensor_4MB.pt"), "1"
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert (
        "py_load_cpu_tensor -- " in loaded.stdout
        and "aio_load_cpu_tensor validation success" in loaded.stdout
    )


REFUSAL_CHECK = """
import runpy, sys
for name, flag, value in {cases!r}:
    sys.argv = [name, flag, value]
    try:
        runpy.run_path({examples!r} + "/" + name + ".py", run_name="__main__")
        print(name, "ran")
    except SystemExit as done:
        print(name, "exit", repr(done.code))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_gpu_and_gds_scripts_refuse_cleanly_without_cuda(ckpt_dir: Path) -> None:
    (ckpt_dir / "input.bin").write_bytes(bytes(4096))
    cases = [
        (name, flag, str(ckpt_dir / "input.bin" if "load" in name else ckpt_dir))
        for name, flag in GPU_EXAMPLES
    ]
    # One interpreter runs every script as __main__ (as `python script.py` would): imports torch once.
    done = run(sys.executable, "-c", REFUSAL_CHECK.format(cases=cases, examples=str(EXAMPLES)), cwd=EXAMPLES)
    assert done.returncode == 0, done.stderr[-2000:]
    for name, _ in GPU_EXAMPLES:
        assert (
            f"{name} exit '{name}: CUDA is not available on this machine; this example needs a GPU'"
            in done.stdout
        )


@pytest.mark.slow
def test_benchmark_tensor_workload_on_tiny_sizes(ckpt_dir: Path, aio_engine: str) -> None:
    report = ckpt_dir / "out" / "fastpersist.json"
    done = run(
        sys.executable, "-m", "benchmarks.fastpersist", "tensor", "--folder", str(ckpt_dir), "--io_buffer_mb", "2",
        "--size_mb", "4", "--num_tensors", "16", "--repeat", "2", "--json", str(report),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(report.read_text())
    names = [row["name"] for row in rows]
    assert names == [
        "test_save", "test_fastpersist_aio_nopatch", "test_fastpersist_py_nopatch",
        "test_torch_load", "test_fastpersist_load", "raw_odirect_write", "raw_odirect_read",
        "raw_odirect_read_new_memory",
    ]  # fmt: skip
    by_name = {row["name"]: row for row in rows}
    assert by_name["test_fastpersist_load"]["vs_ceiling_new_memory"] > 0
    assert by_name["test_save"]["vs_ceiling_new_memory"] is None
    assert all(
        {"name", "bytes", "seconds", "seconds_min", "seconds_max", "gbps", "engine"} <= set(row)
        for row in rows
    )
    assert all(row["seconds_min"] <= row["seconds"] <= row["seconds_max"] for row in rows)
    assert all(row["cpu_seconds"] > 0 for row in rows)  # every row costs the process some CPU
    assert {row["engine"] for row in rows if "nopatch" in row["name"]} == {"aio", "python"}
    assert all(row["bytes"] >= 4 * 1024**2 and row["gbps"] > 0 for row in rows)
    import re

    summary_lines = [line for line in done.stdout.splitlines() if " -- " in line]
    assert len(summary_lines) == 8 and all(re.match(SUMMARY_LINE, line) for line in summary_lines)
    assert not [p for p in ckpt_dir.iterdir() if p.is_file()], "benchmark left data files behind"


@pytest.mark.slow
def test_save_adds_at_most_the_pinned_buffer_plus_64_mib_of_resident_memory(
    ckpt_dir: Path, aio_engine: str
) -> None:
    # A fresh process: peak RSS (ru_maxrss) before and after one 256 MiB save with a 16 MiB buffer.
    script = f"""
import resource, torch
from fastpersist import fastpersist_save, get_aio_handle, get_pinned_buffer
handle = get_aio_handle(); buffer = get_pinned_buffer(16, handle); buffer.fill_(0)
state = {{f"w{{i}}": torch.randn(2 * 1024**2) for i in range(32)}}
fastpersist_save({{"warm": torch.ones(10)}}, {str(ckpt_dir / "warm.pt")!r}, handle, buffer)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fastpersist_save(state, {str(ckpt_dir / "big.pt")!r}, handle, buffer)
print("extra_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    done = run(sys.executable, "-c", script)
    assert done.returncode == 0, done.stderr[-2000:]
    extra_mib = int(done.stdout.split("extra_kib")[-1]) / 1024
    assert extra_mib <= 16 + 64, f"save added {extra_mib:.0f} MiB of resident memory"


@pytest.mark.slow
def test_benchmark_deepspeed_workload_compares_durable_with_durable(ckpt_dir: Path, aio_engine: str) -> None:
    report = ckpt_dir / "out" / "deepspeed.json"
    done = run(
        sys.executable, "-m", "benchmarks.fastpersist", "deepspeed", "--folder", str(ckpt_dir), "--io_buffer_mb", "4",
        "--params", "1M", "--repeat", "1", "--json", str(report),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(report.read_text())}
    assert list(rows) == ["test_deepspeed_save", "test_deepspeed_save_durable", "test_deepspeed_fastpersist"]
    assert rows["test_deepspeed_save_durable"]["vs_baseline"] == 1.0
    assert (
        "not durable" in rows["test_deepspeed_save"]["note"]
        and "durable" in rows["test_deepspeed_fastpersist"]["note"]
    )
    assert not list(ckpt_dir.glob("deepspeed_*"))
