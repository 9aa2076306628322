"""Where the smartredis_io Redis module is: the shared object that ``redis-server --loadmodule`` takes.

The module serves RedisAI's commands (``AI.TENSORSET``, ``AI.MODELSTORE``, ``AI.MODELEXECUTE``...)
over smartredis_io's storage, so that SmartRedis clients in C, C++, Fortran and Python share the
database with ``smartredis_io``. The launchers (``RedisServer``, ``RedisCluster``, ``Orchestrator``)
load it by themselves; for a redis-server of your own::

    redis-server --loadmodule "$(python -m smartredis_io.redis_module)"

The module starts its execution workers with the Python installation that holds it (a wheel's), or
with the one a source checkout recorded when it built the module in place; elsewhere (a copy of the
module, or a server whose workers should use another environment) ``--args`` prints the module
arguments that name this interpreter, and ``--conf`` a whole ``loadmodule`` line for ``redis.conf``::

    redis-server --loadmodule "$(python -m smartredis_io.redis_module)" $(python -m smartredis_io.redis_module --args)
    python -m smartredis_io.redis_module --conf >> redis.conf

Wheels carry the module; a source checkout builds it with ``make setup`` (or
``python smartredis_io/redisai/build.py``). ``$SRIO_REDIS_MODULE`` names another build.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["MODULE_ENV", "RedisModuleNotFoundError", "module_args", "module_path"]

#: names a module file to use instead of the one shipped with the package
MODULE_ENV = "SRIO_REDIS_MODULE"
MODULE_FILE = "srio_redisai.so"
BUILD_HINT = (
    "Wheels of lightning-storage-plugins carry it; in a source checkout build it with `make setup` "
    "(or `python smartredis_io/redisai/build.py`: a C compiler and one download of redismodule.h), "
    f"or set ${MODULE_ENV} to a built module."
)


class RedisModuleNotFoundError(FileNotFoundError):
    """The smartredis_io Redis module is not where it should be (not built, or a wrong ``$SRIO_REDIS_MODULE``)."""


def module_path() -> str:
    """The absolute path of the smartredis_io Redis module, for ``redis-server --loadmodule``.

    ``$SRIO_REDIS_MODULE`` when set, else the module inside this package.

    Raises:
        RedisModuleNotFoundError: no module file there, with how to build it.
    """
    configured = os.environ.get(MODULE_ENV)
    path = Path(configured) if configured else Path(__file__).resolve().parents[1] / "redisai" / MODULE_FILE
    if not path.is_file():
        origin = f"${MODULE_ENV} names {str(path)!r}" if configured else f"{str(path)!r} does not exist"
        raise RedisModuleNotFoundError(f"The smartredis_io Redis module is missing: {origin}, which is not a file. {BUILD_HINT}")
    return str(path.resolve())


def module_args(python: str | None = None) -> list[str]:
    """The module arguments that make its workers run with ``python`` (default: this interpreter).

    Args:
        python: the interpreter, as it should be started (a virtual environment's own ``bin/python``).

    Raises:
        ValueError: ``python`` is not an absolute path, or holds a control character (the module refuses it).
    """
    python = python or sys.executable
    if not os.path.isabs(python) or not python.isprintable():
        raise ValueError(f"the workers' interpreter must be an absolute path without control characters: {python!r}")
    return ["WORKER_PYTHON", python]


def _conf_token(token: str) -> str:
    """A token of redis.conf, quoted so that spaces and quotes survive."""
    return '"' + token.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main(argv: list[str] | None = None) -> int:
    """Print the module's path (exit status 1, and why on stderr, when it is missing); with ``--args``,
    the module arguments naming this interpreter for the workers; with ``--conf``, a ``loadmodule`` line."""
    parser = argparse.ArgumentParser(
        prog="python -m smartredis_io.redis_module",
        description="Print the path of the smartredis_io Redis module, for redis-server --loadmodule.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--args", action="store_true",
                      help="print the module arguments that make its workers run with this interpreter "
                           "(WORKER_PYTHON PATH), to follow the path on a redis-server command line")
    what.add_argument("--conf", action="store_true",
                      help="print a redis.conf line loading the module, its workers run with this interpreter")
    args = parser.parse_args(argv)
    try:
        path = module_path()
        extra = module_args() if args.args or args.conf else []
    except (RedisModuleNotFoundError, ValueError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    if args.args and any(c.isspace() for c in extra[1]):
        sys.stderr.write(f"{extra[1]!r} holds a space, which a command line would split: use --conf\n")
        return 1
    if args.args:
        sys.stdout.write(" ".join(extra) + "\n")
    elif args.conf:
        sys.stdout.write("loadmodule " + " ".join(_conf_token(token) for token in (path, *extra)) + "\n")
    else:
        sys.stdout.write(f"{path}\n")
    return 0

