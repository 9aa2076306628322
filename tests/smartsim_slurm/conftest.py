"""Fixtures of the tests that run SmartSim and SmartSim-Scaling's commands on Slurm: a private 3-node Slurm
cluster with accounting whose nodes each have a network of their own, and SmartSim's layout pointing at the
smartredis_io Redis module."""

from __future__ import annotations

import os

import pytest

from tests.support.node_networks import NetworkedSlurm, node_networks_unavailable_reason
from tests.support.slurm import slurm_unavailable_reason
from tests.support.smartsim_slurm import SMARTSIM_SKIP


@pytest.fixture(scope="session")
def slurm_nodes():
    """A private 3-node Slurm cluster with accounting (SmartSim's launcher reads sacct and sstat), each node
    in a network of its own: a database of three shards listens on one port on each."""
    reason = slurm_unavailable_reason() or node_networks_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with NetworkedSlurm(nodes=3, accounting=True) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def smartsim_layout(tmp_path_factory: pytest.TempPathFactory):
    """SmartSim's dependency layout with the module in RedisAI's place (as root, its workers run as nobody)."""
    if SMARTSIM_SKIP:
        pytest.skip(SMARTSIM_SKIP)
    from smartredis_io.launchers.smartsim_setup import lay_out

    return lay_out(tmp_path_factory.mktemp("smartsim-deps"), worker_user="nobody" if os.geteuid() == 0 else None)
