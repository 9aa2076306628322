"""The no-patch file image: torch.save's zip skeleton (``skip_data``) plus where each storage's bytes go.

``torch.save`` under :func:`torch.serialization.skip_data` writes every zip record header, the pickle and
the central directory, but seeks over the storage bytes. :class:`SparseImage` captures those writes in
memory (long zero runs, i.e. alignment padding, are kept as holes), a ``PyTorchFileReader`` over it
gives each storage record's offset, and a second pickling pass that mirrors torch's ``persistent_id``
maps record keys to the storages themselves.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import os
import pickle
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from fastpersist.handles import ALIGNMENT_BYTES

FILL_MIN_BYTES = 256  # a written run of one repeated byte at least this long is stored as a Fill
DEFAULT_PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


class Fill(NamedTuple):
    """``length`` copies of the byte ``value`` (torch pads zip records with b"Z" runs)."""

    length: int
    value: int

    def __len__(self) -> int:
        return self.length


class Hole(NamedTuple):
    """``length`` bytes torch.save seeked over: one storage record's payload, filled in later."""

    length: int

    def __len__(self) -> int:
        return self.length


Run = bytearray | Fill | Hole


def _trailing_run(data: bytes) -> int:
    """Length of the run of ``data[-1]`` bytes ending ``data`` (binary search with memcmp, not a byte loop)."""
    same = bytes(data[-1:]) * len(data)
    if data[-FILL_MIN_BYTES:] != same[-FILL_MIN_BYTES:]:
        return 0
    low, high = 0, len(data) - FILL_MIN_BYTES  # smallest start of an all-same suffix lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if data[middle:] == same[middle:]:
            high = middle
        else:
            low = middle + 1
    return len(data) - low


class SparseImage(io.RawIOBase):
    """A write-then-read, in-memory file: unwritten regions and long one-byte runs cost no memory."""

    def __init__(self) -> None:
        super().__init__()
        self.size = 0
        self._pos = 0
        self._starts: list[int] = []
        self._runs: list[Run] = []
        self._last_end = -1  # where the last write ended: a write there extends the last run

    def runs(self) -> Iterator[tuple[int, Run]]:
        """The stored (offset, run) pairs in file order; everything else reads as zeros."""
        return zip(self._starts, self._runs, strict=True)

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR and offset > 0:  # torch.save under skip_data skipping a storage payload
            self._starts.append(self._pos)
            self._runs.append(Hole(offset))
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = base + offset
        self.size = max(self.size, self._pos)
        return self._pos

    def write(self, data: Any) -> int:
        data = bytes(data)
        length = len(data)
        run = _trailing_run(data) if length >= FILL_MIN_BYTES else 0
        head = data[: length - run] if run >= FILL_MIN_BYTES else data
        if head:
            if self._pos == self._last_end and self._runs and isinstance(self._runs[-1], bytearray):
                self._runs[-1] += head
            else:
                self._starts.append(self._pos)
                self._runs.append(bytearray(head))
        if len(head) < length:
            self._starts.append(self._pos + len(head))
            self._runs.append(Fill(length - len(head), data[-1]))
        self._pos += length
        self._last_end = self._pos
        self.size = max(self.size, self._pos)
        return length

    def readinto(self, out: Any) -> int:
        out = memoryview(out).cast("B")
        length = max(0, min(len(out), self.size - self._pos))
        start, end = self._pos, self._pos + length
        out[:length] = bytes(length)
        index = max(0, bisect.bisect_right(self._starts, start) - 1)
        while index < len(self._starts) and self._starts[index] < end:
            run_start, run = self._starts[index], self._runs[index]
            lo, hi = max(start, run_start), min(end, run_start + len(run))
            if lo < hi:
                if isinstance(run, Fill):
                    out[lo - start : hi - start] = bytes((run.value,)) * (hi - lo)
                elif isinstance(run, bytearray):
                    out[lo - start : hi - start] = run[lo - run_start : hi - run_start]
            index += 1
        self._pos = end
        return length


@dataclass
class FileImage:
    """The whole file in order: skeleton runs and, in each hole, the storage's flat uint8 view."""

    size: int
    segments: list[tuple[int, bytearray | Fill | torch.Tensor]] = field(
        default_factory=list
    )  # (offset, piece)
    num_storages: int = 0


def _recording_pickle_module(found: dict[str, Any]) -> types.SimpleNamespace:
    """A ``pickle_module`` for torch.save that records each storage under the key torch gives it.

    torch.save subclasses ``pickle_module.Pickler`` to add its ``persistent_id``; the subclass hook
    wraps that method and keeps the storage behind every ``("storage", type, key, ...)`` id it returns.
    """

    class Pickler(pickle.Pickler):
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            inner = cls.persistent_id

            def persistent_id(self: pickle.Pickler, obj: Any) -> Any:
                pid = inner(self, obj)
                if (
                    pid is not None
                ):  # only storages get persistent ids: ("storage", type, key, location, numel)
                    found[pid[2]] = obj
                return pid

            cls.persistent_id = persistent_id

    return types.SimpleNamespace(__name__="pickle", Pickler=Pickler, Unpickler=pickle.Unpickler)


def storage_alignment() -> contextlib.AbstractContextManager[None]:
    """Align every record to ``ALIGNMENT_BYTES`` where this torch has the setting (>= 2.7)."""
    try:
        from torch.utils.serialization import config

        config.save.storage_alignment  # noqa: B018 - probe: raises where the setting does not exist
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
    return config.patch({"save.storage_alignment": ALIGNMENT_BYTES})


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def plan_image(obj: Any, pickle_protocol: int = DEFAULT_PICKLE_PROTOCOL) -> FileImage:
    """Lay out ``obj``'s torch.save file without copying any tensor bytes.

    Raises:
        Whatever ``torch.save`` raises for an object it cannot pickle (nothing touches the disk).
        RuntimeError: the storage records do not match the storages found (a torch change).
    """
    skeleton = SparseImage()
    found: dict[str, Any] = {}
    with storage_alignment(), torch.serialization.skip_data():
        torch.save(
            obj, skeleton, pickle_module=_recording_pickle_module(found), pickle_protocol=pickle_protocol
        )
    skeleton.seek(0)
    reader = torch._C.PyTorchFileReader(skeleton)
    records = {name for name in reader.get_all_records() if name.startswith("data/")}
    if records != {f"data/{key}" for key in found}:
        raise RuntimeError(f"torch.save wrote {len(records)} storage records, found {len(found)} storages")
    # torch writes the records in key order, seeking over each non-empty payload: hole i is storage i.
    storages = {f"data/{key}": _untyped(value) for key, value in found.items()}
    views = iter([(name, _byte_view(storage)) for name, storage in storages.items() if storage.nbytes()])
    image = FileImage(size=skeleton.size, num_storages=len(found))
    for offset, run in skeleton.runs():
        if isinstance(run, Hole):
            name, view = next(views, (None, None))
            if view is None or view.numel() != run.length or reader.get_record_offset(name) != offset:
                raise RuntimeError(
                    f"skeleton hole at {offset} ({run.length} bytes) does not match record {name}"
                )
            image.segments.append((offset, view))
        else:
            image.segments.append((offset, run))
    if next(views, None) is not None:
        raise RuntimeError("torch.save left fewer holes than there are storages")
    return image


def _untyped(obj: Any) -> torch.UntypedStorage:
    return obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
