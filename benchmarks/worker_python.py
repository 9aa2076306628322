"""A redis-server whose Redis-module workers can run this checkout's Python, for runs as root.

A redis-server running as root starts the smartredis_io module's execution workers as
``WORKER_USER`` (:data:`WORKER_USER` here), dropping privileges before the interpreter starts, so
that user must be able to run the interpreter and read its installation. Where this environment's
Python lives under a directory only root may search (a pyenv under ``/root``, as on the project's
test machines), the workers cannot start. :func:`redis_server_reaching_python` then writes a
redis-server command that lets them, without opening that directory to anyone: a script that starts
redis-server in a mount namespace of its own, where that directory is an empty one everyone may
search, holding only the entries on the way to the Python installation and to the checkout.

Checkout-only, for the benchmark runners and the test suite, which put it in ``$REDIS_SERVER_BIN``
(the launchers, SmartSim's layout and the tests' own servers start redis-server through it). A
user's installation needs none of it: README's SmartRedis section says what a root redis-server
needs.

``python -m benchmarks.worker_python`` prints the redis-server to run (the script where one is
needed, else redis-server itself), for ``python -m smartredis_io.smartsim_setup DIR --redis-server``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

#: who the module's workers run as when the runner (or the test session) runs as root: the module refuses root
WORKER_USER = "nobody"
CHECKOUT = Path(__file__).resolve().parents[1]
REACHING_SCRIPT = CHECKOUT / ".tools" / "srio" / "redis-server-reaching-python"


def hidden_by(path: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """The first directory on ``path`` (links resolved) that other users may not search, and the entry
    of it the path goes through; None when others may search every directory on it."""
    parts = Path(os.path.realpath(path)).parts
    for depth in range(1, len(parts) - 1):
        directory = Path(*parts[:depth])
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return directory, parts[depth]
    return None


def redis_server_reaching_python() -> str | None:
    """A redis-server command in which the Redis module's workers, run as :data:`WORKER_USER`, can
    run this environment's Python; None when they can anyway (not run as root, or a Python every
    user may run), or when no redis-server or ``unshare`` is found (the launchers then name what is
    missing, or the module names the directory its workers may not search).

    The command is :data:`REACHING_SCRIPT`, written again at each call, which starts
    ``$REDIS_SERVER_BIN`` (else PATH's redis-server) in a mount namespace of its own: each directory
    only root may search on the way to ``sys.base_prefix``, ``sys.prefix`` and the checkout is, in
    there, a tmpfs everyone may search holding only the entries on those ways.
    """
    if os.geteuid() != 0:
        return None
    hidden: dict[Path, set[str]] = {}
    for path in {sys.base_prefix, sys.prefix, str(CHECKOUT)}:
        found = hidden_by(path)
        if found:
            hidden.setdefault(found[0], set()).add(found[1])
    if not hidden:
        return None
    server = os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
    if server is None or shutil.which("unshare") is None or str(REACHING_SCRIPT) == server:
        return None
    steps = ['stage=$(mktemp -d)']
    for directory, entries in sorted(hidden.items()):
        steps += [f"mount --bind {shlex.quote(str(directory))} \"$stage\"",
                  f"mount -t tmpfs -o mode=0755,size=1m srio-reach {shlex.quote(str(directory))}"]
        for entry in sorted(entries):
            inside = shlex.quote(str(directory / entry))
            steps += [f"mkdir {inside}", f"mount --bind \"$stage\"/{shlex.quote(entry)} {inside}"]
        steps.append('umount "$stage"')
    steps += ['rmdir "$stage"', 'exec "$0" "$@"']
    script = "\n".join([
        "#!/bin/sh",
        "# Written by benchmarks/worker_python.py for a run as root: redis-server in a mount namespace of its",
        f"# own, where {WORKER_USER} (the Redis module's workers) can reach the checkout's Python.",
        f"exec unshare --mount --propagation private /bin/sh -ec {shlex.quote(chr(10).join(steps))} "
        f'{shlex.quote(server)} "$@"',
        "",
    ])
    REACHING_SCRIPT.parent.mkdir(parents=True, exist_ok=True)
    temporary = REACHING_SCRIPT.with_name(f".{REACHING_SCRIPT.name}.{os.getpid()}")
    temporary.write_text(script)
    temporary.chmod(0o755)
    os.replace(temporary, REACHING_SCRIPT)
    return str(REACHING_SCRIPT)


def start_servers_reaching_python() -> str | None:
    """Point ``$REDIS_SERVER_BIN`` at :func:`redis_server_reaching_python`'s command where one is
    needed, for the redis-servers this process (and its children) start; that command, or None."""
    command = redis_server_reaching_python()
    if command is not None:
        os.environ["REDIS_SERVER_BIN"] = command
    return command


def layout_unreached(redis_server: str | os.PathLike[str]) -> str | None:
    """Why the Redis module's workers of a database that ``redis_server`` starts as root (the script
    ``python -m smartredis_io.smartsim_setup`` lays out for SmartSim) cannot run their interpreter, and
    how to lay out one whose workers can; None when they can, or when ``redis_server`` is no such script.
    """
    if os.geteuid() != 0:
        return None
    try:
        script = Path(redis_server).read_bytes()
    except OSError:
        return None
    if os.fsencode(REACHING_SCRIPT) in script:
        return None
    python = next((token.partition("=")[2] for line in script.decode(errors="replace").splitlines()
                   if "SRIO_WORKER_PYTHON=" in line
                   for token in shlex.split(line, comments=True) if token.startswith("SRIO_WORKER_PYTHON=")), None)
    found = hidden_by(python) if python and os.path.isabs(python) else None
    if found is None:
        return None
    return (f"{redis_server} starts the Redis module's workers with {python}, which they may not run as the "
            f"unprivileged user a server started as root runs them as: others may not search {found[0]}; lay "
            "SmartSim's dependencies out again with `python -m smartredis_io.smartsim_setup DIR --worker-user "
            f'{WORKER_USER} --redis-server "$(python -m benchmarks.worker_python)"`, whose redis-server lets them')


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker_python", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    command = redis_server_reaching_python() or os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
    if command is None:
        parser.exit(1, "no redis-server: install it (apt-get install redis-server) or set $REDIS_SERVER_BIN\n")
    sys.stdout.write(f"{command}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
