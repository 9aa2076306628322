"""Command-line list options in the seed driver's spirit: ``--tensor_bytes 1024 8192``,
``--tensor_bytes 1024,8192`` and ``--tensor_bytes [1024,8192]`` (Fire's syntax) all mean the same."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """``1024``, ``1024,8192`` or ``[1024, 8192]`` as a list of ints."""
    try:
        return [int(part) for part in text.strip("[]").replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4 or [1,2,4], got {text!r}") from None


class _Flatten(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for item in values for v in item])


def add_int_list(parser: argparse.ArgumentParser, name: str, *, default: list[int], help: str) -> None:
    """An option taking one or more integers; each value of the list is one permutation."""
    parser.add_argument(name, type=int_list, nargs="+", action=_Flatten, default=default, metavar="N", help=help)


def tensor_bytes(values: list[int]) -> list[int]:
    """``--tensor_bytes`` checked: float32 tensors need positive multiples of 4."""
    bad = [b for b in values if b <= 0 or b % 4]
    if bad:
        raise SystemExit(f"--tensor_bytes must be positive multiples of 4 (float32), got {bad}")
    return values
