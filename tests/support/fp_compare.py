"""Deep comparison of loaded checkpoints; also run as a script to check files in a fresh process.

``python fp_compare.py LIST`` reads lines ``saved_path<TAB>reference_path`` and checks that stock
``torch.load(saved, weights_only=True)`` equals ``torch.load(reference, weights_only=True)`` for each.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes (NaN payloads compare equal to themselves)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: Any, want: Any, where: str = "obj") -> None:
    """Equal structure, types, tensor dtype/shape/stride/offset/bytes, and the same storage sharing."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    _compare(got, want, where, pairs)
    got_ids: dict[int, int] = {}
    want_ids: dict[int, int] = {}
    for index, (g, w) in enumerate(pairs):
        g_key = (
            got_ids.setdefault(g.untyped_storage().data_ptr(), index)
            if g.untyped_storage().nbytes()
            else -index - 1
        )
        w_key = (
            want_ids.setdefault(w.untyped_storage().data_ptr(), index)
            if w.untyped_storage().nbytes()
            else -index - 1
        )
        assert g_key == w_key, f"{where}: tensor #{index} storage sharing differs"


def _compare(got: Any, want: Any, where: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert type(got) is type(want), f"{where}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.stride() == want.stride(), f"{where}: stride {got.stride()} != {want.stride()}"
        assert got.storage_offset() == want.storage_offset(), f"{where}: storage offset differs"
        assert torch.equal(tensor_bytes(got), tensor_bytes(want)), f"{where}: values differ"
        pairs.append((got, want))
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            _compare(got[key], want[key], f"{where}[{key!r}]", pairs)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            _compare(g, w, f"{where}[{index}]", pairs)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def main(list_path: str) -> int:
    with open(list_path) as listing:
        cases = [line.rstrip("\n").split("\t") for line in listing if line.strip()]
    for saved, reference in cases:
        assert_same(torch.load(saved, weights_only=True), torch.load(reference, weights_only=True), saved)
    print(f"checked {len(cases)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
