"""``--launcher slurm``: the database and the client ranks through SmartSim's Slurm launcher, in an allocation.

As SmartSim-Scaling's driver runs on Slurm (``salloc -N N`` or an ``sbatch`` script around the command):
one SmartSim ``Experiment(launcher="slurm")`` in the experiment directory, and

* each deployment's database is SmartSim's ``Orchestrator`` (``--db_nodes`` shards, one per node, all on
  ``--db_port`` on the nodes' ``--net_ifname``, ``--db_cpus`` CPUs each, on ``--db_hosts`` if given), served
  by the smartredis_io Redis module in RedisAI's place, whose execution workers the module starts
  (``THREADS_PER_QUEUE``: ``--workers`` of the inference commands);
* each application of a run (the clients; the producers and the consumer) is a SmartSim ``Model`` that
  ``srun`` starts on ``--client_nodes`` nodes as MPI ranks (``--srun_mpi``, mpi4py), running
  ``python -m benchmarks.smartsim_scaling.launch RUN_DIR APP``; its output is ``RUN_DIR/NAME.out`` and
  ``.err`` beside the ranks' timing files;
* ``inference_colocated`` gives each run's application a database on each of its nodes
  (``colocate_db_tcp`` on the node's loopback, ``--db_port``, ``--db_cpus``), where the first rank of each
  node stores the model and the script before the clients start.

SmartSim finds the module where ``python -m smartredis_io.smartsim_setup DIR`` laid it out
(``$SMARTSIM_DEP_INSTALL_PATH=DIR``), as it finds RedisAI after ``smart build``. Every step asks for
``--overlap``: the database and the clients may share nodes, and Slurm 22.05 otherwise gives a step every
CPU of its nodes and makes the next one wait (SmartSim then reports "Could not find id of launched job step").
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.smartsim_scaling.launch import MPI_MISSING, App, Deployment
from benchmarks.worker_python import layout_unreached

log = logging.getLogger(__name__)

#: the checkout directory that holds the ``benchmarks`` package: the ranks import it from there
CODE_ROOT = Path(__file__).resolve().parents[2]
POLL_INTERVAL_S = 0.5  # how often the applications' SmartSim statuses are read (SmartSim polls Slurm itself)
OUTPUT_TAIL_CHARS = 4000  # of a failed application's output, in the error
DEFAULT_DB_PORT = 6780  # SmartSim-Scaling's
DEFAULT_DB_CPUS = 2
SETUP_HINT = ("lay out the smartredis_io Redis module for SmartSim with `python -m smartredis_io.smartsim_setup DIR` "
              "and `export SMARTSIM_DEP_INSTALL_PATH=DIR` (as `smart build` would lay out RedisAI)")


class SlurmSetupError(RuntimeError):
    """What ``--launcher slurm`` needs is missing; the message says what and how to get it."""


@dataclass(frozen=True)
class SlurmOptions:
    """Where and how the databases and the applications run.

    Args:
        net_ifname: the network interface the database shards listen on, on their nodes (``ib0``, ``hsn0``...);
            None for a colocated database only (on each node's loopback).
        db_port: the port of every shard, and of a colocated database.
        db_hosts: the nodes of the database (default: Slurm places it in the allocation).
        srun_mpi: ``srun --mpi`` for the applications' MPI ranks (``pmix`` for Open MPI; ``none``: Slurm's
            ``MpiDefault``).
    """

    net_ifname: str | None = None
    db_port: int = DEFAULT_DB_PORT
    db_hosts: tuple[str, ...] = ()
    srun_mpi: str = "pmix"


def ranks_python_path(python_path: str | None) -> str:
    """``$PYTHONPATH`` for the ranks srun starts, which import this checkout's ``benchmarks`` package.

    srun gives a step the environment of the command that starts it, over what ``--export`` sets (so
    SmartSim's ``update_env`` cannot change a variable that is set): the driver's own ``PYTHONPATH`` must
    name the checkout.
    """
    parts = [part for part in (python_path or "").split(os.pathsep) if part]
    return os.pathsep.join(parts if str(CODE_ROOT) in parts else [str(CODE_ROOT), *parts])


def check_environment(options: SlurmOptions, colocated: bool) -> None:
    """Fail early, naming what is missing: an allocation, ``srun``, SmartSim and the module (with workers that
    can run their interpreter), mpi4py, an interface.

    Raises:
        SlurmSetupError: the first of these that is missing.
    """
    if not os.environ.get("SLURM_JOB_ID"):
        raise SlurmSetupError("--launcher slurm runs inside a Slurm allocation: `salloc -N NODES python -m "
                              "benchmarks.smartsim_scaling ...`, or the command in an sbatch script")
    if shutil.which("srun") is None:
        raise SlurmSetupError("--launcher slurm needs Slurm's srun on PATH")
    if importlib.util.find_spec("smartsim") is None:
        raise SlurmSetupError("--launcher slurm needs SmartSim (pip install smartsim==0.8.0; `make setup` installs it)")
    from smartsim._core.config import CONFIG
    from smartsim.error import SSConfigError

    try:
        redisai = CONFIG.redisai
    except SSConfigError as exc:
        raise SlurmSetupError(f"SmartSim finds no RedisAI module ({exc}): {SETUP_HINT}") from None
    log.info("SmartSim's RedisAI module: %s", os.path.realpath(redisai))
    if (unreached := layout_unreached(CONFIG.database_exe)) is not None:
        raise SlurmSetupError(unreached)
    if importlib.util.find_spec("mpi4py") is None:
        raise SlurmSetupError(MPI_MISSING)
    if not colocated and not options.net_ifname:
        raise SlurmSetupError("--launcher slurm needs --net_ifname, the network interface the database's nodes "
                              "listen on (ib0, hsn0, eth0...), as SmartSim-Scaling's driver does")


class SlurmSession:
    """One SmartSim experiment in ``exp_dir``: the databases of a sweep and the applications of its runs.

    Args:
        exp_dir: the experiment directory (created if needed).
        options: where the databases and the applications run.
    """

    def __init__(self, exp_dir: Path, options: SlurmOptions) -> None:
        from smartsim import Experiment

        self.options = options
        Path(exp_dir).mkdir(parents=True, exist_ok=True)
        self._exp = Experiment(Path(exp_dir).name, exp_path=str(exp_dir), launcher="slurm")

    @contextlib.contextmanager
    def database(self, db_nodes: int, workers: int, db_cpus: int) -> Iterator[Deployment]:
        """SmartSim's Orchestrator of ``db_nodes`` shards with ``workers`` execution workers each; stopped after.

        Raises:
            smartsim.error.SmartSimError: SmartSim could not start it.
        """
        db = self._exp.create_database(
            port=self.options.db_port, db_nodes=db_nodes, interface=self.options.net_ifname, single_cmd=False,
            hosts=list(self.options.db_hosts) or None, db_identifier=f"db-{uuid.uuid4().hex[:8]}",
            threads_per_queue=workers or None)
        db.set_cpus(db_cpus)
        db.set_run_arg("overlap", None)
        self._exp.generate(db)
        log.info("starting a %d-shard database with srun on %s port %d", db_nodes, self.options.net_ifname,
                 self.options.db_port)
        self._exp.start(db)
        try:
            address = ",".join(db.get_address())
            log.info("database at %s on %s", address, ",".join(db.hosts))
            yield Deployment(address=address, cluster=db_nodes > 1, db_nodes=db_nodes)
        finally:
            self._exp.stop(db)

    def run_apps(self, apps: Sequence[App], run_dir: Path, timeout_s: float,
                 colocated: dict[str, Any] | None = None) -> None:
        """Launch every application of a run with srun at once and wait for all; a failed one fails the run.

        Args:
            apps: the applications.
            run_dir: the run's directory (the applications' output goes there).
            timeout_s: how long the run may take; then its applications are cancelled.
            colocated: for a colocated run, the database beside each application (``db_cpus``, ``workers``).

        Raises:
            RuntimeError: an application failed; the message has the end of its output.
            TimeoutError: the run outlived ``timeout_s``.
        """
        from smartsim.status import TERMINAL_STATUSES, SmartSimStatus

        models = [self._model(app, run_dir, colocated) for app in apps]
        self._exp.start(*models, block=False)
        deadline = time.monotonic() + timeout_s
        log.info("waiting for %s (srun steps) to finish, at most %.0f s", ", ".join(m.name for m in models), timeout_s)
        try:
            while True:
                statuses = dict(zip(models, self._exp.get_status(*models), strict=True))
                for model, status in statuses.items():
                    if status in TERMINAL_STATUSES and status != SmartSimStatus.STATUS_COMPLETED:
                        raise RuntimeError(f"application {model.name} ended {status.value}; the end of its output "
                                           f"({model.path}):\n{_output_tail(model)}")
                if all(status == SmartSimStatus.STATUS_COMPLETED for status in statuses.values()):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"scaling run did not finish in {timeout_s:.0f} s: "
                                       f"{sorted(m.name for m, s in statuses.items() if s not in TERMINAL_STATUSES)}")
                time.sleep(POLL_INTERVAL_S)
        finally:
            running = [m for m, s in zip(models, self._exp.get_status(*models), strict=True)
                       if s not in TERMINAL_STATUSES]
            if running:
                self._exp.stop(*running)

    def _model(self, app: App, run_dir: Path, colocated: dict[str, Any] | None):
        run_args: dict[str, str | None] = {"overlap": None}
        if self.options.srun_mpi != "none":
            run_args["mpi"] = self.options.srun_mpi
        settings = self._exp.create_run_settings(
            sys.executable, ["-m", "benchmarks.smartsim_scaling.launch", str(run_dir), app.name],
            run_command="srun", run_args=run_args)
        settings.set_nodes(app.nodes)
        settings.set_tasks(app.nprocs)
        model = self._exp.create_model(f"{run_dir.name}-{app.name}", settings, path=str(run_dir))
        if colocated is not None:
            # each node's loopback: the database is the node's own, its ranks reach it through SSDB
            model.colocate_db_tcp(port=self.options.db_port, ifname="lo", db_cpus=colocated["db_cpus"],
                                  threads_per_queue=colocated.get("workers") or None)
        return model


def _output_tail(model: Any) -> str:
    text = ""
    for kind in ("err", "out"):
        path = Path(model.path, f"{model.name}.{kind}")
        if path.exists():
            text += path.read_text(errors="replace")[-OUTPUT_TAIL_CHARS:]
    return text or "(no output)"
