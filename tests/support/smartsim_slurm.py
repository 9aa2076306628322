"""Allocations of a local Slurm cluster for SmartSim's Slurm launcher, as users get them (``salloc``), and the
result a driver script run in one prints."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence

from smartredis_io.launchers.smartsim_setup import SmartSimLayout
from tests.support.node_networks import NetworkedSlurm
from tests.support.srio_models import PUBLISHED_SKIP

try:
    import smartredis  # noqa: F401
    import smartsim  # noqa: F401
except ImportError:
    SMARTSIM_SKIP: str | None = (
        "SmartSim 0.8.0 and the published SmartRedis client (installed by the set-up on Python < 3.12, where that "
        f"client has wheels) are not importable here. {PUBLISHED_SKIP}")
else:
    SMARTSIM_SKIP = None

#: what an allocation's environment holds for SmartSim's Slurm launcher, as a user's would: SLURM_OVERLAP=1
#: (a database and an application share a node), SmartSim polling Slurm each second (its default, 10 s, suits
#: long jobs), SmartSim's and the published client's logs quiet, and two of SmartSim's waits two minutes long
#: instead of 20 s: for sacct to name a step srun launched ("Could not find id of launched job step") and for
#: a database to write its address to its output file. Each ends as soon as what it waits for is there;
#: 20 s is what a busy 2-core machine may take to start a step and import SmartSim in it.
ALLOCATION_ENV = {"SLURM_OVERLAP": "1", "SMARTSIM_JM_INTERVAL": "1", "SMARTSIM_FLAG_TELEMETRY": "0",
                  "SR_LOG_LEVEL": "QUIET", "SMARTSIM_WLM_TRIALS": "60", "SMARTSIM_DB_FILE_PARSE_TRIALS": "60"}
#: an allocation's time limit, in minutes: a driver that hangs gives its nodes back after it
ALLOCATION_MINUTES = 10


def salloc(cluster: NetworkedSlurm, nodes: int, argv: Sequence[str], layout: SmartSimLayout, *,
           env: Mapping[str, str] | None = None, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in an allocation of ``nodes`` nodes (``salloc -N NODES ARGV``), with :data:`ALLOCATION_ENV`
    and SmartSim pointed at ``layout``; its output is in the error when it fails."""
    return cluster.run(["salloc", f"--nodes={nodes}", f"--time={ALLOCATION_MINUTES}", *argv],
                       env={**ALLOCATION_ENV, **layout.env, **(env or {})}, timeout=timeout)


def result_line(output: str) -> dict:
    """The ``RESULT {json}`` line a driver printed."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the driver printed no RESULT line; its output ends:\n{output[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])

