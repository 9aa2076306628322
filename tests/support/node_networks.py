"""A network of its own for each node of a Slurm cluster on one host.

Several ``slurmd`` on one host share its addresses: a program that listens on the same port on every
node of a job collides with itself there, where on a cluster each node has its own address. SmartSim's
database is one: a 3-shard database runs one shard per node, all on one port.

:class:`NodeNetworks` gives each node a Linux network namespace with its own loopback and one interface,
:data:`NODE_INTERFACE`, holding the node's address. A bridge in this host's namespace joins those
interfaces and holds the controller's address: the controller, the client commands and the programs of
this host reach every node's address, and the nodes reach each other and the controller, as on a
cluster's network. A ``slurmd`` started through :meth:`NodeNetworks.enter` lives in its node's
namespace, and so does every job step it starts. The addresses are in ``198.18.0.0/15``, the block set
aside for network tests (RFC 2544), one ``/24`` per set of nodes. :class:`NetworkedSlurm` is the local
Slurm cluster of :mod:`tests.support.slurm` with its nodes so placed.

It needs root (``CAP_NET_ADMIN``), iproute2's ``ip`` and util-linux's ``nsenter``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import random
import re
import shutil
import socket
import subprocess
from collections.abc import Sequence
from typing import Any

import psutil
from typing_extensions import override

from lightning_storage_plugins.services import ServiceStartError
from tests.support.slurm import PROBE_TIMEOUT_S, LocalSlurm

__all__ = ["NODE_INTERFACE", "NetworkedSlurm", "NodeNetworkError", "NodeNetworks", "node_networks_unavailable_reason"]

#: the interface that holds a node's address in its namespace (``Orchestrator(interface=...)``)
NODE_INTERFACE = "slurm0"
BLOCK = ipaddress.ip_network("198.18.0.0/15")
NAMESPACE_DIR = "/run/netns"
_PREFIX = "local-slurm"
_NAMESPACE = re.compile(rf"^{_PREFIX}-(\d+)-(\d+)-")
# `ip -o link show`'s line of a bridge (lsb<pid>-<serial>) or of an interface pair's end on it
# (lsv<pid>-<serial>-<node>, shown as NAME@ifN: its peer is in a namespace)
_LINK = re.compile(r"^\d+:\s+(ls[bv]([0-9a-f]+)-[0-9a-f]+(?:-\d+)?)[@:]")
COMMAND_TIMEOUT_S = 30.0
_created = itertools.count()


class NodeNetworkError(RuntimeError):
    """A node network could not be made; the message carries ``ip``'s own."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        raise NodeNetworkError(f"`ip {' '.join(args)}` exited with code {result.returncode}: {result.stderr.strip()}")
    return result


def node_networks_unavailable_reason() -> str | None:
    """Why nodes cannot have networks of their own here, or None when they can (a namespace is made and
    removed to find out)."""
    missing = [name for name in ("ip", "nsenter") if shutil.which(name) is None]
    if missing:
        return f"node networks need {' and '.join(missing)} (Debian: iproute2, util-linux)"
    if os.geteuid() != 0:
        return "node networks need root (CAP_NET_ADMIN) to make network namespaces"
    probe = f"{_PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces cannot be made here ({made.stderr.strip()}): node networks need CAP_NET_ADMIN"
    _ip("netns", "del", probe, check=False)
    return None


def _subnets_in_use() -> set[ipaddress.IPv4Network]:
    found = set()
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        match = re.search(r"\binet (\S+)", line)
        if match:
            found.add(ipaddress.ip_interface(match.group(1)).network)
    return found


