"""``python -m benchmarks.smartsim_scaling COMMAND``: the SmartSim-Scaling driver's commands, on one machine or MPI.

The SmartSim-Scaling driver's command lines run unchanged: its command names (``throughput_scaling``,
``inference_standard``, ``inference_colocated``, ``aggregation_scaling``, ``process_scaling_results``),
Fire's ``--flag=[a,b]`` lists and ``--flag=True`` booleans, ``--exp_name``, and its batch-system
options. With ``--launcher slurm``, in a Slurm allocation, SmartSim's Slurm launcher starts the
databases and the client ranks (:mod:`benchmarks.smartsim_scaling.slurm`), as the driver does.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from benchmarks.report import format_table, write_json
from benchmarks.smartsim_scaling import aggregation, inference, slurm, throughput
from benchmarks.smartsim_scaling.launch import DEFAULT_RUN_TIMEOUT_S, run_sweep
from benchmarks.smartsim_scaling.options import (
    COMMAND_ALIASES,
    add_boolean,
    add_driver_options,
    driver_options,
    launcher,
)
from benchmarks.smartsim_scaling.results import process_results, significant

log = logging.getLogger("benchmarks.smartsim_scaling")

COMMANDS = {m.COMMAND: m for m in (throughput, inference, aggregation)}
DEFAULT_ROOT = Path("results") / "smartsim_scaling"


def _common(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--exp_dir", type=Path, default=None,
                        help=f"where the run directories go; default: {DEFAULT_ROOT / f'{command}-scaling'}")
    parser.add_argument("--exp_name", default=None,
                        help="the driver's name of the output directory (relative to the working directory); "
                             "--exp_dir wins when both are given")
    parser.add_argument("--address", default=None,
                        help="an existing database (host:port, a comma list for a cluster, or unix:///path); "
                             "default: start one with smartredis_io's launcher and stop it after")
    parser.add_argument("--launcher", type=launcher, default="local", metavar="{local,mpi,slurm,auto}",
                        help="run client ranks as multiprocessing processes (local), under mpirun with mpi4py "
                             "(mpi, needs the [mpi] extra), or with the databases through SmartSim's Slurm launcher "
                             "in a Slurm allocation (slurm, needs SmartSim and mpi4py); the driver's auto is slurm "
                             "in an allocation, else local; default: local")
    parser.add_argument("--mpirun", default="mpirun",
                        help="MPI launch command, e.g. 'mpirun --hostfile hosts'; default: mpirun")
    parser.add_argument("--timeout", type=float, default=DEFAULT_RUN_TIMEOUT_S,
                        help="seconds one run may take before it is stopped; default: %(default)s")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the summary rows as JSON; default: EXP_DIR/summary.json")
    add_driver_options(parser)


def _process_results_arguments(parser: argparse.ArgumentParser, overwrite: bool) -> None:
    parser.add_argument("--scaling_dir", type=Path, default=DEFAULT_ROOT / "throughput-scaling",
                        help="directory holding the run directories; default: %(default)s")
    add_boolean(parser, "--overwrite", default=overwrite,
                help="rebuild the CSV from the runs alone instead of adding new runs to the existing one "
                     f"(--overwrite=False adds them); default: {overwrite}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.smartsim_scaling",
        description="SmartSim scaling tests for smartredis_io: throughput, inference and data aggregation, "
                    "then process_results for a CSV and plots. The SmartSim-Scaling driver's command names "
                    "and flags (--flag=[a,b], --exp_name, ...) are accepted too.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level; default: INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        _common(p, name)
        p.set_defaults(canonical=name)
    p = sub.add_parser("process_results", help="collect every run's timings into one CSV and draw plots",
                       description="Collect every run under --scaling_dir into SCALING_DIR/results/"
                                   "scaling_results.csv (run attributes plus min/mean/max/median per "
                                   "function), box plots per function, and for throughput runs GB/s "
                                   "against tensor size (one line per client count) and a markdown table.")
    _process_results_arguments(p, overwrite=False)
    p.set_defaults(canonical="process_results")
    for alias, name in COMMAND_ALIASES.items():
        colocated = alias == "inference_colocated"
        p = sub.add_parser(alias, help=f"the SmartSim-Scaling driver's name of {name}"
                                       + (" --colocated" if colocated else ""))
        if name == "process_results":
            _process_results_arguments(p, overwrite=True)  # the driver's default
            p.set_defaults(canonical=name)
            continue
        COMMANDS[name].add_arguments(p)
        _common(p, name)
        p.set_defaults(canonical=name, **({"colocated": True} if colocated else {}))
    return parser


def _log_row(columns):
    def report(row):
        shown = significant(row)
        log.info("%s: %s", row["run"], ", ".join(f"{title}={shown.get(key)}" for key, title in columns.items()))
    return report


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the deployment's context managers: nothing is left running


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.canonical == "process_results":
        out = process_results(args.scaling_dir, overwrite=args.overwrite)
        print(f"{out['runs']} runs -> {out['csv']}")
        for path in out["plots"]:
            print(f"plot: {path}")
        if out["table"]:
            print(out["table"])
        return 0
    module = COMMANDS[args.canonical]
    exp_dir = args.exp_dir or (Path(args.exp_name) if args.exp_name else DEFAULT_ROOT / f"{args.canonical}-scaling")
    sweep = module.build_sweep(args)
    sweep.driver_options = driver_options(args)
    session = None
    if args.launcher == "slurm":
        options = slurm.SlurmOptions(
            net_ifname=args.net_ifname, db_port=args.db_port or slurm.DEFAULT_DB_PORT,
            db_hosts=tuple(args.db_hosts or ()), srun_mpi=args.srun_mpi or slurm.SlurmOptions.srun_mpi)
        try:
            slurm.check_environment(options, colocated=sweep.colocated)
        except slurm.SlurmSetupError as exc:
            raise SystemExit(f"error: {exc}") from None
        # the database's CPUs are a property of each deployment, as its shard count is
        sweep.deployments = [{**d, "db_cpus": c} for d in sweep.deployments
                             for c in args.db_cpus or [slurm.DEFAULT_DB_CPUS]]
        os.environ["PYTHONPATH"] = slurm.ranks_python_path(os.environ.get("PYTHONPATH"))
        session = slurm.SlurmSession(exp_dir, options)
    rows = run_sweep(sweep, exp_dir, args.address, args.launcher, args.mpirun, args.timeout,
                     report=_log_row(module.TABLE), slurm=session)
    print(f"\n{args.canonical}: {len(rows)} runs in {exp_dir}")
    print(format_table([significant(r) for r in rows], module.TABLE))
    write_json(args.json or exp_dir / "summary.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
