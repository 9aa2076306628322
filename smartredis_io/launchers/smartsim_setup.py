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
without one; that user must be able to run the interpreter.

DIR must be the user's own and not writable by others (every process SmartSim starts runs what it
holds). Each file is written under a temporary name no one can predict, never through a link, then
renamed into place. Files this command did not write (``smart build``'s binaries, say) are left
alone: the command refuses, naming them, unless told ``--force``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import secrets
import shlex
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from smartredis_io.launchers.redis_module import RedisModuleNotFoundError, module_path

__all__ = ["DEP_PATH_ENV", "SmartSimLayout", "UnsafeLayoutError", "lay_out"]

log = logging.getLogger(__name__)

#: the variable SmartSim reads to find its database binaries and RedisAI
DEP_PATH_ENV = "SMARTSIM_DEP_INSTALL_PATH"
#: the RedisAI backends SmartSim checks for, and the one the module's workers serve
TORCH_BACKEND = "torch"
MARKER_TEXT = (
    "Not a shared object. SmartSim takes RedisAI's torch backend as installed when this file exists;\n"
    "torch models and scripts are run by the smartredis_io Redis module's execution workers.\n"
)
#: the second line of the server script: how a script of ours is recognised
SCRIPT_MARK = "# Written by python -m smartredis_io.smartsim_setup"


class UnsafeLayoutError(ValueError):
    """DIR is not safe to lay out in (another user's, or writable by others), or holds a file this
    command did not write where it would write one."""


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


def _check_directory(path: Path, *, follow: bool) -> None:
    """Refuse a directory another user owns or others may write: what SmartSim runs comes from it.

    Raises:
        UnsafeLayoutError: it is not such a directory.
    """
    info = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeLayoutError(f"{path} is not a directory (a link is not followed there)")
    if info.st_uid != os.geteuid():
        raise UnsafeLayoutError(f"{path} belongs to uid {info.st_uid}, not to this user: lay out in a directory of yours")
    if info.st_mode & stat.S_IWOTH:
        raise UnsafeLayoutError(f"{path} may be written by any user (mode {stat.S_IMODE(info.st_mode):04o}): "
                                "lay out in a directory only you may write")


def _directory(path: Path) -> Path:
    """``path``, made if missing, checked (see :func:`_check_directory`)."""
    try:
        path.mkdir(mode=0o755)
    except FileExistsError:
        pass
    _check_directory(path, follow=False)
    return path


def _is_ours(path: Path, kind: str, link_name: str = "") -> bool:
    """Whether ``path`` is missing or holds what this command writes there: its script (``kind``
    "script"), a link to a file named ``link_name`` ("link"), or the backend marker ("marker")."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return True
    if kind == "link":
        return stat.S_ISLNK(info.st_mode) and os.path.basename(os.readlink(path)) == link_name
    if not stat.S_ISREG(info.st_mode) or info.st_size > 64 * 1024:
        return False
    with open(path, "rb") as f:
        head = f.read(64 * 1024)
    if kind == "script":
        return head.startswith(b"#!/bin/sh\n" + SCRIPT_MARK.encode())
    return head == MARKER_TEXT.encode()


def _write_file(path: Path, text: str, mode: int) -> None:
    """Write ``path`` under a temporary name (unpredictable, created exclusively: never through a
    link), then rename it over whatever was there."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), mode)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _write_link(path: Path, target: str) -> None:
    """Make ``path`` a link to ``target``: made under a temporary name no one can predict, then renamed."""
    while True:
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            os.symlink(target, temporary)
            break
        except FileExistsError:
            continue
    try:
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _server_script(redis_server: str, python: str, worker_user: str | None) -> str:
    lines = [
        "#!/bin/sh",
        SCRIPT_MARK + ": the system's redis-server, for SmartSim, with the",
        "# smartredis_io module's workers started by this interpreter (a variable set before overrides it).",
        f'[ -n "${{SRIO_WORKER_PYTHON:-}}" ] || SRIO_WORKER_PYTHON={shlex.quote(python)}',
        "export SRIO_WORKER_PYTHON",
    ]
    if worker_user:
        lines += [f'[ -n "${{SRIO_WORKER_USER:-}}" ] || SRIO_WORKER_USER={shlex.quote(worker_user)}',
                  "export SRIO_WORKER_USER"]
    lines.append(f'exec {shlex.quote(redis_server)} "$@"')
    return "\n".join(lines) + "\n"


def lay_out(directory: str | os.PathLike[str], *, python: str | None = None, redis_server: str | None = None,
            redis_cli: str | None = None, worker_user: str | None = None, force: bool = False) -> SmartSimLayout:
    """Write SmartSim's dependency layout in ``directory`` (created if needed; our files replaced).

    Args:
        directory: what ``$SMARTSIM_DEP_INSTALL_PATH`` will name.
        python: the interpreter the module's workers run with (default: this one).
        redis_server: the redis-server to run (default: ``$REDIS_SERVER_BIN``, else ``PATH``'s).
        redis_cli: the redis-cli SmartSim uses to create clusters (default: ``$REDIS_CLI_BIN``, else ``PATH``'s).
        worker_user: the user the workers of a database started as root run as.
        force: replace files this command did not write (``smart build``'s, say).

    Raises:
        smartredis_io.launchers.redis_module.RedisModuleNotFoundError: the module is not built.
        lightning_storage_plugins.services.MissingBinaryError: no redis-server or redis-cli.
        UnsafeLayoutError: ``directory`` is another user's or writable by others, or (without ``force``)
            holds files this command did not write where it writes its own.
        ValueError: ``python`` is not an absolute path, or a value holds a control character (the
            module takes neither).
    """
    # imported here: find_binary's hints live with the launchers
    from lightning_storage_plugins.services import find_binary
    from smartredis_io.launchers.server import BINARY_ENV_VAR, INSTALL_HINT

    python = python or sys.executable
    if not os.path.isabs(python):
        raise ValueError(f"python {python!r} must be an absolute path: the module starts it from /")
    for name, value in (("python", python), ("worker_user", worker_user or "")):
        if not value.isprintable():
            raise ValueError(f"{name} {value!r} holds a control character, which the module refuses")
    module = Path(module_path())
    redis_server = os.path.abspath(redis_server or find_binary("redis-server", BINARY_ENV_VAR, install_hint=INSTALL_HINT))
    redis_cli = os.path.abspath(redis_cli or find_binary("redis-cli", "REDIS_CLI_BIN", install_hint=INSTALL_HINT))
    root = Path(directory).expanduser().absolute()
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    _check_directory(root, follow=True)
    layout = SmartSimLayout(
        root=root, redis_server=root / "bin" / "redis-server", redis_cli=root / "bin" / "redis-cli",
        redisai=root / "lib" / "redisai.so",
        torch_backend=root / "lib" / "backends" / f"redisai_{TORCH_BACKEND}" / f"redisai_{TORCH_BACKEND}.so",
    )
    for path in (layout.redis_server.parent, layout.redisai.parent, layout.torch_backend.parent.parent,
                 layout.torch_backend.parent):
        _directory(path)
    writes: list[tuple[Path, str, str, Callable[[Path], None]]] = [
        (layout.redis_server, "script", "",
         lambda path: _write_file(path, _server_script(redis_server, python, worker_user), 0o755)),
        (layout.redis_cli, "link", os.path.basename(redis_cli), lambda path: _write_link(path, redis_cli)),
        (layout.redisai, "link", module.name, lambda path: _write_link(path, str(module))),
        (layout.torch_backend, "marker", "", lambda path: _write_file(path, MARKER_TEXT, 0o644)),
    ]
    foreign = [str(path) for path, kind, name, _ in writes if not _is_ours(path, kind, name)]
    if foreign and not force:
        raise UnsafeLayoutError(f"{root} holds files this command did not write: {', '.join(foreign)}; move them "
                                "away, or pass --force (force=True) to replace them")
    for path, _, _, write in writes:
        write(path)
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
    parser.add_argument("--force", action="store_true",
                        help="replace files of DIR this command did not write (smart build's, say)")
    args = parser.parse_args(argv)
    try:
        layout = lay_out(args.directory, python=args.python, redis_server=args.redis_server,
                         redis_cli=args.redis_cli, worker_user=args.worker_user, force=args.force)
    except (RedisModuleNotFoundError, FileNotFoundError, ValueError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    sys.stdout.write(f"export {DEP_PATH_ENV}={shlex.quote(str(layout.root))}\n")
    return 0

