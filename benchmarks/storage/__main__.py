"""``python -m benchmarks.storage fio|au``: storage profiles with fio, and checkpoint AU per plugin."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from dataflux_ckpt.emulator import configure_gcsfs_for_emulator

configure_gcsfs_for_emulator()  # before anything imports gcsfs

from benchmarks.storage import au, fio  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The runner's parser, one subcommand per benchmark."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.storage", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in (("fio", fio), ("au", au)):
        sub = commands.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen benchmark; the process exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.main(args)


if __name__ == "__main__":
    sys.exit(main())
