"""Where the smartredis_io Redis module is: the shared object that ``redis-server --loadmodule`` takes.

The module serves RedisAI's commands (``AI.TENSORSET``, ``AI.MODELSTORE``, ``AI.MODELEXECUTE``...)
over smartredis_io's storage, so that SmartRedis clients in C, C++, Fortran and Python share the
database with ``smartredis_io``. The launchers (``RedisServer``, ``RedisCluster``, ``Orchestrator``)
load it by themselves; for a redis-server of your own::

    redis-server --loadmodule "$(python -m smartredis_io.redis_module)"

Wheels carry the module; a source checkout builds it with ``make setup`` (or
``python smartredis_io/redisai/build.py``). ``$SRIO_REDIS_MODULE`` names another build.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["MODULE_ENV", "RedisModuleNotFoundError", "module_path"]

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


def main(argv: list[str] | None = None) -> int:
    """Print the module's path (exit status 1, and why on stderr, when it is missing)."""
    parser = argparse.ArgumentParser(
        prog="python -m smartredis_io.redis_module",
        description="Print the path of the smartredis_io Redis module, for redis-server --loadmodule.",
    )
    parser.parse_args(argv)
    try:
        path = module_path()
    except RedisModuleNotFoundError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    sys.stdout.write(f"{path}\n")
    return 0

