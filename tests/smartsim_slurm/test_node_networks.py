"""The local Slurm cluster's nodes, each in a network of its own: what SmartSim's databases and MPI ranks
spread over the nodes rely on, and nothing of it left behind."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.node_networks import (
    NODE_INTERFACE,
    NetworkedSlurm,
    NodeNetworks,
    node_networks_unavailable_reason,
    remove_stale,
)
from tests.support.slurm import slurm_unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
# a process' start, and a few dozen `ip` commands, on a busy 2-core machine with room to spare
START_TIMEOUT_S = 120.0

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
        assert cluster.networks.bridge in _link_names()
    assert not _made(cluster.networks)


def test_removing_node_networks_leaves_nothing_while_a_process_still_holds_a_namespace():
    """A job step that outlives its slurmd keeps its node's namespace alive; its interfaces go all the same
    (the kernel frees a namespace, and the interfaces in it, only once no process holds it)."""
    _skip_without_node_networks()
    networks = NodeNetworks(["n1", "n2"]).create()
    with subprocess.Popen([*networks.enter("n1"), sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert _first_line(holder) == "in n1's namespace"
            networks.remove()
            assert not _made(networks)
        finally:
            holder.kill()


HOLDER = """
import sys
print("in n1's namespace", flush=True)
sys.stdin.read()
"""
KILLED_MAKER = """
import json, sys
from tests.support.node_networks import NodeNetworks
networks = NodeNetworks(["n1", "n2"]).create()
print(json.dumps([*networks.namespaces.values(), networks.bridge, *networks.veths.values()]), flush=True)
sys.stdin.read()
"""


def test_the_networks_of_a_killed_process_are_removed_by_the_next_one():
    _skip_without_node_networks()
    with subprocess.Popen([sys.executable, "-c", KILLED_MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, cwd=ROOT) as maker:
        try:
            names = set(json.loads(_first_line(maker)))
            assert names <= set(_namespaces()) | _link_names()
        finally:
            maker.kill()  # SIGKILL: no clean-up of its own

    remove_stale()

    assert not names & (set(_namespaces()) | _link_names())


def _first_line(process: subprocess.Popen[str]) -> str:
    """The process' first line of output, waited for up to ``START_TIMEOUT_S``."""
    ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
    line = process.stdout.readline() if ready else ""
    assert line, f"the process wrote no line within {START_TIMEOUT_S:.0f} s (exit code {process.poll()})"
    return line.strip()


def _skip_without_node_networks() -> None:
    reason = node_networks_unavailable_reason()
    if reason:
        pytest.skip(reason)


def _made(networks: NodeNetworks) -> set[str]:
    """What of ``networks`` this host still has: namespaces, the bridge, interface pairs' ends."""
    return ((set(networks.namespaces.values()) & set(_namespaces()))
            | ({networks.bridge, *networks.veths.values()} & _link_names()))


def _link_names() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in _links().splitlines()}


def _namespaces() -> list[str]:
    return [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                       check=True).stdout.splitlines() if line.strip()]


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
