"""Lay out what SmartSim's ``smart build`` would, with the smartredis_io Redis module in RedisAI's place.

SmartSim (0.8) finds its database through ``$SMARTSIM_DEP_INSTALL_PATH``: ``bin/*-server`` and
``bin/*-cli`` (symbolic links resolved), ``lib/redisai.so`` (loaded with ``--loadmodule``), and it
takes a RedisAI backend as installed when ``lib/backends/redisai_<name>/redisai_<name>.so`` is a
file. This command writes, in DIR::

    bin/redis-server   a script that execs the system's redis-server (not a link: SmartSim resolves
                       links, and Debian's redis-server is one to redis-check-rdb, which then runs as
                       the RDB checker), with SRIO_WORKER_PYTHON set to the interpreter that ran this
                       command, so that the module starts its workers with this environment's torch
    bin/redis-cli      a link to the system's redis-cli
    lib/redisai.so     a link to the smartredis_io module
    lib/backends/redisai_torch/redisai_torch.so
                       a marker file: the module's workers run torch models (TorchScript and
                       torch.export); TensorFlow and ONNX have none, and SmartSim skips or refuses them

and the empty ``_core/bin`` directory of the installed SmartSim package where it is missing (SmartSim
0.8 lists it for every launch's manifest whatever ``$SMARTSIM_DEP_INSTALL_PATH`` says), then prints
how to point SmartSim at it::

    python -m smartredis_io.smartsim_setup ~/smartsim-deps [--worker-user nobody]
    export SMARTSIM_DEP_INSTALL_PATH=~/smartsim-deps

Nothing is downloaded or compiled. A database SmartSim starts as root runs its models as the user
named by ``--worker-user`` (or ``$SRIO_WORKER_USER`` where the database starts), and starts no worker
without one.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from smartredis_io.launchers.redis_module import RedisModuleNotFoundError, module_path

__all__ = ["DEP_PATH_ENV", "SmartSimLayout", "lay_out"]

log = logging.getLogger(__name__)

#: the variable SmartSim reads to find its database binaries and RedisAI
DEP_PATH_ENV = "SMARTSIM_DEP_INSTALL_PATH"
#: the RedisAI backends SmartSim checks for, and the one the module's workers serve
TORCH_BACKEND = "torch"
MARKER_TEXT = (
    "Not a shared object. SmartSim takes RedisAI's torch backend as installed when this file exists;\n"
    "torch models and scripts are run by the smartredis_io Redis module's execution workers.\n"
)


@dataclass(frozen=True)
class SmartSimLayout:
    """The paths :func:`lay_out` wrote."""

    root: Path
    redis_server: Path
    redis_cli: Path
    redisai: Path
    torch_backend: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment that points SmartSim at this layout."""
        return {DEP_PATH_ENV: str(self.root)}