def remove_stale() -> None:
    """Remove the namespaces, bridges and interface pairs of node networks whose process is gone (killed
    before its clean-up)."""
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NAMESPACE.match(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            _ip("netns", "del", name, check=False)
    for name, pid in _our_links().items():
        if not psutil.pid_exists(pid):
            _ip("link", "del", name, check=False)


def _our_links() -> dict[str, int]:
    """The bridges and interface pairs' ends of node networks in this host's namespace, with the id of the
    process that made them."""
    found = {}
    for line in _ip("-o", "link", "show").stdout.splitlines():
        match = _LINK.match(line)
        if match:
            found[match.group(1)] = int(match.group(2), 16)
    return found


def _bridge_name(pid: int, serial: int) -> str:
    # within Linux's 15 characters for an interface name: pid_max is at most 2**22 (6 hex digits)
    return f"lsb{pid:x}-{serial % 16:x}"


class NodeNetworks:
    """One network namespace per node, joined by a bridge in this host's namespace.

    Args:
        nodes: the node names (``n1``, ``n2``...).

    Attributes:
        bridge: the bridge's interface name, in this host's namespace.
        namespaces: each node's network namespace (``ip netns`` name).
        veths: each node's interface pair's end on the bridge.

    Raises:
        ValueError: more nodes than a ``/24`` holds.
    """

    def __init__(self, nodes: Sequence[str]) -> None:
        if len(nodes) > 250:
            raise ValueError(f"at most 250 nodes have networks of their own, got {len(nodes)}")
        self.nodes = list(nodes)
        serial = next(_created)
        self.bridge = _bridge_name(os.getpid(), serial)
        self.namespaces = {node: f"{_PREFIX}-{os.getpid()}-{serial}-{node}" for node in self.nodes}
        self.veths = {node: f"lsv{os.getpid():x}-{serial % 16:x}-{i}" for i, node in enumerate(self.nodes, 1)}
        self._subnet: ipaddress.IPv4Network | None = None

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise NodeNetworkError("the node networks are not made yet")
        return self._subnet

    @property
    def controller_address(self) -> str:
        """The bridge's address, where this host's daemons are reached from the nodes."""
        return str(self.subnet.network_address + 254)

    def address(self, node: str) -> str:
        """The node's address, on its :data:`NODE_INTERFACE`."""
        return str(self.subnet.network_address + 1 + self.nodes.index(node))

    def enter(self, node: str) -> list[str]:
        """The command prefix that runs a program in the node's network namespace (and nothing else of it:
        ``ip netns exec`` would also mount a sysfs of its own, where slurmd finds no cgroup file system)."""
        return ["nsenter", f"--net={NAMESPACE_DIR}/{self.namespaces[node]}"]

    def create(self) -> NodeNetworks:
        """Make the bridge and each node's namespace and interface; remove what was made if any step fails.

        Raises:
            NodeNetworkError: ``ip`` refused a step; no free ``/24`` is left in the block.
        """
        remove_stale()
        in_use = _subnets_in_use()
        free = [net for net in BLOCK.subnets(new_prefix=24) if not any(net.overlaps(used) for used in in_use)]
        if not free:
            raise NodeNetworkError(f"every /24 of {BLOCK} is in use on this host")
        self._subnet = random.choice(free)  # two sessions making networks at once rarely pick the same
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in self.nodes:
                namespace, veth = self.namespaces[node], self.veths[node]
                _ip("netns", "add", namespace)
                _ip("link", "add", veth, "type", "veth", "peer", "name", NODE_INTERFACE, "netns", namespace)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", namespace, "addr", "add", f"{self.address(node)}/24", "dev", NODE_INTERFACE)
                _ip("-n", namespace, "link", "set", NODE_INTERFACE, "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            with contextlib.suppress(NodeNetworkError):  # the step's own error says more
                self.remove()
            raise
        return self

    def remove(self) -> None:
        """Remove each node's interface pair, the bridge and every namespace. Idempotent.

        The pairs go first, one by one: deleting a namespace does not delete its interfaces at once (the
        kernel frees a namespace in a work queue of its own, late on a busy machine, and never while a
        process still holds it, a job step's that outlived its ``slurmd``), and until then a pair's end
        stays on the bridge in this host's namespace.

        Raises:
            NodeNetworkError: a namespace, the bridge or an interface pair is still there after its
                removal (the message names them and ``ip``'s answers).
        """
        if self._subnet is None:  # never made
            return
        failures = {}
        for veth in self.veths.values():  # its peer, the node's interface, goes with it
            failures[veth] = _remove(["link", "del", veth])
        failures[self.bridge] = _remove(["link", "del", self.bridge])
        for namespace in self.namespaces.values():
            failures[namespace] = _remove(["netns", "del", namespace])
        left = self._left()
        if left:
            raise NodeNetworkError("node networks still there after their removal: " + "; ".join(
                f"{name} (`ip`: {failures[name] or 'no error'})" for name in left))

    def _left(self) -> list[str]:
        """What of these networks is still there: namespaces, then links."""
        namespaces = {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}
        links = _our_links()
        return ([name for name in self.namespaces.values() if name in namespaces]
                + [name for name in (*self.veths.values(), self.bridge) if name in links])


def _remove(args: list[str]) -> str:
    """Run ``ip ARGS`` to remove something; ``ip``'s complaint, or ``""`` when it had nothing to say."""
    try:
        return _ip(*args, check=False).stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)


class NetworkedSlurm(LocalSlurm):
    """A :class:`~tests.support.slurm.LocalSlurm` whose nodes each have a network of their own
    (:class:`NodeNetworks`), so that a job may listen on one port on every node; and each node its own
    temporary directory, as Slurm's ``TmpFS`` (``%n`` expanded per node: Slurm's PMIx plugin makes per-step
    directories there whose names would collide between nodes on one host) and as its tasks' ``TMPDIR``.

    Args:
        nodes: how many nodes.
        kwargs: :class:`~tests.support.slurm.LocalSlurm`'s other arguments.
    """

    def __init__(self, nodes: int = 3, **kwargs: Any) -> None:
        super().__init__(nodes, **kwargs)
        self.networks = NodeNetworks(self.nodes)

    def node_address(self, node: str) -> str:
        """The node's address, on its :data:`NODE_INTERFACE` (where its job steps listen)."""
        return self.networks.address(node)

    @override
    def start(self) -> NetworkedSlurm:
        reason = node_networks_unavailable_reason()
        if reason:
            raise ServiceStartError(reason)
        self.networks.create()
        try:
            super().start()
        except BaseException:
            self.networks.remove()
            raise
        return self

    @override
    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.networks.remove()

    @override
    def _slurm_conf(self) -> str:
        host = socket.gethostname().split(".")[0]
        lines = []
        for line in super()._slurm_conf().splitlines():
            if line.startswith("SlurmctldHost="):
                # the bridge's address: what the nodes reach, and what srun on this host gives as its own
                line = f"SlurmctldHost={host}({self.networks.controller_address})"
            elif line.startswith("AccountingStorageHost="):
                # sacct and sstat in a job (a batch script's SmartSim) reach slurmdbd on this host
                line = f"AccountingStorageHost={self.networks.controller_address}"
            elif line.startswith("NodeName="):
                node = line.split()[0].partition("=")[2]
                line = re.sub(r"\bNodeAddr=\S+", f"NodeAddr={self.node_address(node)}", line)
            lines.append(line)
        for node in self.nodes:
            (self.path / "tmp" / node).mkdir(parents=True, mode=0o1777)
        lines.append(f"TmpFS={self.path}/tmp/%n")
        # and TMPDIR, as sites set it per job and node: SmartSim's colocated database takes a lock file
        # there, one database per node
        task_prolog = self.path / "task_prolog.sh"
        self._write(task_prolog, f'#!/bin/sh\necho "export TMPDIR={self.path}/tmp/$SLURMD_NODENAME"\n'.encode(), 0o755)
        lines.append(f"TaskProlog={task_prolog}")
        return "\n".join(lines) + "\n"

    @override
    def _start_slurmd(self, node: str) -> None:
        address, port = self.node_address(node), self._ports[node]

        def listening() -> bool:
            with socket.create_connection((address, port), timeout=PROBE_TIMEOUT_S):
                return True

        self._daemon(f"slurmd:{node}", [*self.networks.enter(node), self._binary("slurmd"), "-D", "-f",
                                        os.fspath(self.conf), "-N", node], listening)
