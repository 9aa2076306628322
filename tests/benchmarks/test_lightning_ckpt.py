"""`python -m benchmarks.lightning_ckpt` end to end, on tiny models (LAYERS=1: a 56 MB checkpoint)."""

from __future__ import annotations

import importlib
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import lightning_ckpt
from benchmarks.lightning_peer import PEER_PATH_ENV, default_peer_path
from tests.support.processes import foreground_sigint

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_ROWS = ["TorchCheckpointIO (gcsfs)", "Dataflux (Transfer Manager Disabled)",
                  "Dataflux (Transfer Manager Enabled)"]
TIERED_ROW = "TieredCheckpointIO (NVMe, then GCS)"
FASTPERSIST_ROW = "FastPersistCheckpointIO (local)"
DEFAULT_ROWS = [*REFERENCE_ROWS, TIERED_ROW, FASTPERSIST_ROW]
ROW_KEYS = {"type", "kind", "upload", "layers", "steps", "size_mb", "save_s", "save_mbps", "load_s", "load_mbps",
            "save_median_mbps", "load_median_mbps", "save_min_mbps", "save_max_mbps", "save_times_s",
            "load_times_s", "save_extra_rss_mb", "load_extra_rss_mb", "network"}
# What Lightning and the plugins would print between the progress bars if the benchmark let them.
NOISE = ("INFO", "weights_only", "litlogger", "GPU available", "LeafSpec", "does not serve")
AVERAGE_LINE = re.compile(r"^(?P<row>.+): Average time to (?P<op>save|load) one checkpoint: (?P<s>\S+) seconds$")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV_KEYS = ("CKPT_DIR_PATH", "DATAFLUX_CKPT", "USE_TRANSFER_MANAGER", "LAYERS", "STEPS")


def _peer_available() -> str | None:
    """Why the peer rows cannot run here, or None."""
    if default_peer_path():
        return None
    try:
        importlib.import_module("dataflux_pytorch.lightning")
    except ImportError as err:  # absent, or installed beside a google-cloud-storage it cannot use
        return f"${PEER_PATH_ENV} is not set and gcs-torch-dataflux does not import here: {err}"
    return None


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.lightning_ckpt", *args],
        cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=foreground_sigint,
    )


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, str, list[dict], Path]:
    out_json = tmp_path / "rows.json"
    proc = _bench("--json", str(out_json), *args, env={"LAYERS": "1", "STEPS": "1", **(env or {})})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    return out, err, json.loads(out_json.read_text()), out_json.with_suffix(".png")


