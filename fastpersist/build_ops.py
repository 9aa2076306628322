"""Build DeepSpeed's ops for this environment, once, ahead of time: ``python -m fastpersist.build_ops``.

fastpersist never compiles at run time: its ``aio`` engine uses DeepSpeed's ``async_io`` op only when
it was built here (or when DeepSpeed was installed with ``DS_BUILD_AIO=1``), and falls back to the
``python`` engine with one warning otherwise. This command compiles the op (a few minutes; it needs
a C++ compiler, ninja and libaio's headers) into a directory under ``sys.prefix``, so every
environment gets its own build and reaching one through a symlink finds the same build. Running it
again skips an op that is built and loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from fastpersist import _deepspeed_compat

log = logging.getLogger("fastpersist.build_ops")
OPS = {"async_io": "AsyncIOBuilder", "gds": "GDSBuilder"}


def build(op_name: str, force: bool = False, verbose: bool = False) -> str:
    """Build ``op_name`` (``"async_io"`` or ``"gds"``) for this environment unless it loads already;
    returns the path of the built extension.

    Raises:
        RuntimeError: the op is not compatible with this machine, or its build failed.
    """
    builder_name = OPS[op_name]
    path = _deepspeed_compat.prebuilt_op_path(op_name)
    if not force:
        op, reason = _deepspeed_compat.load_op(builder_name)
        if op is not None:
            return str(getattr(op, "__file__", path))
        log.info("%s: %s", op_name, reason)
    log.info("%s: building into %s (a few minutes)", op_name, os.path.dirname(path))
    return _deepspeed_compat.build_op(builder_name, verbose=verbose)


def main(argv: list[str] | None = None) -> int:
    """Command line: build the named ops (default: async_io); exit status 1 if one failed."""
    parser = argparse.ArgumentParser(
        prog="python -m fastpersist.build_ops", description="Build DeepSpeed's ops for this environment."
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"ops to build, of {sorted(OPS)} (default: async_io)")
    parser.add_argument("--force", action="store_true", help="build again even if a build loads")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops) - set(OPS))
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {sorted(OPS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = 0
    for op_name in args.ops or ["async_io"]:
        try:
            log.info("%s: ready at %s", op_name, build(op_name, force=args.force, verbose=args.verbose))
        except Exception as err:  # report every op's outcome, then the exit status
            log.error("%s: not built: %s", op_name, err)
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
