"""Command-line options in the SmartSim-Scaling driver's syntax as well as argparse's.

``--tensor_bytes 1024 8192``, ``--tensor_bytes 1024,8192``, ``--tensor_bytes [1024,8192]`` and
``--tensor_bytes=[1024,8192]`` (Fire's syntax, as the driver's batch scripts write it) all mean the
same; booleans take ``--flag``, ``--flag=True`` or ``--flag=False``. The driver's options that
describe a batch system (database hosts, CPUs per shard, network interface, ...) are accepted so that
its command lines run unchanged, and reported as not applying on one machine.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("benchmarks.smartsim_scaling")

#: the driver's options that describe its batch system; accepted, recorded, not used here
# Outputs of the benchmark's classifier models (ImageNet's classes, as SmartSim-Scaling's ResNet-50).
NUM_CLASSES = 1000

DRIVER_ONLY = {
    "run_db_as_batch": "run the database as a separate batch submission",
    "batch_args": "additional batch arguments for the database",
    "db_hosts": "hosts to launch the database on",
    "db_cpus": "CPUs per database host",
    "db_tpq": "device threads per queue of the database",
    "db_port": "port of the database (a free loopback port is used)",
    "net_ifname": "network interface of the database",
    "pin_app_cpus": "pin the application's threads",
    "num_devices": "devices per compute node",
    "rebuild_model": "rebuild the model file (models are built from code each run)",
}
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
    """``local`` or ``mpi``; the driver's ``auto`` is ``local``."""
    value = text.lower()
    if value in ("local", "auto"):
        return "local"
    if value == "mpi":
        return "mpi"
    raise argparse.ArgumentTypeError(
        f"launcher {text!r} is not one of local, mpi, auto: for a batch system, use --launcher mpi with its "
        "launch command, e.g. --mpirun 'srun --mpi=pmix'"
    )


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
    """The driver's batch-system options, accepted with any value (see :data:`DRIVER_ONLY`)."""
    group = parser.add_argument_group("SmartSim-Scaling driver options that do not apply on one machine "
                                      "(accepted, recorded in run.json, not used)")
    for name in names:
        group.add_argument(f"--{name}", nargs="+", default=None, metavar="VALUE", help=DRIVER_ONLY[name])


def driver_options(args: argparse.Namespace) -> dict[str, str]:
    """The driver-only options given, as text; a warning names them."""
    given = {name: " ".join(getattr(args, name)) for name in DRIVER_ONLY if getattr(args, name, None)}
    if given:
        log.warning("not used on one machine (SmartSim-Scaling batch options): %s",
                    ", ".join(f"--{k}={v}" for k, v in given.items()))
    return given


def tensor_bytes(values: list[int]) -> list[int]:
    """``--tensor_bytes`` checked: float32 tensors need positive multiples of 4."""
    bad = [b for b in values if b <= 0 or b % 4]
    if bad:
        raise SystemExit(f"--tensor_bytes must be positive multiples of 4 (float32), got {bad}")
    return values
