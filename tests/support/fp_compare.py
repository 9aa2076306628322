"""Deep comparison of loaded checkpoints; also run as a script to check files in a fresh process.

``python fp_compare.py LIST`` reads lines ``saved_path<TAB>reference_path`` and checks that stock
``torch.load(saved, weights_only=True)`` equals ``torch.load(reference, weights_only=True)`` for each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
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


def assert_loads_are_writable_and_independent(save: Callable[[Any], None], load: Callable[[], Any]) -> None:
    """Two loads of what ``save`` stored give tensors that can be written, and writing those of one
    load changes nothing of the other's (views of a load's buffer must not be shared between loads)."""
    save({"a": torch.zeros(100_000), "b": torch.ones(10)})
    first, second = load(), load()
    first["a"] += 5
    first["b"].mul_(3)
    assert torch.equal(second["a"], torch.zeros(100_000)) and torch.equal(second["b"], torch.ones(10))
    assert torch.equal(first["a"], torch.full((100_000,), 5.0)) and torch.equal(first["b"], torch.full((10,), 3.0))


def assert_loads_as_torch_load(data: bytes, load: Callable[[], Any], refusals: type[BaseException] | tuple[type[BaseException], ...],
                               name: str) -> None:
    """``load()`` (a plugin's weights-only load of the stored ``data``) returns what
    ``torch.load(data, weights_only=True)`` returns, or refuses it with one of ``refusals``, which must
    name ``name``; where ``torch.load`` refuses, so must ``load``."""
    import io

    expected, refused = None, False
    try:
        expected = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal by torch.load: the plugin must refuse too
        refused = True
    try:
        got = load()
    except refusals as err:
        assert name in str(err), f"the refusal does not name {name}: {err!r}"
        return
    assert not refused, f"torch.load refuses these bytes, the plugin returned {got!r}"
    assert_same(got, expected)


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
