"""Command-line options in the SmartSim-Scaling driver's syntax as well as argparse's.

``--tensor_bytes 1024 8192``, ``--tensor_bytes 1024,8192``, ``--tensor_bytes [1024,8192]`` and
``--tensor_bytes=[1024,8192]`` (Fire's syntax, as the driver's batch scripts write it) all mean the
same; booleans take ``--flag``, ``--flag=True`` or ``--flag=False``. The driver's options that place
the database on a batch system's nodes (``--db_hosts``, ``--db_cpus``, ``--db_port``, ``--net_ifname``)
apply with ``--launcher slurm``; with the other launchers, and for the driver's options that apply to none
(``--run_db_as_batch``, ``--num_devices``, ...), they are accepted so that its command lines run
unchanged, recorded, and reported as not used.
"""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("benchmarks.smartsim_scaling")

# Outputs of the benchmark's classifier models (ImageNet's classes, as SmartSim-Scaling's ResNet-50).
NUM_CLASSES = 1000

#: the driver's options that apply to no launcher here; accepted, recorded, not used
DRIVER_ONLY = {
    "run_db_as_batch": "run the database as a separate batch submission (with --launcher slurm it runs in "
                       "the allocation of this command)",
    "batch_args": "additional batch arguments for the database",
    "db_tpq": "device threads per queue of the database (the module's workers are --workers)",
    "pin_app_cpus": "pin the application's threads",
    "num_devices": "devices per compute node",
    "rebuild_model": "rebuild the model file (models are built from code each run)",
}
#: the driver's options that place the database on the nodes of an allocation: --launcher slurm only
SLURM_ONLY = ("db_hosts", "db_cpus", "db_port", "net_ifname", "srun_mpi")
#: the driver's command names, and the command each runs here
COMMAND_ALIASES = {
    "throughput_scaling": "throughput",
    "inference_standard": "inference",
    "inference_colocated": "inference",
    "aggregation_scaling": "aggregation",
    "aggregation-scaling": "aggregation",
    "process_scaling_results": "process_results",
}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def int_list(text: str) -> list[int]:
    """``1024``, ``1024,8192`` or ``[1024, 8192]`` as a list of ints."""
    try:
        return [int(part) for part in text.strip("[]").replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4 or [1,2,4], got {text!r}") from None


def boolean(text: str) -> bool:
    """``True``/``False`` (Fire's spelling), ``1``/``0``, ``yes``/``no``."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def device(text: str) -> str:
    """The driver's ``GPU``/``CPU`` or this project's ``cuda``/``cpu``, as ``cuda`` or ``cpu``."""
    value = text.lower()
    if value in ("gpu", "cuda"):
        return "cuda"
    if value == "cpu":
        return "cpu"
    raise argparse.ArgumentTypeError(f"expected CPU or GPU, got {text!r}")


def launcher(text: str) -> str:
    """``local``, ``mpi`` or ``slurm``; the driver's ``auto`` is ``slurm`` inside a Slurm allocation, else ``local``."""
    value = text.lower()
    if value == "auto":
        return "slurm" if os.environ.get("SLURM_JOB_ID") else "local"
    if value in ("local", "mpi", "slurm"):
        return value
    raise argparse.ArgumentTypeError(
        f"launcher {text!r} is not one of local, mpi, slurm, auto: for another batch system, use --launcher mpi "
        "with its launch command, e.g. --mpirun 'mpiexec -n'"
    )


def str_list(text: str) -> list[str]:
    """``a``, ``a,b`` or ``[a, b]`` as a list of strings."""
    return [part for part in text.strip("[]").replace(" ", "").split(",") if part]


class _Flatten(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for item in values for v in item])


def add_int_list(parser: argparse.ArgumentParser, *names: str, default: list[int] | None, help: str) -> None:
    """An option taking one or more integers; each value of the list is one permutation."""
    parser.add_argument(*names, type=int_list, nargs="+", action=_Flatten, default=default, metavar="N", help=help)


def add_boolean(parser: argparse.ArgumentParser, name: str, *, default: bool, help: str) -> None:
    """A flag that also takes Fire's ``--flag=True`` / ``--flag=False``."""
    parser.add_argument(name, type=boolean, nargs="?", const=True, default=default, metavar="BOOL", help=help)


def add_driver_options(parser: argparse.ArgumentParser, names: tuple[str, ...] = tuple(DRIVER_ONLY)) -> None:
    """The driver's batch-system options: those of :data:`SLURM_ONLY`, and those of :data:`DRIVER_ONLY`
    accepted with any value."""
    group = parser.add_argument_group(
        "the database on the nodes of a Slurm allocation (--launcher slurm; recorded in run.json and not used "
        "with the other launchers)")
    group.add_argument("--db_hosts", type=str_list, nargs="+", action=_Flatten, default=None, metavar="HOST",
                       help="nodes to start the database on; default: Slurm places it in the allocation")
    add_int_list(group, "--db_cpus", default=None,
                 help="CPUs of each database shard (or colocated database); each value is one permutation; "
                      "default: 2")
    group.add_argument("--db_port", type=int, default=None,
                       help="port of every shard (and of a colocated database); default: 6780, SmartSim-Scaling's")
    group.add_argument("--net_ifname", default=None,
                       help="network interface the database's nodes listen on (ib0, hsn0, eth0...); needed by "
                            "the standard deployment")
    group.add_argument("--srun_mpi", default=None,
                       help="srun's --mpi for the client ranks (mpi4py); 'none' leaves Slurm's MpiDefault; "
                            "default: pmix")
    group = parser.add_argument_group("SmartSim-Scaling driver options that apply to no launcher here "
                                      "(accepted, recorded in run.json, not used)")
    for name in names:
        group.add_argument(f"--{name}", nargs="+", default=None, metavar="VALUE", help=DRIVER_ONLY[name])


def _text(value: object) -> str:
    return " ".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else str(value)


def driver_options(args: argparse.Namespace) -> dict[str, str]:
    """The driver's options given that this run does not use, as text; a warning names them."""
    names = list(DRIVER_ONLY) + ([] if getattr(args, "launcher", None) == "slurm" else list(SLURM_ONLY))
    given = {name: _text(getattr(args, name)) for name in names if getattr(args, name, None) is not None}
    if given:
        log.warning("not used here (SmartSim-Scaling batch options): %s",
                    ", ".join(f"--{k}={v}" for k, v in given.items()))
    return given


def tensor_bytes(values: list[int]) -> list[int]:
    """``--tensor_bytes`` checked: float32 tensors need positive multiples of 4."""
    bad = [b for b in values if b <= 0 or b % 4]
    if bad:
        raise SystemExit(f"--tensor_bytes must be positive multiples of 4 (float32), got {bad}")
    return values
