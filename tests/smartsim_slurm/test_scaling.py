"""SmartSim-Scaling's commands as its users run them on Slurm: ``inference_standard``, ``inference_colocated`` and
``throughput_scaling --launcher slurm`` in one batch job of a private 3-node Slurm cluster (SmartSim's Slurm
launcher starts the databases, with the smartredis_io Redis module in RedisAI's place, and srun the MPI client
ranks), then ``process_scaling_results`` on each experiment, with tiny settings."""

from __future__ import annotations

import csv
import json
import shlex
import sys
from pathlib import Path

import pytest

from benchmarks.smartsim_scaling.cli import main
from benchmarks.smartsim_scaling.results import CSV_NAME, RESULTS_DIR
from tests.support.smartsim_slurm import ALLOCATION_ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 900.0
# SmartSim-Scaling's flags; the smallest runs that still span the nodes: a 3-shard database with a client on
# each node, a database on one node with two clients, and databases colocated on the two nodes of the clients
COMMANDS = {
    "throughput": ["throughput_scaling", "--client_nodes=[3]", "--clients_per_node=[1]", "--db_nodes=[3]",
                   "--tensor_bytes=[1024,4096]", "--iterations=3"],
    "standard": ["inference_standard", "--client_nodes=[1]", "--clients_per_node=[2]", "--db_nodes=[1]",
                 "--iterations=3", "--image_size=32", "--device=CPU"],
    "colocated": ["inference_colocated", "--nodes=[2]", "--clients_per_node=[1]", "--iterations=3",
                  "--image_size=32", "--device=CPU"],
}
STEPS = ("put_tensor", "run_script", "run_model", "unpack_tensor")


@pytest.fixture(scope="module")
def scaling_job(slurm_nodes, smartsim_layout, tmp_path_factory):
    """One batch job (``sbatch -N3 --exclusive``, as SmartSim-Scaling's batch scripts) running the three
    commands with ``--launcher slurm``; its experiment directories and accounting records."""
    out = tmp_path_factory.mktemp("scaling-slurm")
    lines = ["#!/bin/bash", "set -e", f"cd {shlex.quote(str(ROOT))}"]
    for name, argv in COMMANDS.items():
        lines.append(shlex.join([sys.executable, "-m", "benchmarks.smartsim_scaling", *argv, "--launcher=slurm",
                                 "--net_ifname=slurm0", f"--exp_name={out / name}"]))
    job = slurm_nodes.sbatch("--nodes=3", "--exclusive", "--time=20", f"--output={out / 'job.out'}",
                             script="\n".join(lines) + "\n", env={**ALLOCATION_ENV, **smartsim_layout.env})
    slurm_nodes.wait_for(job, "COMPLETED", timeout=JOB_TIMEOUT_S)
    slurm_nodes.wait_for(job, "COMPLETED", source="sacct")
    steps = [row for row in slurm_nodes.sacct(job) if row["JobID"].split(".")[-1].isdigit() and "." in row["JobID"]]
    return out, steps


def _runs(exp_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) | {"dir": path.parent} for path in sorted(exp_dir.glob("*/run.json"))]


def _functions(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    with open(path) as f:
        for _, function, seconds in csv.reader(f):
            assert float(seconds) >= 0
            counts[function] = counts.get(function, 0) + 1
    return counts


def _step(steps: list[dict[str, str]], run: dict) -> dict[str, str]:
    """The accounting record of a run's client step (SmartSim names it after the run)."""
    (row,) = [row for row in steps if row["JobName"].startswith(f"{run['name']}-clients")]
    return row


def test_throughput_scaling_on_a_three_shard_database_across_the_nodes(scaling_job, slurm_nodes):
    out, steps = scaling_job
    runs = _runs(out / "throughput")
    assert sorted(r["attributes"]["tensor_bytes"] for r in runs) == [1024, 4096]
    for run in runs:
        attributes = run["attributes"]
        assert attributes["launcher"] == "slurm" and attributes["db_nodes"] == 3 and attributes["cluster"]
        for rank in range(3):
            counts = _functions(run["dir"] / f"rank_{rank}_timing.csv")
            assert counts["put_tensor"] == counts["unpack_tensor"] == counts["redis_set"] == 3
        step = _step(steps, run)
        assert step["State"] == "COMPLETED" and step["NNodes"] == "3" and step["NTasks"] == "3", step
    databases: dict[str, list[str]] = {}
    for row in steps:  # SmartSim names each shard's step DATABASE_SHARD-SUFFIX
        if row["JobName"].startswith("db-"):
            databases.setdefault(row["JobName"].partition("_")[0], []).append(row["NodeList"])
    assert slurm_nodes.nodes in [sorted(nodes) for nodes in databases.values()], f"one shard per node: {databases}"


def test_inference_standard_and_colocated(scaling_job):
    out, steps = scaling_job
    for name, nodes, colocated in (("standard", 1, False), ("colocated", 2, True)):
        (run,) = _runs(out / name)
        assert run["attributes"]["colocated"] is colocated and run["attributes"]["launcher"] == "slurm"
        for rank in (0, 1):
            counts = _functions(run["dir"] / f"rank_{rank}_timing.csv")
            assert all(counts[step] == 3 for step in STEPS), counts
        step = _step(steps, run)
        assert step["State"] == "COMPLETED" and step["NNodes"] == str(nodes), step
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary[0]["run_model_ms"] > 0 and summary[0]["inferences_per_s"] > 0


def test_process_scaling_results_plots_every_experiment(scaling_job, capsys):
    out, _ = scaling_job
    expected = {"throughput": {"throughput_db3.png", "box_put_tensor.png"},
                "standard": {"box_run_model.png"}, "colocated": {"box_run_model.png"}}
    for name, plots in expected.items():
        assert main(["process_scaling_results", f"--scaling_dir={out / name}"]) == 0
        results = out / name / RESULTS_DIR
        with open(results / CSV_NAME) as f:
            assert len(list(csv.DictReader(f))) == len(_runs(out / name))
        assert plots <= {p.name for p in results.glob("*.png")}
        assert all(p.stat().st_size > 0 for p in results.glob("*.png"))
