"""Build the Redis module (``srio_redisai.so``) from the C sources next to this file.

Used by the Makefile (``make setup``) and by the wheel's build step (``setup.py``); not installed.
The module API header, ``redismodule.h``, is in the repository: Redis 7.0's, as release 2.0.7 of the
``redis-module`` crate ships it (SHA-256 ``REDISMODULE_H_SHA256``), so the build needs a C compiler
and nothing from the network. Warnings are errors. A build is skipped when its output is newer than
every input and was made by the same command (``$CC``, ``$CFLAGS`` and this script's flags), so
running this again costs nothing.

``--sanitize`` builds the AddressSanitizer and UndefinedBehaviorSanitizer variant the tests load
(``SANITIZED_OUT``): it allocates from the C library, where AddressSanitizer sees every access, and
loads only into a redis-server started with the sanitizers' runtimes preloaded
(``tests/support/srio_sanitizers.py``).

``--python PATH`` records the interpreter the module's workers run with when nothing else names one
(no ``WORKER_PYTHON``, and the module sits in no site-packages directory): a source checkout's
environment, for the module built in place (``make module`` passes the checkout's ``.venv``). A
build in place that names none keeps the one recorded before, so that ``pip install -e .``, which
builds in place from whichever environment runs it, leaves it; ``--python ''`` records none. A build
with ``--out`` (a wheel's) records only what it is given: installed code never refers to a checkout.

    python smartredis_io/redisai/build.py [--out PATH] [--force] [--sanitize] [--python PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
HEADER = HERE / "redismodule.h"
REDISMODULE_H_SHA256 = "ea04fbcaba1462afbfc168480c70118c0a94a896b7b94682dbb6df31399b1c70"
MODULE_NAME = "srio_redisai.so"
SANITIZED_OUT = ROOT / ".tools" / "sanitize" / MODULE_NAME
CFLAGS = ["-O2", "-g", "-std=gnu11", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror",
          "-Wno-unused-parameter"]
# GCC's format-truncation analysis takes UBSan's own null check of a format argument for a null
# format: the warning is left to the release build, which compiles the same sources.
SANITIZE_CFLAGS = ["-O1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-DSRIO_SANITIZE",
                   "-Wno-format-truncation"]
LDFLAGS = ["-shared"]
PYTHON_DEFINE = "-DSRIO_BUILD_PYTHON="


def sources() -> list[Path]:
    """The module's C sources, in a stable order."""
    return sorted(HERE.glob("*.c"))


def command(out: Path, *, sanitize: bool = False, python: str | None = None) -> list[str]:
    """The compiler command that builds the module into ``out`` (``$CC``, default ``cc``, and ``$CFLAGS``),
    recording ``python`` as the workers' interpreter when given.

    Raises:
        ValueError: ``python`` is not an absolute path, or holds a quote, a backslash or a control character.
    """
    cc = shlex.split(os.environ.get("CC", "cc"))
    # Debug information names sources relative to these directories, so a module built in a checkout
    # or a build directory carries no path of that machine into a wheel.
    prefix_maps = [f"-ffile-prefix-map={where}=." for where in (ROOT, Path.cwd())]
    flags = [*CFLAGS, *(SANITIZE_CFLAGS if sanitize else [])]
    if python:
        if not os.path.isabs(python) or any(c in python for c in '"\\') or not python.isprintable():
            raise ValueError(f"--python {python!r}: an absolute path without quotes, backslashes or control characters")
        flags.append(f'{PYTHON_DEFINE}"{python}"')
    return [*cc, *flags, *prefix_maps, *shlex.split(os.environ.get("CFLAGS", "")), "-I", str(HERE),
            *map(str, sources()), *LDFLAGS, *(["-fsanitize=address,undefined"] if sanitize else []), "-o", str(out)]


def _stamp(out: Path) -> Path:
    """Where the command that built ``out`` is kept, to rebuild when it changes."""
    return out.with_name(f"{out.name}.flags")


def recorded_python(out: Path) -> str | None:
    """The interpreter the build of ``out`` recorded (from its stamp), or None."""
    stamp = _stamp(out)
    if not stamp.is_file():
        return None
    for arg in shlex.split(stamp.read_text()):
        if arg.startswith(PYTHON_DEFINE):
            return arg[len(PYTHON_DEFINE):].strip('"')
    return None


def _up_to_date(out: Path, cmd: list[str]) -> bool:
    inputs = [*sources(), *HERE.glob("*.h"), Path(__file__)]
    stamp = _stamp(out)
    return (out.is_file() and stamp.is_file() and stamp.read_text() == shlex.join(cmd)
            and out.stat().st_mtime >= max(p.stat().st_mtime for p in inputs))


def check_header() -> Path:
    """``redismodule.h``, checked against its pinned SHA-256."""
    digest = hashlib.sha256(HEADER.read_bytes()).hexdigest()
    if digest != REDISMODULE_H_SHA256:
        raise SystemExit(f"{HEADER}: SHA-256 {digest}, expected {REDISMODULE_H_SHA256} (the pinned Redis 7.0 API)")
    return HEADER


def build(out: Path | None = None, *, force: bool = False, sanitize: bool = False, python: str | None = None,
          stamp: bool = True) -> Path:
    """Compile the module into ``out`` (default: next to the sources, or ``SANITIZED_OUT`` with
    ``sanitize``) unless it is up to date.

    Args:
        out: where to write it; None: in place (or ``SANITIZED_OUT``).
        force: compile even when it is up to date.
        sanitize: the AddressSanitizer + UndefinedBehaviorSanitizer build.
        python: the interpreter to record for the workers (see the module's docstring); None: the one
            recorded before, for a build in place, else none; ``""``: none.
        stamp: leave the stamp that lets the next build of ``out`` be skipped (a wheel's build does
            not: the stamp names the paths of the machine that built it).

    Raises:
        ValueError: ``python`` cannot be recorded (see :func:`command`).
        SystemExit: ``redismodule.h`` is not the pinned one.
        subprocess.CalledProcessError: the compiler failed.
    """
    in_place = out is None
    out = Path(out) if out else SANITIZED_OUT if sanitize else HERE / MODULE_NAME
    check_header()
    if python is None and in_place:
        python = recorded_python(out)
    cmd = command(out, sanitize=sanitize, python=python)
    if not force and _up_to_date(out, cmd):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    compile_cmd = [*cmd[:-1], str(tmp)]
    print(">> " + shlex.join(compile_cmd), file=sys.stderr)
    try:
        subprocess.run(compile_cmd, check=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    if stamp:
        _stamp(out).write_text(shlex.join(cmd))
    else:
        _stamp(out).unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the module (default: {HERE / MODULE_NAME}, or {SANITIZED_OUT} with --sanitize)")
    parser.add_argument("--force", action="store_true", help="compile even when the module is up to date")
    parser.add_argument("--sanitize", action="store_true",
                        help="build the AddressSanitizer + UndefinedBehaviorSanitizer variant (tests only)")
    parser.add_argument("--python", default=None,
                        help="record this interpreter for the module's workers when nothing else names one (a "
                             "checkout's environment; a build in place keeps the one recorded before; '' records none)")
    args = parser.parse_args(argv)
    try:
        print(build(args.out, force=args.force, sanitize=args.sanitize, python=args.python))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
