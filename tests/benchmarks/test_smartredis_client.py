"""python -m benchmarks.smartredis_client end to end on tiny settings: every row, the JSON, the bars."""

from __future__ import annotations

import json

import pytest

from benchmarks.smartredis_client import main
from benchmarks.smartsim_scaling.launch import published_available


@pytest.mark.slow
def test_every_row_with_its_ratio_and_bar(tmp_path, capsys) -> None:
    out = tmp_path / "client.json"
    assert main(["--sizes", "1024", "1048576", "--rounds", "2", "--calls", "5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    metrics = [row["metric"] for row in rows]
    assert sum("put_tensor+unpack_tensor" in m for m in metrics) == 4  # 2 sizes x (standalone, cluster)
    assert any("payload-sized buffers" in m for m in metrics)
    # TorchScript and torch.export, each through an external worker and through the module's own
    assert sum("run_model tiny model" in m and "started by the Redis module" not in m for m in metrics) == 2
    assert sum("run_model tiny model" in m and "started by the Redis module" in m for m in metrics) == 2
    for row in rows:
        if "put_tensor" in row["metric"]:
            assert row["ours"] > 0 and row["baseline"] > 0 and row["ceiling"] > 0
            assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"])
            assert row["bar"].startswith(">= 1.0" if row["bytes"] >= 1 << 20 else ">= 0.9")
            assert all(len(times) == 2 for times in row["rounds"].values()), "the loops took turns in 2 rounds"
            if published_available():  # the third client, the published SmartRedis package
                assert row["published"] > 0 and row["ratio_published"] == pytest.approx(row["published"] / row["ours"])
                assert ("SmartRedis >= 0.9x ours" in row["bar"]) == (row["bytes"] >= 128 << 10)
        if "started by the Redis module" in row["metric"]:
            assert row["ours"] > 0 and row["baseline"] > 0 and row["ceiling"] > 0
            assert row["bar"] == "<= 1.1x external worker"
            assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"])
        elif "run_model" in row["metric"]:
            assert row["ours"] > 0 and row["baseline"] > 0 and row["ceiling"] > 0
            assert row["bar"].startswith("<= 1.15x baseline; <= 2.5x floor")
            assert row["ratio"] == pytest.approx(row["ours"] / row["baseline"])
            assert "hand-rolled redis-py worker" in row["metric"]
            if published_available():
                assert row["published"] > 0 and "SmartRedis <= 1.1x ours" in row["bar"]
    copies = next(row for row in rows if "payload-sized" in row["metric"])
    assert copies["ours"] < 0.01 and copies["ok"]
    assert "smartredis_io" in capsys.readouterr().out