def _by_kind(rows: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    return ({r["type"]: r for r in rows if r["kind"] == "row"},
            {r["upload"]: r for r in rows if r["kind"] == "ceiling"})


def _names(argv: list[str]) -> list[str]:
    return [spec.key for spec in lightning_ckpt.select_rows(lightning_ckpt.parse_args(argv))]


def test_help_lists_the_reference_variables_and_the_options():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.lightning_ckpt", "--help"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout
    for word in ("CKPT_DIR_PATH", "STEPS", "LAYERS", "PROJECT", "DATAFLUX_CKPT", "USE_TRANSFER_MANAGER",
                 "--compare", "--json", "--chart", "--upload-mode", "--network", "cloud[:MBPS,RTT_MS]",
                 "--peer-path", PEER_PATH_ENV):
        assert word in out


def test_flags_win_over_environment(monkeypatch):
    monkeypatch.setenv("STEPS", "7")
    monkeypatch.setenv("LAYERS", "3")
    monkeypatch.setenv("USE_TRANSFER_MANAGER", "0")
    args = lightning_ckpt.parse_args(["--steps", "2", "--network", "cloud:50,2"])
    assert (args.steps, args.layers, args.use_transfer_manager) == (2, 3, False)
    assert (args.network.mbps, args.network.rtt_ms) == (50.0, 2.0)


def test_rows_follow_the_reference_variables(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    # The comparison by default, and a Tiered row with the FastPersist row its bars compare it with.
    assert _names([]) == ["torch-gcsfs", "dataflux-no-tm", "dataflux-tm", "tiered", "fastpersist"]
    monkeypatch.setenv("DATAFLUX_CKPT", "1")
    assert _names([]) == ["dataflux-tm"]
    monkeypatch.setenv("USE_TRANSFER_MANAGER", "0")
    assert _names([]) == ["dataflux-no-tm"]
    monkeypatch.setenv("DATAFLUX_CKPT", "0")
    assert _names([]) == ["torch-gcsfs"]
    assert _names(["--ckpt-dir", "/tmp/x"]) == ["torch-local"]
    monkeypatch.delenv("DATAFLUX_CKPT")
    assert _names(["--ckpt-dir", "/tmp/x"]) == ["torch-local"]
    compared = _names(["--compare"])
    assert {"torch-local", "torch-gcsfs", "dataflux-tm", "peer", "peer-async", "smartredis"} <= set(compared)
    assert _names(["--types", "tiered"]) == ["tiered", "dataflux-tm", "fastpersist"]
    assert _names(["--types", "fastpersist,tiered"]) == ["fastpersist", "tiered", "dataflux-tm"]
    assert _names(["--types", "dataflux-tm"]) == ["dataflux-tm"]
    with pytest.raises(SystemExit, match="unknown --types"):
        _names(["--types", "nope"])
    with pytest.raises(SystemExit, match="--types names fastpersist more than once"):
        _names(["--types", "fastpersist,tiered,fastpersist"])


@pytest.mark.parametrize("argv", [["--network", "cloud:0,4"], ["--network", "wan"], ["--upload-mode", "stream"],
                                  ["--steps", "0"], ["--network", "cloud", "--ckpt-dir", "gs://real/bucket"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        lightning_ckpt.parse_args(argv)
    assert "error" in capsys.readouterr().err


@pytest.mark.slow
def test_default_run_compares_the_reference_rows_with_their_ceilings(tmp_path):
    out, err, rows, chart = _run(tmp_path)
    by_type, ceilings = _by_kind(rows)
    assert [t.removesuffix(" [xml]") for t in by_type] == DEFAULT_ROWS
    assert set(ceilings) == {"single", "xml", "download", "download_crc32c", "load", "xml-tier-file", "local-read"}
    for row in rows:
        assert ROW_KEYS <= row.keys()
        assert row["layers"] == 1 and row["network"] == "loopback" and row["size_mb"] > 1
        load_ceiling = row["upload"] in ("download", "download_crc32c", "load", "local-read")
        assert len(row["save_times_s"]) == (1 if row["kind"] == "row" or not load_ceiling else 0)
    for row in by_type.values():
        assert row["save_median_mbps"] > 0 and row["load_median_mbps"] > 0
        assert row["save_extra_rss_mb"] >= 0
    gcsfs, no_tm, tm = (by_type[name] for name in (REFERENCE_ROWS[0], REFERENCE_ROWS[1], REFERENCE_ROWS[2] + " [xml]"))
    assert gcsfs["save_vs_baseline"] == gcsfs["load_vs_baseline"] == 1.0
    assert tm["save_vs_baseline"] == pytest.approx(tm["save_median_mbps"] / gcsfs["save_median_mbps"])
    # Each row is held to the ceiling of its own upload path; every GCS load to the one load bound.
    assert (gcsfs["upload"], no_tm["upload"], tm["upload"]) == ("single", "single", "xml")
    assert tm["save_vs_ceiling"] == pytest.approx(tm["save_median_mbps"] / ceilings["xml"]["save_median_mbps"])
    assert no_tm["save_vs_ceiling"] == pytest.approx(
        no_tm["save_median_mbps"] / ceilings["single"]["save_median_mbps"])
    assert tm["load_vs_ceiling"] == pytest.approx(tm["load_median_mbps"] / ceilings["load"]["load_median_mbps"])
    # The pure download: ranged reads into memory, no deserialization; every GCS load is held to it.
    download = ceilings["download"]
    assert download["type"] == "ceiling: raw parallel download" and download["key"] == "ceiling-download"
    assert len(download["load_times_s"]) == 1 and download["load_median_mbps"] > 0
    for row in (gcsfs, no_tm, tm, ceilings["load"]):
        assert row["load_vs_download"] == pytest.approx(row["load_median_mbps"] / download["load_median_mbps"])
    assert ceilings["xml"]["load_vs_download"] is None and download["load_vs_download"] is None
    # The like-for-like bound of a GCS load: the same download with its crc32c checked as it arrives.
    verified = ceilings["download_crc32c"]
    assert verified["type"] == "ceiling: raw parallel download + crc32c" and verified["load_median_mbps"] > 0
    for row in (gcsfs, no_tm, tm):
        assert row["load_vs_verified_download"] == pytest.approx(
            row["load_median_mbps"] / verified["load_median_mbps"])
    # The console: the run's line, one progress bar per row, the tables; nothing from Lightning or the plugins.
    assert out.splitlines()[0].startswith("Lightning checkpoints, LAYERS=1, STEPS=1")
    for title in ("Save MB/s", "Save x gcsfs", "Save x ceil.", "Load x download", "Load x download+crc32c", "Ceiling",
                  "raw parallel XML multipart upload", "ceiling: raw parallel download "):
        assert title in out
    for line in (out + err).splitlines():
        assert not any(noise in line for noise in NOISE), line
    # The Dataflux Lightning benchmark's two lines for every row (not the ceilings), each prefixed by the
    # row, with the mean of the timed steps, printed as that benchmark prints it; the same lines in the JSON.
    averages = [m for m in map(AVERAGE_LINE.match, out.splitlines()) if m]
    assert "Average time" not in err and sum("Average time" in line for line in out.splitlines()) == len(averages)
    assert [(m["row"], m["op"]) for m in averages] == [(t, op) for t in by_type for op in ("save", "load")]
    for m in averages:
        row = by_type[m["row"]]
        assert m["s"] == str(row[f"{m['op']}_s"])
        assert float(m["s"]) == pytest.approx(sum(row[f"{m['op']}_times_s"]) / len(row[f"{m['op']}_times_s"]))
        assert m.group(0).removeprefix(f"{m['row']}: ") in row["average_time_lines"]
    for name in DEFAULT_ROWS:
        assert name in err  # its progress bar
    assert chart.read_bytes().startswith(PNG_MAGIC) and chart.stat().st_size > 10_000
    assert str(chart) in out
    markdown = chart.with_suffix(".md").read_text()
    assert "| Checkpoint Type |" in markdown and "| Ceiling |" in markdown


@pytest.mark.slow
def test_tiered_rows_are_held_to_their_bars_with_what_the_same_rounds_measured(tmp_path):
    """Each Tiered row (one per upload mode), through the cloud model, against the rows and ceilings it
    brings into its rounds: its stall to FastPersist's save and to the direct Dataflux save of its mode,
    its time until durable to FastPersist's save plus the raw upload of the local tier's file, its
    local load to the raw read of that file, its GCS load (a new node) to the Dataflux load."""
    steps = 2
    out, _, rows, chart = _run(tmp_path, "--types", "tiered", "--upload-mode", "both", "--network", "cloud",
                               env={"STEPS": str(steps)})
    by_key = {r["key"]: r for r in rows}
    assert set(by_key) == {"tiered[xml]", "tiered[composite]", "dataflux-tm[xml]", "dataflux-tm[composite]",
                           "fastpersist", "ceiling-xml", "ceiling-composite", "ceiling-xml-tier-file",
                           "ceiling-composite-tier-file", "ceiling-local-read", "ceiling-download",
                           "ceiling-download_crc32c", "ceiling-load"}
    fastpersist, read = by_key["fastpersist"], by_key["ceiling-local-read"]
    for mode in ("xml", "composite"):
        row, direct, upload = by_key[f"tiered[{mode}]"], by_key[f"dataflux-tm[{mode}]"], by_key[f"ceiling-{mode}-tier-file"]
        assert row["type"] == f"{TIERED_ROW} [{mode}]" and row["tiered"] and row["network"] == "cloud"
        # The ceilings move the local tier's file: a FastPersist save of the same checkpoint.
        assert row["size_mb"] == upload["size_mb"] == read["size_mb"] == fastpersist["size_mb"]
        # Training waits for the local write only; the save is timed until the upload is published.
        assert len(row["stall_times_s"]) == len(row["save_times_s"]) == len(row["gcs_load_times_s"]) == steps
        assert all(0 < stall < durable for stall, durable in zip(row["stall_times_s"], row["save_times_s"], strict=True))
        assert row["stall_median_s"] == row["save_blocked_median_s"]
        assert row["durable_median_s"] == row["save_median_s"]
        assert row["stall_vs_fastpersist"] == pytest.approx(row["stall_median_s"] / fastpersist["save_median_s"])
        assert row["direct_save_vs_stall"] == pytest.approx(direct["save_median_s"] / row["stall_median_s"])
        ceiling_s = fastpersist["save_median_s"] + upload["save_median_s"]
        assert row["durable_ceiling_s"] == pytest.approx(ceiling_s)
        assert row["durable_vs_ceiling"] == pytest.approx(row["save_median_s"] / ceiling_s)
        assert row["local_load_vs_raw_read"] == pytest.approx(read["load_median_s"] / row["load_median_s"])
        assert row["gcs_load_vs_dataflux"] == pytest.approx(direct["load_median_s"] / row["gcs_load_median_s"])
        # The local load reads the local tier (GCS is only asked whether it holds a newer copy); the
        # load as a new node downloads the object.
        assert row["gcs_load_cpu_s"]["fake-gcs-server"] > row["load_cpu_s"].get("fake-gcs-server", 0.0)
        for name, (op, limit) in lightning_ckpt.TIERED_BARS.items():
            bar = row["bars"][name]
            assert bar["value"] == row[name] and bar["bar"] == f"{op} {limit:g}"
            assert bar["holds"] == (row[name] <= limit if op == "<=" else row[name] >= limit)
        for line in (f"{row['type']}: Stall / FastPersist save = {row['stall_vs_fastpersist']:.3f}, bar <= 1.15",
                     f"{row['type']}: Local load x raw read = {row['local_load_vs_raw_read']:.3f}, bar >= 0.9"):
            assert line in out and line in chart.with_suffix(".md").read_text()
    assert "Tiered row" in out and "raw parallel read of the local tier's file" in out
    assert chart.read_bytes().startswith(PNG_MAGIC)


@settings(max_examples=50, deadline=None)
@given(times=st.fixed_dictionaries({name: st.lists(st.floats(0.01, 100.0), min_size=1, max_size=5) for name in (
    "stall", "durable", "local_load", "gcs_load", "fastpersist_save", "direct_save", "direct_load", "raw_upload",
    "raw_read")}))
def test_a_tiered_rows_bars_are_ratios_of_the_medians_they_name(times):
    meter = lightning_ckpt.CpuMeter()

    def subject(key: str, upload: str | None, saves: list[float], loads: list[float],
                kind: str = "row") -> lightning_ckpt.Subject:
        made = lightning_ckpt.Subject(key, key, kind, meter, upload)
        made.saves = [lightning_ckpt.Op(seconds, 0.0) for seconds in saves]
        made.loads = [lightning_ckpt.Op(seconds, 0.0) for seconds in loads]
        made.size_bytes = 10**8
        return made

    rows = [lightning_ckpt.subject_row(s, {}) for s in (
        subject("tiered[xml]", "xml", times["durable"], times["local_load"]),
        subject("dataflux-tm[xml]", "xml", times["direct_save"], times["direct_load"]),
        subject("fastpersist", None, times["fastpersist_save"], times["local_load"]))]
    rows[0].update(tiered=True, **lightning_ckpt.tiered_fields(
        10**8, times["stall"], [lightning_ckpt.Op(seconds, 0.0) for seconds in times["gcs_load"]]))
    ceilings = [lightning_ckpt.subject_row(s, {}) for s in (
        subject("ceiling-xml-tier-file", "xml-tier-file", times["raw_upload"], [], "ceiling"),
        subject("ceiling-local-read", "local-read", [], times["raw_read"], "ceiling"))]
    lightning_ckpt.add_ratios(rows, ceilings)

    median = {name: statistics.median(values) for name, values in times.items()}
    expected = {
        "stall_vs_fastpersist": median["stall"] / median["fastpersist_save"],
        "direct_save_vs_stall": median["direct_save"] / median["stall"],
        "durable_vs_ceiling": median["durable"] / (median["fastpersist_save"] + median["raw_upload"]),
        "local_load_vs_raw_read": median["raw_read"] / median["local_load"],
    }
    tiered = rows[0]
    for name, value in expected.items():
        assert tiered[name] == pytest.approx(value)
        op, limit = lightning_ckpt.TIERED_BARS[name]
        assert tiered["bars"][name]["holds"] == (tiered[name] <= limit if op == "<=" else tiered[name] >= limit)
    assert tiered["gcs_load_vs_dataflux"] == pytest.approx(median["direct_load"] / median["gcs_load"])
    # Its save ceiling is the local save plus the raw upload; its load is local, so no GCS load ratio.
    assert tiered["save_vs_ceiling"] == pytest.approx(1 / expected["durable_vs_ceiling"])
    assert tiered["load_vs_download"] is None and tiered["load_vs_ceiling"] == tiered["local_load_vs_raw_read"]
    assert rows[1].get("bars") is None and not rows[1]["tiered"]


@pytest.mark.slow
def test_aa_controls_run_beside_their_originals_and_report_the_runs_noise(tmp_path):
    """--aa: a second FastPersist row, with its own plugin and paths, in the same rounds; each measure
    of the copy is reported against the original's, and the widest gap as the run's noise floor."""
    steps = 2
    out, _, rows, chart = _run(tmp_path, "--types", "fastpersist", "--aa", env={"STEPS": str(steps)})
    by_key = {r["key"]: r for r in rows}
    assert set(by_key) == {"fastpersist", "fastpersist~aa"}
    original, control = by_key["fastpersist"], by_key["fastpersist~aa"]
    assert original["control_of"] is None and control["control_of"] == "fastpersist"
    assert control["type"] == f"{FASTPERSIST_ROW} (A/A control)"
    assert len(control["save_times_s"]) == len(control["load_times_s"]) == steps
    assert control["size_mb"] == original["size_mb"]
    for measure in ("save", "load"):
        expected = control[f"{measure}_median_s"] / original[f"{measure}_median_s"]
        assert control[f"aa_{measure}_ratio"] == pytest.approx(expected)
        line = f"{control['type']}: {measure} / the original's = {expected:.3f}"
        assert line in out and line in chart.with_suffix(".md").read_text()
    gap = max(max(r, 1 / r) - 1 for r in (control["aa_save_ratio"], control["aa_load_ratio"]))
    assert f"A/A noise of this run: up to {gap:.1%} between identical subjects" in out


@settings(max_examples=50, deadline=None)
@given(times=st.fixed_dictionaries({name: st.lists(st.floats(0.01, 100.0), min_size=1, max_size=5) for name in (
    "stall", "durable", "control_stall", "control_durable", "fastpersist_save", "raw_upload", "control_upload")}))
def test_aa_controls_are_ratios_of_medians_and_never_stand_in_for_what_they_copy(times):
    meter = lightning_ckpt.CpuMeter()

    def subject(key: str, upload: str | None, saves: list[float], kind: str = "row") -> lightning_ckpt.Subject:
        made = lightning_ckpt.Subject(key, key, kind, meter, upload, does_load=False)
        made.saves = [lightning_ckpt.Op(seconds, 0.0) for seconds in saves]
        made.size_bytes = 10**8
        return made

    originals = [subject("tiered[xml]", "xml", times["durable"]), subject("fastpersist", None, times["fastpersist_save"]),
                 subject("ceiling-xml-tier-file", "xml-tier-file", times["raw_upload"], "ceiling")]
    copies = lightning_ckpt.as_controls(originals, [
        subject("tiered[xml]", "xml", times["control_durable"]), subject("fastpersist", None, times["fastpersist_save"]),
        subject("ceiling-xml-tier-file", "xml-tier-file", times["control_upload"], "ceiling")])
    assert [c.key for c in copies] == ["tiered[xml]~aa", "fastpersist~aa", "ceiling-xml-tier-file~aa"]
    rows = [lightning_ckpt.subject_row(s, {}) for s in originals[:2] + copies[:2]]
    ceilings = [lightning_ckpt.subject_row(s, {}) for s in (originals[2], copies[2])]
    for row, stalls in ((rows[0], times["stall"]), (rows[2], times["control_stall"])):
        row.update(tiered=True, **lightning_ckpt.tiered_fields(10**8, stalls, []))
    lightning_ckpt.add_ratios(rows, ceilings)

    median = {name: statistics.median(values) for name, values in times.items()}
    tiered, control = rows[0], rows[2]
    # The original's bars use the original ceiling, never its copy; the copy is held to no bar.
    assert tiered["durable_vs_ceiling"] == pytest.approx(median["durable"] / (median["fastpersist_save"]
                                                                              + median["raw_upload"]))
    assert control.get("bars") is None and "aa_save_ratio" not in tiered
    assert control["aa_save_ratio"] == pytest.approx(median["control_durable"] / median["durable"])
    assert control["aa_stall_ratio"] == pytest.approx(median["control_stall"] / median["stall"])
    assert ceilings[1]["aa_save_ratio"] == pytest.approx(median["control_upload"] / median["raw_upload"])
    assert rows[3]["aa_save_ratio"] == pytest.approx(1.0) and rows[3].get("aa_load_ratio") is None
    ratios = [control["aa_save_ratio"], control["aa_stall_ratio"], ceilings[1]["aa_save_ratio"], 1.0]
    gap, _, _ = lightning_ckpt.widest_aa_gap(rows + ceilings)
    assert gap == pytest.approx(max(max(r, 1 / r) - 1 for r in ratios))
    with pytest.raises(RuntimeError, match="A/A controls"):
        lightning_ckpt.as_controls(originals[:2], [subject("fastpersist", None, [1.0]), subject("tiered[xml]", "xml", [1.0])])


@pytest.mark.slow
def test_both_upload_modes_each_with_its_own_ceiling(tmp_path):
    out, _, rows, _ = _run(tmp_path, "--types", "dataflux-tm", "--upload-mode", "both")
    by_type, ceilings = _by_kind(rows)
    assert list(by_type) == ["Dataflux (Transfer Manager Enabled) [xml]", "Dataflux (Transfer Manager Enabled) [composite]"]
    assert set(ceilings) == {"xml", "composite", "download", "download_crc32c", "load"}
    for mode in ("xml", "composite"):
        row = by_type[f"Dataflux (Transfer Manager Enabled) [{mode}]"]
        assert row["upload"] == mode
        assert row["save_vs_ceiling"] == pytest.approx(row["save_median_mbps"] / ceilings[mode]["save_median_mbps"])
    assert "raw parallel composite upload" in out and "raw parallel XML multipart upload" in out


@pytest.mark.slow
def test_cloud_model_holds_every_connection_to_its_bandwidth(tmp_path):
    mbps = 40.0  # a 56 MB object takes at least 1.4 s on one connection
    out, _, rows, _ = _run(tmp_path, "--types", "dataflux-no-tm,dataflux-tm", "--network", f"cloud:{mbps:g},4")
    by_type, ceilings = _by_kind(rows)
    assert "cloud model: 40 MB/s per connection in each direction, 4 ms round trip" in out
    assert all(r["network"] == "cloud" and r["network_mbps"] == mbps for r in rows)
    # One connection cannot beat the model's bandwidth (one upload request; one GET); parallel ranges can.
    assert ceilings["single"]["save_median_mbps"] <= 1.05 * mbps
    assert by_type["Dataflux (Transfer Manager Disabled)"]["load_median_mbps"] <= 1.05 * mbps
    assert by_type["Dataflux (Transfer Manager Enabled) [xml]"]["load_median_mbps"] > 1.05 * mbps


@pytest.mark.slow
def test_cloud_model_covers_resumable_upload_sessions(tmp_path):
    mbps = 40.0
    _, _, rows, _ = _run(tmp_path, "--types", "torch-gcsfs,dataflux-no-tm", "--network", f"cloud:{mbps:g},4")
    by_type, _ = _by_kind(rows)
    # Both save through a resumable-upload session on one connection: every request of it crosses the model.
    for name in ("TorchCheckpointIO (gcsfs)", "Dataflux (Transfer Manager Disabled)"):
        assert by_type[name]["save_median_mbps"] <= 1.05 * mbps, name


@pytest.mark.slow
def test_peer_package_runs_beside_ours(tmp_path):
    reason = _peer_available()
    if reason:
        pytest.skip(reason)
    out, err, rows, _ = _run(tmp_path, "--types", "dataflux-tm,peer,peer-async")
    by_type, _ = _by_kind(rows)
    peer, peer_async = by_type["Dataflux (gcs-torch-dataflux 1.4.0)"], by_type["Dataflux async (gcs-torch-dataflux 1.4.0)"]
    ours = by_type["Dataflux (Transfer Manager Enabled) [xml]"]
    assert peer["upload"] == "xml" and peer["save_vs_peer"] == peer["load_vs_peer"] == 1.0
    assert peer["size_mb"] == pytest.approx(ours["size_mb"], rel=0.01)  # the same Trainer's checkpoint
    assert peer["save_extra_rss_mb"] > 0 and peer_async["save_blocked_median_s"] is not None
    assert ours["save_vs_peer"] == pytest.approx(ours["save_median_mbps"] / peer["save_median_mbps"])
    assert ours["save_rss_vs_peer"] == pytest.approx(ours["save_extra_rss_mb"] / peer["save_extra_rss_mb"])
    assert "+RSS x peer" in out


@pytest.mark.slow
def test_a_missing_peer_is_named_with_how_to_install_it(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _bench("--types", "peer", "--json", str(tmp_path / "rows.json"),
                  env={"LAYERS": "1", "STEPS": "1", PEER_PATH_ENV: str(empty), "PYTHONNOUSERSITE": "1"})
    out, err = proc.communicate(timeout=600)
    if proc.returncode == 0:
        pytest.skip("gcs-torch-dataflux is importable in this environment itself")
    assert "gcs-torch-dataflux" in err and "pip install" in err and "--peer-path" in err


def _service_children(pid: int) -> set[str]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    names = set()
    for child in children:
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        for label in ("fake-gcs-server", "redis-server", "toxiproxy-server", "dataflux_ckpt.xml_server"):
            if label in cmdline:
                names.add(label)
    return names


@pytest.mark.slow
def test_sigint_leaves_no_service_behind():
    expected = {"fake-gcs-server", "redis-server", "toxiproxy-server", "dataflux_ckpt.xml_server"}
    proc = _bench("--types", "torch-gcsfs,smartredis", "--network", "cloud", "--steps", "1000",
                  "--json", os.devnull, env={"LAYERS": "1"})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        header = proc.stdout.readline() if ready else ""
        assert header.startswith("Lightning checkpoints"), proc.communicate()  # the rounds begin now
        services = psutil.Process(proc.pid).children(recursive=True)
        assert _service_children(proc.pid) == expected
        time.sleep(2)  # inside the rounds
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, out + err
        _, alive = psutil.wait_procs(services, timeout=10)
        assert not alive, f"left behind: {alive}"
    finally:
        proc.kill()
