"""python -m benchmarks.smartsim_scaling: every command end to end on tiny settings, then process_results."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.smartsim_scaling import launch, slurm
from benchmarks.smartsim_scaling.cli import COMMANDS, main
from benchmarks.smartsim_scaling.options import driver_options, int_list, str_list
from benchmarks.smartsim_scaling.results import CSV_NAME, RESULTS_DIR, aggregate_gbps, collect, derived

TINY_THROUGHPUT = ["--tensor_bytes", "1024", "65536", "--clients_per_node", "2", "--iterations", "3"]
THROUGHPUT_FUNCTIONS = {"client()", "put_tensor", "unpack_tensor", "loop_time", "redis_set", "redis_get",
                        "redis_loop_time", "main()"}
PUBLISHED = launch.published_available()  # the published SmartRedis client (the test extra has it)
if PUBLISHED:
    THROUGHPUT_FUNCTIONS |= {"smartredis_put_tensor", "smartredis_unpack_tensor", "smartredis_loop_time"}


def _runs(exp_dir: Path) -> list[Path]:
    return sorted(p.parent for p in exp_dir.glob("*/run.json"))


def _rows(path: Path) -> list[tuple[int, str, float]]:
    """A timing file as SmartSim-Scaling writes it: ``rank,function,seconds`` rows."""
    with open(path) as f:
        return [(int(rank), function, float(seconds)) for rank, function, seconds in csv.reader(f)]


def _functions(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, function, seconds in _rows(path):
        assert seconds >= 0
        counts[function] = counts.get(function, 0) + 1
    return counts


@pytest.fixture(scope="module")
def throughput_dir(tmp_path_factory, redis_cluster) -> Path:
    """Tiny throughput sweeps into one experiment: an embedded standalone server, and the 3-shard cluster."""
    exp_dir = tmp_path_factory.mktemp("smartsim") / "throughput-scaling"
    assert main(["throughput", "--exp_dir", str(exp_dir), "--db_nodes", "1", *TINY_THROUGHPUT]) == 0
    assert main(["throughput", "--exp_dir", str(exp_dir), "--address", redis_cluster.address,
                 "--db_nodes", "3", *TINY_THROUGHPUT, "--json", str(exp_dir.parent / "cluster.json")]) == 0
    return exp_dir


def test_every_command_has_help(capsys):
    for command in ("throughput", "inference", "aggregation", "process_results"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert "--" in capsys.readouterr().out
    out = subprocess.run([sys.executable, "-m", "benchmarks.smartsim_scaling", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert all(c in out for c in ("throughput", "inference", "aggregation", "process_results"))


def test_list_options_take_the_driver_syntax():
    assert int_list("1024") == [1024]
    assert int_list("1,2,4") == [1, 2, 4]
    assert int_list("[1, 2, 4]") == [1, 2, 4]
    assert int_list("[1,") == [1]  # "--flag=[1, 2]" split by the shell


def test_throughput_writes_one_run_per_permutation_with_smartsim_scaling_timings(throughput_dir):
    runs = _runs(throughput_dir)
    assert len(runs) == 4  # 2 tensor sizes x (standalone, cluster)
    for run_dir in runs:
        spec = json.loads((run_dir / "run.json").read_text())
        attrs = spec["attributes"]
        assert attrs["clients"] == 2 and attrs["iterations"] == 3 and attrs["tensor_bytes"] in (1024, 65536)
        assert attrs["cluster"] == (attrs["db_nodes"] == 3)
        assert spec["versions"]["redis_server"] and spec["versions"]["numpy"]
        for rank in (0, 1):
            path = run_dir / f"rank_{rank}_timing.csv"
            assert {r for r, _, _ in _rows(path)} == {rank}
            counts = _functions(path)
            assert set(counts) == THROUGHPUT_FUNCTIONS
            assert counts["put_tensor"] == counts["unpack_tensor"] == counts["redis_set"] == 3
            assert counts["loop_time"] == counts["client()"] == 1
            if PUBLISHED:
                assert counts["smartredis_put_tensor"] == counts["smartredis_unpack_tensor"] == 3


def test_throughput_reports_ratio_to_redis_py_and_stops_its_database(throughput_dir):
    standalone_rows = json.loads((throughput_dir / "summary.json").read_text())
    cluster_rows = json.loads((throughput_dir.parent / "cluster.json").read_text())
    assert [r["db_nodes"] for r in standalone_rows] == [1, 1] and [r["db_nodes"] for r in cluster_rows] == [3, 3]
    for row in standalone_rows + cluster_rows:
        assert row["throughput_gbps"] > 0 and row["redis_gbps"] > 0
        assert row["ratio_to_redis"] == pytest.approx(row["throughput_gbps"] / row["redis_gbps"])
        if PUBLISHED:
            assert row["smartredis_to_ours"] == pytest.approx(row["smartredis_gbps"] / row["throughput_gbps"])
    # the embedded standalone server was torn down after its sweep
    standalone = next(r for r in _runs(throughput_dir) if "DBN1" in r.name)
    address = json.loads((standalone / "run.json").read_text())["apps"][0]["params"]["address"]
    host, _, port = address.rpartition(":")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=1).close()


def test_process_results_writes_csv_and_plots(throughput_dir, capsys):
    assert main(["process_results", "--scaling_dir", str(throughput_dir), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "| ratio to redis-py |" in out
    assert not PUBLISHED or "| SmartRedis / smartredis_io |" in out
    out_dir = throughput_dir / RESULTS_DIR
    with open(out_dir / CSV_NAME) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4
    expected = {"name", "command", "date", "clients", "db_nodes", "tensor_bytes", "iterations", "cluster",
                "throughput_gbps", "redis_gbps", "ratio_to_redis", "redis_server_version"}
    expected |= {f"{fn}_{stat}" for fn in ("put_tensor", "unpack_tensor", "loop_time", "client()", "redis_set")
                 for stat in ("min", "mean", "max", "median")}
    assert expected <= set(table[0])
    for row in table:
        assert float(row["put_tensor_min"]) <= float(row["put_tensor_median"]) <= float(row["put_tensor_max"])

    import matplotlib.image

    pngs = sorted(out_dir.glob("*.png"))
    names = {p.name for p in pngs}
    assert {"throughput_db1.png", "throughput_db3.png", "box_put_tensor.png", "box_unpack_tensor.png"} <= names
    for png in pngs:
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0  # something was drawn

    # without --overwrite, runs already in the CSV are kept and not added twice
    assert len(collect(throughput_dir, overwrite=False)) == 4


def test_aggregation_end_to_end(tmp_path, redis_server):
    exp_dir = tmp_path / "aggregation-scaling"
    assert main(["aggregation", "--exp_dir", str(exp_dir), "--address", redis_server.address,
                 "--tensor_bytes", "1024", "4096", "--clients_per_node", "2", "--tensors_per_dataset", "2",
                 "--client_threads", "1", "2", "--iterations", "3"]) == 0
    runs = _runs(exp_dir)
    assert len(runs) == 4
    for run_dir in runs:
        consumer = _functions(run_dir / "rank_0_timing.csv")
        ours, theirs = consumer["get_list"], consumer.get("smartredis_get_list", 0)
        assert ours + theirs == 3 and consumer["poll_list"] == ours and consumer["loop_time"] == 1
        assert (theirs > 0) == PUBLISHED, "the published client takes its turns"
        for rank in (0, 1):
            producer = _functions(run_dir / f"producer_rank_{rank}_timing.csv")
            assert producer["append_to_list"] + producer.get("smartredis_append_to_list", 0) == 3
            assert producer["put_dataset"] == 1
    rows = json.loads((exp_dir / "summary.json").read_text())
    assert all(r["get_list_gbps"] > 0 and r["producers"] == 2 for r in rows)
    assert main(["process_results", "--scaling_dir", str(exp_dir)]) == 0
    assert (exp_dir / RESULTS_DIR / "box_get_list.png").stat().st_size > 0


def test_inference_end_to_end(tmp_path):
    exp_dir = tmp_path / "inference-scaling"
    assert main(["inference", "--exp_dir", str(exp_dir), "--clients", "2", "--batch_size", "1", "2",
                 "--iterations", "3", "--image_size", "32"]) == 0
    runs = _runs(exp_dir)
    assert len(runs) == 2
    for run_dir in runs:
        for rank in (0, 1):
            counts = _functions(run_dir / f"rank_{rank}_timing.csv")
            for step in ("put_tensor", "run_script", "run_model", "unpack_tensor"):
                assert counts[step] == 3
                assert counts.get(f"smartredis_{step}", 0) == (3 if PUBLISHED else 0)
    rows = json.loads((exp_dir / "summary.json").read_text())
    assert all(r["run_model_ms"] > 0 and r["inferences_per_s"] > 0 for r in rows)


def test_gbps_is_smartsim_scalings_aggregate_over_clients():
    assert aggregate_gbps(1e6, 100, [1.0, 2.0]) == pytest.approx(0.1 + 0.05)
    row = derived({"tensor_bytes": 1e6, "iterations": 100}, {"loop_time": [1.0], "redis_loop_time": [0.5]})
    assert row["throughput_gbps"] == pytest.approx(0.1) and row["ratio_to_redis"] == pytest.approx(0.5)
    assert row["loop_ms_per_iter"] == pytest.approx(10.0)


def test_a_failing_rank_fails_the_run(tmp_path):
    # the ranks raise at once (no address given): the run fails with their names, it does not hang
    app = launch.App("clients", "benchmarks.smartsim_scaling.throughput:throughput_client", 2, {"cluster": False})
    with pytest.raises(RuntimeError, match="clients rank"):
        launch.run_apps([app], tmp_path, timeout_s=60)


def test_mpi_launcher_without_mpi4py_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    app = launch.App("clients", "benchmarks.smartsim_scaling.throughput:throughput_client", 1, {})
    with pytest.raises(RuntimeError, match="mpi4py"):
        launch.run_apps([app], tmp_path, launcher="mpi")


def test_mpi_launcher_runs_the_clients_under_a_real_mpirun(tmp_path, monkeypatch, redis_server):
    """--launcher mpi end to end: mpirun starts 2 ranks of mpi4py clients that meet at MPI barriers."""
    if shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs Open MPI's mpirun and mpi4py (the checkout's set-up installs both)")
    if os.geteuid() == 0:  # Open MPI refuses root without these
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
        monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    from mpi4py import MPI

    # MPI initialized in the driver's own process (Lightning's cluster detection does it): its
    # OMPI_*/PMIX_* variables must not reach mpirun, which would take itself for a nested launch.
    assert MPI.COMM_WORLD.Get_size() == 1
    exp_dir = tmp_path / "mpi"
    assert main(["throughput", "--exp_dir", str(exp_dir), "--address", redis_server.address, "--launcher", "mpi",
                 "--mpirun", "mpirun --oversubscribe", "--tensor_bytes", "4096", "--clients_per_node", "2",
                 "--iterations", "2", "--timeout", "120"]) == 0
    (run_dir,) = _runs(exp_dir)
    assert json.loads((run_dir / "run.json").read_text())["attributes"]["launcher"] == "mpi"
    for rank in (0, 1):
        path = run_dir / f"rank_{rank}_timing.csv"
        assert {r for r, _, _ in _rows(path)} == {rank}, "each MPI rank wrote its own timings"
        assert set(_functions(path)) == THROUGHPUT_FUNCTIONS


def test_the_driver_command_line_runs_unchanged(tmp_path, monkeypatch, redis_server, capsys):
    """A SmartSim-Scaling batch script's lines: driver command names, Fire lists, --exp_name, batch options."""
    monkeypatch.chdir(tmp_path)
    assert main(["throughput_scaling", "--client_nodes=[1]", "--clients_per_node=[2]", "--tensor_bytes=[1024,4096]",
                 "--exp_name=tp", "--iterations=2", "--db_nodes=[1]", f"--address={redis_server.address}",
                 "--net_ifname=ipogif0", "--db_cpus=[2]", "--run_db_as_batch=False", "--launcher=auto"]) == 0
    runs = _runs(tmp_path / "tp")
    assert len(runs) == 2
    spec = json.loads((runs[0] / "run.json").read_text())
    assert spec["driver_options_not_used"] == {"run_db_as_batch": "False", "db_cpus": "[2]", "net_ifname": "ipogif0"}
    assert spec["attributes"]["clients"] == 2 and spec["attributes"]["launcher"] == "local"
    assert main(["process_scaling_results", "--scaling_dir=tp", "--overwrite=False"]) == 0
    assert "2 runs" in capsys.readouterr().out


