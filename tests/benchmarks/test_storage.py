"""``python -m benchmarks.storage fio|au``: end to end on tiny sizes, units, AU ordering."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.plugins.io import TorchCheckpointIO

from benchmarks import plugins
from benchmarks.storage import GiB, KiB, MiB, fio, format_size, parse_size
from benchmarks.storage.__main__ import main
from benchmarks.storage.au import AU_JSON_KEYS, DEFAULT_PLUGINS, LoopConfig, make_state, run_loop, run_plugin
from benchmarks.storage.fio import FIO_JSON_KEYS, PROFILES, direct_io_supported, parse_fio_output

SLOW_SAVE_S = 0.3


def _run_json(capsys: pytest.CaptureFixture[str], argv: list[str], json_path: Path) -> tuple[str, list[dict]]:
    assert main([*argv, "--json", str(json_path)]) == 0
    return capsys.readouterr().out, json.loads(json_path.read_text())


@pytest.mark.parametrize(
    ("text", "size"), [("4K", 4 * KiB), ("64M", 64 * MiB), ("1G", GiB), ("1GiB", GiB), ("100", 100), ("1.5k", 1536)]
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size
    assert parse_size(format_size(size)) == size


@pytest.mark.parametrize("text", ["", "1X", "-1M", "0", "M"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_fio_output_converts_units() -> None:
    side = {
        "runtime": 2000, "io_bytes": 4 * MiB, "bw": 2048, "iops": 512.0,
        "clat_ns": {"mean": 1.5e6, "percentile": {"50.000000": 1e6, "99.000000": 3e6}},
    }
    doc = {"fio version": "fio-3.33", "jobs": [{"jobname": "x", "error": 0, "read": side}]}
    row = parse_fio_output("fio: a warning before the JSON\n" + json.dumps(doc), "read")
    assert row == {
        "fio_version": "fio-3.33", "runtime_s": 2.0, "io_bytes": 4 * MiB, "bw_mibps": 2.0, "iops": 512.0,
        "lat_avg_ms": 1.5, "lat_p50_ms": 1.0, "lat_p99_ms": 3.0,
    }


@pytest.mark.slow
def test_fio_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target"
    out, rows = _run_json(
        capsys, ["fio", "--target", str(target), "--size", "4M", "--runtime", "1", "--small-wss", "1M"],
        tmp_path / "fio.json",
    )
    expected = [(p.name, phase) for p in PROFILES.values() for phase in p.phases]
    assert [(r["profile"], r["phase"]) for r in rows] == expected
    for row in rows:
        assert set(FIO_JSON_KEYS) <= row.keys()
        assert row["bw_mibps"] > 0 and row["iops"] > 0 and row["io_bytes"] > 0
        assert 0 < row["lat_p50_ms"] <= row["lat_p99_ms"]
    by_profile = {(r["profile"], r["phase"]): r for r in rows}
    assert by_profile[("streaming", "write")]["concurrency"] == 32
    assert by_profile[("max-latency", "read")]["rw"] == "randread"
    assert by_profile[("min-latency", "read")]["direct"] is direct_io_supported(target)[0]
    for title in ("Bandwidth [MiB/s]", "Latency [ms]", "IOPS", "Writes Median:", "Reads 99%:"):
        assert title in out
    assert list(target.iterdir()) == []  # the data file is removed


def test_fio_falls_back_to_buffered_where_o_direct_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # tmpfs refused O_DIRECT before Linux 6.6; newer kernels accept it, so the refusal is simulated.
    monkeypatch.setattr(fio, "direct_io_supported", lambda directory: (False, "O_DIRECT is refused here"))
    out, rows = _run_json(
        capsys, ["fio", "--target", str(tmp_path / "t"), "--size", "1M", "--runtime", "0.5",
                 "--profiles", "min-latency"],
        tmp_path / "fio.json",
    )
    assert [(r["phase"], r["direct"]) for r in rows] == [("write", False), ("read", False)]
    assert "O_DIRECT is refused here: the cache-bypassing profiles ran buffered" in out


def test_direct_io_probe_leaves_nothing(tmp_path: Path) -> None:
    supported, reason = direct_io_supported(tmp_path)
    assert supported or "O_DIRECT" in reason
    assert list(tmp_path.iterdir()) == []


def test_fio_rejects_unknown_profile(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="nope"):
        main(["fio", "--target", str(tmp_path), "--profiles", "streaming,nope"])


@pytest.mark.slow
def test_au_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, rows = _run_json(
        capsys,
        ["au", "--plugins", "torch-local", "--steps", "4", "--every", "2", "--compute-ms", "20",
         "--model-size", "256K", "--workdir", str(tmp_path / "work")],
        tmp_path / "au.json",
    )
    assert [(r["plugin"], r["mode"], r["status"]) for r in rows] == [
        ("torch-local", "sync", "ok"), ("torch-local", "async", "ok"), ("torch-local", "native-async", "n/a"),
    ]
    for row in rows:
        assert set(AU_JSON_KEYS) <= row.keys()
    for row in rows[:2]:
        assert 0 <= row["au_percent"] <= 100
        assert row["saves"] == 2 and row["verified"] is True and row["checkpoint_bytes"] == 256 * KiB
        assert row["passed"] is (row["au_percent"] >= 90)
    assert rows[0]["stall_per_save_vs_baseline"] == 1.0
    assert "AU %" in out and "torch-local" in out


def test_au_reports_an_absent_plugin_as_unavailable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = dataclasses.replace(plugins.PLUGINS["torch-local"], requires="benchmarks.no_such_plugin")
    monkeypatch.setitem(plugins.PLUGINS, "torch-local", absent)
    out, rows = _run_json(
        capsys, ["au", "--plugins", "torch-local", "--steps", "1", "--every", "1", "--compute-ms", "0",
                 "--model-size", "4K", "--modes", "sync,async"],
        tmp_path / "au.json",
    )
    assert [(r["mode"], r["status"]) for r in rows] == [("sync", "unavailable"), ("async", "unavailable")]
    assert "no_such_plugin" in rows[0]["reason"] and "no_such_plugin" in out


class SlowCheckpointIO(TorchCheckpointIO):
    """A writer whose every save takes at least ``SLOW_SAVE_S``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        time.sleep(SLOW_SAVE_S)
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.slow
def test_slow_writer_stalls_less_when_async(tmp_path: Path) -> None:
    # Saves at steps 2, 4, 6 of 7: a sync run stalls >= 3 x 0.3 s; an async one finishes each save
    # within the next 0.8 s of compute, and the last one during step 7, so it barely waits.
    cfg = LoopConfig(steps=7, every=2, compute_s=0.4)
    state = make_state(4 * KiB, 2)
    rows = {
        mode: run_loop(SlowCheckpointIO(), str(tmp_path / f"{mode}.ckpt"), mode, state, cfg)
        for mode in ("sync", "async")
    }
    sync, async_ = rows["sync"], rows["async"]
    assert sync["stall_s"] >= 3 * SLOW_SAVE_S
    assert 0 <= sync["au_percent"] < async_["au_percent"] <= 100
    assert sync["au_percent"] <= 100 * 2.8 / (2.8 + 0.9)
    assert async_["stall_s"] < sync["stall_s"] / 2
    assert sync["verified"] and async_["verified"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in DEFAULT_PLUGINS if n != "torch-local"])
def test_au_through_each_plugin(name: str, tmp_path: Path) -> None:
    rows = run_plugin(
        name, plugins.PLUGINS[name], ["sync", "async"], make_state(64 * KiB, 4),
        LoopConfig(steps=2, every=1, compute_s=0.01), tmp_path,
    )
    if rows[0]["status"] == "unavailable":
        pytest.skip(f"{name}: {rows[0]['reason']}")
    assert [(r["mode"], r["status"], r["reason"]) for r in rows] == [("sync", "ok", ""), ("async", "ok", "")]
    assert all(r["verified"] and 0 <= r["au_percent"] <= 100 for r in rows)


@pytest.mark.parametrize(("command", "phrase"), [("fio", "--profiles"), ("au", "AU = compute / (compute + stall)")])
def test_help(command: str, phrase: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert phrase in capsys.readouterr().out
