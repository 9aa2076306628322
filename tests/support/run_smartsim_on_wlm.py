"""SmartSim's own workload-manager tests (``tests/on_wlm`` of its v0.8.0 sources) on a private 3-node Slurm,
with the smartredis_io Redis module in RedisAI's place::

    python -m tests.support.run_smartsim_on_wlm --smartsim-src DIR [--report FILE] [PYTEST ARGS...]

DIR holds SmartSim 0.8.0's ``conftest.py`` and ``tests/`` (its PyPI source archive has no tests): a clone
(``git clone --branch v0.8.0 https://github.com/CrayLabs/SmartSim``) or ``git archive v0.8.0 conftest.py tests``
of one. Without ``--smartsim-src`` the script clones it into a temporary directory with git.

The tests run against the installed ``smartsim==0.8.0``: DIR must not hold the tag's ``smartsim/`` package
(it lacks its generated ``version.py``, and would shadow the installed one).

The script starts :class:`~tests.support.node_networks.NetworkedSlurm` (accounting, each node with its own
address on ``slurm0``; ``--nodes``, default 3), lays out SmartSim's dependencies with the module
(:func:`smartredis_io.launchers.smartsim_setup.lay_out`), and runs ``pytest tests/on_wlm`` in an
allocation of every node with ``SMARTSIM_TEST_LAUNCHER=slurm``, ``SMARTSIM_TEST_INTERFACE=slurm0``,
``SLURM_OVERLAP=1`` and ``SLURM_MPI_TYPE=pmix``, as SmartSim's developers run it on a cluster; ``cc`` is
Open MPI's ``mpicc``, with which SmartSim's tests build their MPI application. It prints, and with
``--report`` writes as JSON, the count of passed, failed and skipped tests, each failure with the last line
of its error, and each skip reason. Run it as root on a machine where ``make setup`` has run (10 to 13
minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from benchmarks.worker_python import redis_server_reaching_python
from tests.support.node_networks import NODE_INTERFACE, NetworkedSlurm
from tests.support.smartsim_slurm import ALLOCATION_ENV

REPOSITORY = "https://github.com/CrayLabs/SmartSim"
TAG = "v0.8.0"
NODES = 3
#: SmartSim's test logs at DEBUG onto the console (its pyproject.toml): the report is the junit file
PYTEST_OPTIONS = ["-o", "log_cli=false", "-p", "no:cacheprovider", "-q", "-rfEs"]
ALLOCATION_MINUTES = 120


def _clone(into: Path) -> Path:
    source = into / "SmartSim"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", TAG, REPOSITORY, str(source)], check=True,
                   timeout=600)
    shutil.rmtree(source / "smartsim")  # the tests import the installed SmartSim
    return source


def _mpi_cc(work: Path) -> Path | None:
    """A directory whose ``cc`` is Open MPI's ``mpicc``, or None without one: SmartSim's tests build their MPI
    application with ``cc``, which is the MPI compiler wrapper on the Cray systems they come from."""
    mpicc = shutil.which("mpicc")
    if mpicc is None:
        return None
    compilers = work / "mpi-cc"
    compilers.mkdir()
    # a script, not a link: Open MPI's wrapper reads the data file named after how it was called
    (compilers / "cc").write_text(f"#!/bin/sh\nexec {shlex.quote(mpicc)} \"$@\"\n")
    (compilers / "cc").chmod(0o755)
    return compilers


def summarize(junit: Path) -> dict:
    """Passed, failed and skipped tests of a junit XML file, each failure and skip with its reason."""
    root = ElementTree.parse(junit).getroot()
    outcome: dict = {"passed": [], "failed": {}, "skipped": {}}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            lines = [line for line in (failure.get("message") or failure.text or "").splitlines() if line.strip()]
            outcome["failed"][name] = lines[-1] if lines else "(no message)"
        elif skipped is not None:
            outcome["skipped"][name] = skipped.get("message") or ""
        else:
            outcome["passed"].append(name)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.run_smartsim_on_wlm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smartsim-src", type=Path, default=None,
                        help=f"SmartSim {TAG}'s sources (conftest.py and tests/); default: git clone {REPOSITORY}")
    parser.add_argument("--report", type=Path, default=None, help="also write the summary as JSON here")
    parser.add_argument("--nodes", type=int, default=NODES,
                        help=f"nodes of the cluster and of the allocation; default: {NODES} (SmartSim's fixture of a "
                             "clustered database takes three nodes other than the allocation's last: 4 runs it)")
    args, pytest_args = parser.parse_known_args(argv)
    from smartredis_io.launchers.smartsim_setup import lay_out

    with tempfile.TemporaryDirectory(prefix="smartsim-on-wlm-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # the module's workers (nobody, under root) reach the sockets made below it
        source = (args.smartsim_src or _clone(work)).resolve()
        if not (source / "tests" / "on_wlm").is_dir() or not (source / "conftest.py").is_file():
            parser.error(f"{source} has no conftest.py and tests/on_wlm: not SmartSim's sources")
        if (source / "smartsim").is_dir():
            parser.error(f"{source} holds SmartSim's smartsim/ package, which would shadow the installed one: "
                         "remove it (the tests run against the installed smartsim==0.8.0)")
        layout = lay_out(work / "deps", worker_user="nobody" if os.geteuid() == 0 else None,
                         redis_server=redis_server_reaching_python())
        junit = work / "on_wlm.xml"
        started = time.monotonic()
        compilers = _mpi_cc(work)
        with NetworkedSlurm(nodes=args.nodes, accounting=True) as cluster:
            # SLURM_MPI_TYPE: srun starts the MPI test application (Open MPI's) through PMIx, as sites'
            # MpiDefault does
            env = {**ALLOCATION_ENV, **layout.env, "SMARTSIM_TEST_LAUNCHER": "slurm",
                   "SMARTSIM_TEST_INTERFACE": NODE_INTERFACE, "SLURM_MPI_TYPE": "pmix", "TMPDIR": str(work)}
            env["PATH"] = os.pathsep.join([str(compilers), cluster.env["PATH"]]) if compilers else cluster.env["PATH"]
            # streamed, not captured: the run takes minutes and says what it is doing
            code = subprocess.run(
                ["salloc", f"--nodes={args.nodes}", f"--time={ALLOCATION_MINUTES}", sys.executable, "-m", "pytest",
                 *PYTEST_OPTIONS, f"--junitxml={junit}", "tests/on_wlm", *pytest_args],
                cwd=source, env={**cluster.env, **env}, check=False).returncode
        seconds = time.monotonic() - started
        if not junit.exists():
            sys.stderr.write(f"pytest wrote no report (exit code {code})\n")
            return code or 1
        outcome = summarize(junit)
    counts = {key: len(value) for key, value in outcome.items()}
    reasons = collections.Counter(outcome["skipped"].values())
    lines = [f"SmartSim {TAG} tests/on_wlm on a local {args.nodes}-node Slurm with the smartredis_io module, "
             f"{seconds:.0f} s: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"]
    lines += [f"  FAILED {name}: {reason}" for name, reason in sorted(outcome["failed"].items())]
    lines += [f"  skipped x{n}: {reason}" for reason, n in reasons.most_common()]
    sys.stdout.write("\n".join(lines) + "\n")
    if args.report:
        args.report.write_text(json.dumps({"seconds": seconds, "counts": counts, **outcome}, indent=2) + "\n")
    return 0 if not outcome["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
