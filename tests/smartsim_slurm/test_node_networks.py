"""The local Slurm cluster's nodes, each in a network of its own: what SmartSim's databases and MPI ranks
spread over the nodes rely on, and nothing of it left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.node_networks import NODE_INTERFACE, NetworkedSlurm, node_networks_unavailable_reason
from tests.support.slurm import slurm_unavailable_reason

# one line per task: its node, whether its address is on the node interface, and whether the next node's
# address answered (a refused connection is an answer: that node's kernel sent it)
PROBE = f"""
import os, socket, sys
node = os.environ["SLURMD_NODENAME"]
addresses = dict(pair.split("=") for pair in sys.argv[1].split(","))
names = sorted(addresses)
peer = addresses[names[(names.index(node) + 1) % len(names)]]
try:
    socket.create_connection((peer, 9), timeout=10).close()
except ConnectionRefusedError:
    reached = True
except OSError:
    reached = False
else:
    reached = True
mine = addresses[node] in os.popen("ip -4 -o addr show {NODE_INTERFACE}").read()
print(node, mine, reached)
"""


def test_each_node_has_its_own_address_and_reaches_the_others(slurm_nodes):
    addresses = ",".join(f"{node}={slurm_nodes.node_address(node)}" for node in slurm_nodes.nodes)
    result = slurm_nodes.run(["srun", "-N3", "-n3", sys.executable, "-c", PROBE, addresses])
    lines = sorted(line.split() for line in result.stdout.splitlines() if line.strip())
    assert lines == [[node, "True", "True"] for node in slurm_nodes.nodes], result.stdout
    assert len({slurm_nodes.node_address(node) for node in slurm_nodes.nodes}) == 3


def test_stopping_the_cluster_removes_its_namespaces_and_bridge():
    reason = slurm_unavailable_reason(accounting=False) or node_networks_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = NetworkedSlurm(nodes=2, accounting=False)
    with cluster:
        names = set(cluster.networks.namespaces.values())
        assert names <= set(_namespaces())
        assert cluster.networks.bridge in _links()
    assert not names & set(_namespaces())
    assert cluster.networks.bridge not in _links() and not any(veth in _links() for veth in cluster.networks.veths.values())


def _namespaces() -> list[str]:
    return [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                       check=True).stdout.splitlines() if line.strip()]


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
