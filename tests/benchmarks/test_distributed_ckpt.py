"""`python -m benchmarks.distributed_ckpt` end to end on 2 ranks and a few MiB: every row saves and
loads the same sharded state (verified), and the JSON carries times per rank, memory and ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_help_names_the_options() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.distributed_ckpt", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    for word in ("--ranks", "--size_mb", "--repeat", "--rows", "--json", "--peer-path", "--gcs-root"):
        assert word in out


@pytest.mark.slow
def test_two_ranks_every_local_and_gcs_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "DATAFLUX_PEER_PATH"}
    rows = ["filesystem", "fastpersist", "raw_local", "fsspec", "dataflux", "raw_gcs", "raw_gcs_parts", "dcp_protocol"]
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.distributed_ckpt", "--ranks", "2", "--size_mb", "8", "--tensors", "4",
         "--repeat", "1", "--rows", *rows, "--folder", str(tmp_path), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = {row["row"]: row for row in json.loads(out.read_text())}
    assert set(data) == set(rows)
    protocol = data.pop("dcp_protocol")  # moves no tensor bytes: nothing to verify, no ratios of its own
    assert protocol["verified"] is None and protocol["save_vs_ceiling"] is None and protocol["save_s"] > 0
    for row in data.values():
        assert row["verified"] and row["ranks"] == 2 and len(row["save_per_rank_s"]) == 2
        assert row["save_s"] > 0 and row["load_s"] > 0 and row["save_extra_rss_mib"] >= 0
    assert data["fastpersist"]["save_vs_baseline"] > 0 and data["dataflux"]["load_vs_baseline"] > 0
    assert data["dataflux"]["save_vs_ceiling"] > 0 and data["raw_gcs"]["save_vs_ceiling"] == 1.0
    # the dataflux row against the ceiling of its own transfer path (XML multipart parts, ranged GETs)
    assert data["dataflux"]["save_vs_path_ceiling"] > 0 and data["dataflux"]["load_vs_path_ceiling"] > 0
    assert data["raw_gcs_parts"]["save_vs_ceiling"] > 0 and data["fsspec"]["save_vs_path_ceiling"] is None
    # a row against its ceiling plus DCP's own cost: more than against the ceiling alone
    assert data["fastpersist"]["save_vs_ceiling_dcp"] > data["fastpersist"]["save_vs_ceiling"]
    assert data["raw_local"]["save_vs_ceiling_dcp"] is None
    assert list(tmp_path.glob("run-*")) == []  # the local rows' checkpoints are removed