def test_driver_names_and_flags_map_to_the_commands():
    from benchmarks.smartsim_scaling.cli import COMMANDS, build_parser

    parser = build_parser()
    args = parser.parse_args(["inference_colocated", "--clients_per_node=[24,28]", "--nodes=[2]", "--db_tpq=[1,2]",
                              "--device=GPU", "--batch_size=[1]", "--exp_name=x", "--pin_app_cpus=[False]"])
    assert args.canonical == "inference" and args.colocated and args.device == "cuda"
    assert [p["clients"] for p in COMMANDS["inference"].build_sweep(args).permutations] == [48, 56]
    args = parser.parse_args(["inference_standard", "--client_nodes=[1,2]", "--clients_per_node=[3]",
                              "--device=CPU", "--db_nodes=[1]"])
    assert args.canonical == "inference" and not args.colocated
    assert [p["clients"] for p in COMMANDS["inference"].build_sweep(args).permutations] == [3, 6]
    args = parser.parse_args(["aggregation_scaling", "--tensors_per_dataset=[1, 2]", "--client_threads=[1]",
                              "--iterations=3", "--db_cpus=36"])
    assert args.canonical == "aggregation" and args.tensors_per_dataset == [1, 2]
    args = parser.parse_args(["process_scaling_results"])
    assert args.canonical == "process_results" and args.overwrite is True
    args = parser.parse_args(["process_results", "--overwrite"])
    assert args.overwrite is True
    for bad in (["throughput", "--launcher=pbs"], ["inference", "--device=TPU"], ["throughput", "--tensor_bytes=[a]"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_slurm_options_take_the_driver_syntax_and_auto_is_slurm_in_an_allocation(monkeypatch):
    from benchmarks.smartsim_scaling.cli import build_parser

    parser = build_parser()
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    args = parser.parse_args(["throughput_scaling", "--launcher=auto", "--db_hosts=[n1,n2]", "--db_cpus=[1,2]",
                              "--db_port=6790", "--net_ifname=ib0"])
    assert args.launcher == "local" and args.db_hosts == ["n1", "n2"] and args.db_cpus == [1, 2]
    assert driver_options(args) == {"db_hosts": "n1 n2", "db_cpus": "[1, 2]", "db_port": "6790", "net_ifname": "ib0"}
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    args = parser.parse_args(["inference_colocated", "--launcher=auto", "--nodes=[2]", "--clients_per_node=[3]",
                              "--net_ifname=ib0", "--run_db_as_batch=False"])
    assert args.launcher == "slurm"
    assert driver_options(args) == {"run_db_as_batch": "False"}, "the Slurm options are used, not recorded as unused"
    (permutation,) = COMMANDS["inference"].build_sweep(args).permutations
    assert permutation["client_nodes"] == 2 and permutation["clients"] == 6


def test_slurm_launcher_outside_an_allocation_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit, match="inside a Slurm allocation: `salloc"):
        main(["throughput_scaling", "--launcher=slurm", "--net_ifname=ib0", f"--exp_dir={tmp_path}"])
    assert not any(tmp_path.iterdir()), "nothing was started or written"


_PATH_ENTRY = st.text(st.characters(blacklist_characters=os.pathsep, blacklist_categories=("Cs",)), min_size=1)


@given(st.lists(st.one_of(_PATH_ENTRY, st.just(str(slurm.CODE_ROOT))), max_size=5))
def test_the_ranks_srun_starts_import_this_checkout(entries):
    """The checkout is on the ranks' PYTHONPATH once, first unless already there; the driver's entries stay,
    in their order."""
    root = str(slurm.CODE_ROOT)
    assert (slurm.CODE_ROOT / "benchmarks" / "smartsim_scaling" / "launch.py").is_file()
    parts = slurm.ranks_python_path(os.pathsep.join(entries) or None).split(os.pathsep)
    assert root in parts
    assert [p for p in parts if p != root] == [e for e in entries if e != root]
    assert parts.count(root) == max(1, entries.count(root))


@given(st.lists(st.text(st.characters(blacklist_characters=", []", blacklist_categories=("Cs",)), min_size=1),
                max_size=5))
def test_host_lists_take_the_driver_syntax(hosts):
    for text in (",".join(hosts), f"[{', '.join(hosts)}]"):
        assert str_list(text) == hosts