def _replace(path: Path, write) -> None:
    """Create ``path`` by ``write(temporary path)``, then rename it over whatever was there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if temporary.is_symlink() or temporary.exists():
            temporary.unlink()


def _server_script(redis_server: str, python: str, worker_user: str | None) -> str:
    lines = [
        "#!/bin/sh",
        "# Written by python -m smartredis_io.smartsim_setup: the system's redis-server, for SmartSim, with the",
        "# smartredis_io module's workers started by this interpreter (a variable set before overrides it).",
        f'export SRIO_WORKER_PYTHON="${{SRIO_WORKER_PYTHON:-{python}}}"',
    ]
    if worker_user:
        lines.append(f'export SRIO_WORKER_USER="${{SRIO_WORKER_USER:-{worker_user}}}"')
    lines.append(f'exec {shlex.quote(redis_server)} "$@"')
    return "\n".join(lines) + "\n"


def lay_out(directory: str | os.PathLike[str], *, python: str | None = None, redis_server: str | None = None,
            redis_cli: str | None = None, worker_user: str | None = None) -> SmartSimLayout:
    """Write SmartSim's dependency layout in ``directory`` (created if needed; our files replaced).

    Args:
        directory: what ``$SMARTSIM_DEP_INSTALL_PATH`` will name.
        python: the interpreter the module's workers run with (default: this one).
        redis_server: the redis-server to run (default: ``$REDIS_SERVER_BIN``, else ``PATH``'s).
        redis_cli: the redis-cli SmartSim uses to create clusters (default: ``$REDIS_CLI_BIN``, else ``PATH``'s).
        worker_user: the user the workers of a database started as root run as.

    Raises:
        smartredis_io.launchers.redis_module.RedisModuleNotFoundError: the module is not built.
        lightning_storage_plugins.services.MissingBinaryError: no redis-server or redis-cli.
        ValueError: a value that cannot go in the script (a quote or newline in ``python``, ``worker_user``).
    """
    # imported here: find_binary's hints live with the launchers
    from lightning_storage_plugins.services import find_binary
    from smartredis_io.launchers.server import BINARY_ENV_VAR, INSTALL_HINT

    python = python or sys.executable
    for name, value in (("python", python), ("worker_user", worker_user or "")):
        if any(c in value for c in "\"'`$\\\n"):
            raise ValueError(f"{name} {value!r} has a character the server script cannot hold")
    module = Path(module_path())
    redis_server = os.path.abspath(redis_server or find_binary("redis-server", BINARY_ENV_VAR, install_hint=INSTALL_HINT))
    redis_cli = os.path.abspath(redis_cli or find_binary("redis-cli", "REDIS_CLI_BIN", install_hint=INSTALL_HINT))
    root = Path(directory).expanduser().absolute()
    layout = SmartSimLayout(
        root=root, redis_server=root / "bin" / "redis-server", redis_cli=root / "bin" / "redis-cli",
        redisai=root / "lib" / "redisai.so",
        torch_backend=root / "lib" / "backends" / f"redisai_{TORCH_BACKEND}" / f"redisai_{TORCH_BACKEND}.so",
    )
    script = _server_script(redis_server, python, worker_user)

    def write_script(path: Path) -> None:
        path.write_text(script)
        path.chmod(0o755)

    _replace(layout.redis_server, write_script)
    _replace(layout.redis_cli, lambda path: path.symlink_to(redis_cli))
    _replace(layout.redisai, lambda path: path.symlink_to(module))
    _replace(layout.torch_backend, lambda path: path.write_text(MARKER_TEXT))
    _make_smartsim_bin_dir()
    return layout


def _make_smartsim_bin_dir() -> None:
    """Create the (empty) ``_core/bin`` directory of the installed SmartSim package, if missing.

    SmartSim 0.8 lists that directory, whatever ``$SMARTSIM_DEP_INSTALL_PATH`` says, to name the
    database type in each launch's manifest, and fails every ``Experiment.start`` of a database
    when it does not exist (``smart build`` creates it).
    """
    spec = importlib.util.find_spec("smartsim")
    if spec is None or not spec.submodule_search_locations:
        return
    bin_dir = Path(spec.submodule_search_locations[0], "_core", "bin")
    try:
        bin_dir.mkdir(exist_ok=True)
    except OSError as exc:
        log.warning("SmartSim's %s does not exist and cannot be made (%s): starting a database will fail "
                    "until it exists", bin_dir, exc.strerror)


def main(argv: list[str] | None = None) -> int:
    """The ``python -m smartredis_io.smartsim_setup DIR`` command line; the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m smartredis_io.smartsim_setup",
        description="Lay out what SmartSim's `smart build` would, with the smartredis_io Redis module in RedisAI's "
                    f"place and the system's redis-server; then set {DEP_PATH_ENV}=DIR.",
    )
    parser.add_argument("directory", metavar="DIR", help=f"where to lay it out (then {DEP_PATH_ENV}=DIR)")
    parser.add_argument("--python", default=None,
                        help="the interpreter the module's workers run with (default: this one, %(prog)s's)")
    parser.add_argument("--redis-server", default=None, help="the redis-server to run (default: $REDIS_SERVER_BIN or PATH's)")
    parser.add_argument("--redis-cli", default=None, help="the redis-cli to use (default: $REDIS_CLI_BIN or PATH's)")
    parser.add_argument("--worker-user", default=None,
                        help="the user the workers of a database started as root run models as (default: "
                             "$SRIO_WORKER_USER where the database starts; as root without one, no worker starts)")
    args = parser.parse_args(argv)
    try:
        layout = lay_out(args.directory, python=args.python, redis_server=args.redis_server,
                         redis_cli=args.redis_cli, worker_user=args.worker_user)
    except (RedisModuleNotFoundError, FileNotFoundError, ValueError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    sys.stdout.write(f"export {DEP_PATH_ENV}={shlex.quote(str(layout.root))}\n")
    return 0

