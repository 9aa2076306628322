"""SmartSim 0.8.0's Slurm launcher with the smartredis_io Redis module in RedisAI's place, as users run it: a
driver script (:mod:`tests.support.smartsim_slurm_driver`) in an allocation of a private 3-node Slurm
cluster, ``Experiment(launcher="slurm")`` launching databases with ``srun``. Each case puts and gets
tensors, runs a TorchScript model, a torch.export program and a script from the published SmartRedis
client on the workers the module starts, then the test reads Slurm's accounting of the steps.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import smartsim_slurm_driver
from tests.support.smartsim_slurm import result_line, salloc

pytestmark = pytest.mark.slow

DRIVER = Path(smartsim_slurm_driver.__file__)
PORT = smartsim_slurm_driver.PORT
ENDED = {"COMPLETED", "CANCELLED"}  # a database step ends when SmartSim stops it


def _run(slurm_nodes, smartsim_layout, nodes: int, case: str, directory: Path) -> tuple[dict, list[dict[str, str]]]:
    """The driver's result and the accounting records of its job's steps, once each has ended."""
    output = salloc(slurm_nodes, nodes, [sys.executable, str(DRIVER), case, str(directory)], smartsim_layout)
    result = result_line(output.stdout)
    job = int(result["job"])
    slurm_nodes.wait_for(job, "COMPLETED", source="sacct")
    steps = [row for row in slurm_nodes.sacct(job) if row["JobID"].startswith(f"{job}.")
             and row["JobID"].split(".")[1].isdigit()]
    assert steps and all(row["State"].split()[0] in ENDED for row in steps), steps
    return result, steps


def test_a_database_and_an_srun_application_on_one_node(slurm_nodes, smartsim_layout, tmp_path):
    """Two steps on the one node of an allocation, as SLURM_OVERLAP=1 allows: the database, and the
    application SmartSim launches with srun and points at it through SSDB."""
    result, steps = _run(slurm_nodes, smartsim_layout, 1, "standalone", tmp_path)
    (address,) = result["addresses"]
    assert address.rpartition(":")[0] in {slurm_nodes.node_address(node) for node in slurm_nodes.nodes}
    assert len(steps) == 2 and len({row["NodeList"] for row in steps}) == 1, steps


def test_a_three_shard_database_one_shard_per_node(slurm_nodes, smartsim_layout, tmp_path):
    result, steps = _run(slurm_nodes, smartsim_layout, 3, "cluster", tmp_path)
    assert sorted(result["addresses"]) == sorted(f"{slurm_nodes.node_address(node)}:{PORT}"
                                                 for node in slurm_nodes.nodes)
    assert all(count > 0 for count in result["keys"].values()), f"a shard holds no key: {result['keys']}"
    assert sorted(row["NodeList"] for row in steps) == slurm_nodes.nodes, steps


def test_databases_colocated_with_srun_applications_over_tcp_and_a_unix_socket(slurm_nodes, smartsim_layout):
    # The socket's directory is one the module's workers (nobody, under root) may search: not pytest's.
    with tempfile.TemporaryDirectory(prefix="srio-colocated-") as directory:
        os.chmod(directory, 0o755)
        _, steps = _run(slurm_nodes, smartsim_layout, 1, "colocated", Path(directory))
    assert len(steps) == 2 and all(row["NodeList"] in slurm_nodes.nodes for row in steps), steps
