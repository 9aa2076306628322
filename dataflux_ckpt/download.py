"""Parallel ranged reads into one preallocated buffer, readable while it fills.

:class:`RangedReader` is the buffer: ranges fetched on other threads, each one's crc32c taken as its
bytes arrive, reads served as soon as the bytes they touch are there. :class:`ObjectReader` fills it
from GCS: ``chunk_size`` ranged GETs, ``max_workers`` at a time on the GCS helper's transfer threads
(the object's last MiB first, as a range of its own: a torch zip archive is read from its end), so
loading overlaps with the download (``DatafluxCheckpointIO`` unpickles a checkpoint while it arrives,
with its tensors as views of the buffer). The whole object's crc32c, combined from the crc32c each
download thread takes of its range, is checked against the server's metadata by
:meth:`ObjectReader.verify` (called on close)."""

from __future__ import annotations

import bisect
import io
import logging
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

from typing_extensions import override

from dataflux_ckpt import _gcs_compat
from dataflux_ckpt.checksums import crc32c_b64, crc32c_combine, crc32c_extend
from dataflux_ckpt.errors import DataCorruptionError, DeadlineExceededError, TransferError
from dataflux_ckpt.gcs import Gcs
from dataflux_ckpt.paths import GcsPath
from dataflux_ckpt.retry import Deadline

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

READ_BLOCK_BYTES = 4 * 2**20
TAIL_BYTES = 2**20  # holds the zip directory of a torch archive of some 10,000 tensors
DEADLINE_S = 1800.0


class RangedReader(io.RawIOBase):
    """A seekable, read-only file-like over ``size`` bytes that arrive, range by range, into one
    preallocated buffer on other threads, and are read as soon as the bytes a read touches are there.

    A subclass fetches range ``index`` in :meth:`_fill`, handing each block's bytes over with
    :meth:`_receive`, and starts the fetching lanes with :meth:`_start`. Each range's crc32c is taken
    as its bytes arrive; :meth:`verify` combines them and checks the whole against ``expected_crc32c``.

    Args:
        path: the object the bytes are (errors name it).
        size: how many bytes.
        expected_crc32c: their crc32c in GCS's form (base64); ``None``: not checked.
        range_bytes: bytes per range (``None``: one range).
        tail_first: the last ``TAIL_BYTES`` are a range of their own, fetched first (a torch zip
            archive is read from its end).
        deadline: waiting for the bytes ends by it.
        buffer: where the bytes are (``size`` of them, writable); default: new memory.
    """

    def __init__(self, path: GcsPath, size: int, expected_crc32c: str | None, *, range_bytes: int | None,
                 tail_first: bool, deadline: Deadline, buffer: mmap.mmap | bytearray | None = None) -> None:
        super().__init__()
        self.path, self.size, self._expected_crc, self._deadline = path, size, expected_crc32c, deadline
        # The one copy of the bytes in memory; loaded tensors are views of it. Anonymous mmap pages
        # are zeroed lazily by the kernel, as the fetching threads first touch them, not all up
        # front by this thread as bytearray(size) would.
        if buffer is None:
            buffer = mmap.mmap(-1, size) if size else bytearray()
        self._buffer: mmap.mmap | bytearray = buffer
        self._view = memoryview(self._buffer)
        self._pos = 0
        step = range_bytes or max(size, 1)
        self._ranges = [(start, min(start + step, size)) for start in range(0, size, step)]
        if tail_first and size > 2 * TAIL_BYTES:
            # The end of the object gets a range of its own, fetched first: a torch archive's zip
            # directory is there, and a loader reads it before any record.
            cut = size - TAIL_BYTES
            self._ranges = [(start, min(end, cut)) for start, end in self._ranges if start < cut] + [(cut, size)]
        self._starts = [start for start, _ in self._ranges]
        self._arrived = [threading.Event() for _ in self._ranges]  # done, or failed
        # How many bytes from the start of each range have arrived: a reader waits only for the bytes
        # it reads, so unpickling follows the fetching instead of waiting for whole ranges.
        self._got = [0] * len(self._ranges)
        self._progress = threading.Condition()
        # Each range's crc32c, taken by its fetching thread block by block as the bytes arrive;
        # verify() combines them instead of reading the whole buffer once more at the end.
        self._range_crcs = [0] * len(self._ranges)
        self._complete = False  # every range arrived without error: reads skip the waits
        self._pending = len(self._ranges)
        self._pending_lock = threading.Lock()
        self._error: BaseException | None = None
        self._read_error: BaseException | None = None
        self._verified = False
        order = list(range(len(self._ranges)))
        if len(order) > 1 and tail_first:
            order = order[-1:] + order[:-1]
        self._abandoned = False
        # Each lane fetches the next range not yet taken until none is left.
        self._queue = iter(order)
        self._queue_lock = threading.Lock()
        self._lanes: list[Future[None]] = []

    def _start(self, submit: Callable[[Callable[[], None]], Future[None]], lanes: int) -> None:
        """Start ``lanes`` fetching lanes (at most one per range) through ``submit``."""
        self._lanes = [submit(self._lane) for _ in range(min(lanes, len(self._ranges)))]

    # Fetching --------------------------------------------------------------------------------
    def _lane(self) -> None:
        while True:
            with self._queue_lock:
                index = next(self._queue, None)
            if index is None:
                return
            self._fetch(index)

    def _describe(self, start: int, end: int) -> str:
        """What fetching bytes ``start``-``end - 1`` is, for errors."""
        return f"read of bytes {start}-{end - 1} of {self.path.uri}"

    def _fill(self, index: int, what: str) -> None:
        """Fetch range ``index`` into the buffer through :meth:`_receive`."""
        raise NotImplementedError

    def _failure(self, exc: BaseException, what: str) -> BaseException:
        """The error a read reports for ``exc``, which ended fetching ``what``."""
        return exc

    def _ended_early(self, what: str, got: int, total: int) -> BaseException:
        """The error for a source that ended after ``got`` of a range's ``total`` bytes."""
        return EOFError(f"{what}: the source ended after {got} of {total} bytes")

    def _fetch(self, index: int) -> None:
        start, end = self._ranges[index]
        what = self._describe(start, end)
        try:
            if self._error is None and not self._abandoned:
                self._fill(index, what)
        except BaseException as exc:
            self._error = self._failure(exc, what)
            for event in self._arrived:
                event.set()
        finally:
            self._arrived[index].set()
            with self._pending_lock:
                self._pending -= 1
                self._complete = self._pending == 0 and self._error is None
            with self._progress:
                self._progress.notify_all()

    def _receive(self, index: int, readinto: Callable[[memoryview, int], int], what: str) -> None:
        """Fill range ``index`` block by block: ``readinto(block, offset)`` puts the bytes from
        ``offset`` into ``block`` and returns how many (0: the source has ended)."""
        start, end = self._ranges[index]
        target = self._view[start:end]
        got = crc = 0
        while got < end - start:
            self._deadline.check(what)
            block = target[got : got + READ_BLOCK_BYTES]
            n = readinto(block, start + got)
            if not n:
                raise self._ended_early(what, got, end - start)
            crc = crc32c_extend(crc, block[:n])  # while the bytes are still in the CPU's cache
            got += n
            # A retry writes the same bytes again: what arrived stays valid.
            if got > self._got[index]:
                with self._progress:
                    self._got[index] = got
                    self._progress.notify_all()
        self._range_crcs[index] = crc

    def _wait(self, start: int, end: int) -> None:
        if self._complete or end <= start:
            return
        for index in range(bisect.bisect_right(self._starts, start) - 1, bisect.bisect_left(self._starts, end)):
            range_start, range_end = self._ranges[index]
            need = min(end, range_end) - range_start
            if self._got[index] >= need:
                continue
            with self._progress:
                while self._got[index] < need and not self._arrived[index].is_set():
                    # Requests end by the deadline on their own; the grace covers a last backoff.
                    if not self._progress.wait(max(self._deadline.remaining(), 0) + 1.0):
                        raise self._deadline.exceeded(f"waiting for bytes {start}-{end - 1}")
        if self._error is not None:
            raise self._error

    def raise_if_failed(self) -> None:
        """Raise the error a read met (a failed fetch, the deadline), if any.

        A reader's errors reach a caller that reads through ``torch.load`` disguised (torch's zip
        reader reports a failed read as a missing ``read`` attribute); this gives the real one.
        """
        error = self._read_error or self._error
        if error is not None:
            raise error

    def wait_all(self) -> None:
        """Block until every range has arrived (and raise if one failed)."""
        for event in self._arrived:
            # Requests end by the deadline on their own; the grace covers a last backoff.
            if not event.wait(max(self._deadline.remaining(), 0) + 1.0):
                raise self._deadline.exceeded(f"waiting for the bytes of {self.path.uri}")
        if self._error is not None:
            raise self._error

    def _crc32c(self) -> str:
        """The crc32c of the bytes that arrived (every range must have), in GCS's form."""
        crc = 0
        for (start, end), range_crc in zip(self._ranges, self._range_crcs, strict=True):
            crc = crc32c_combine(crc, range_crc, end - start)
        return crc32c_b64(crc)

    def _mismatch(self, actual: str) -> str:
        """The message of a crc32c mismatch: the bytes have ``actual``, not the expected one."""
        return f"{self.path}: the bytes read have crc32c {actual}, expected {self._expected_crc}"

    def verify(self) -> None:
        """Wait for every byte and check the whole's crc32c against the expected one (if any)."""
        if self._verified:
            return
        self.wait_all()
        if self._expected_crc is not None and (actual := self._crc32c()) != self._expected_crc:
            raise DataCorruptionError(self._mismatch(actual))
        self._verified = True

    def pread(self, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes from ``offset`` (fewer at the end), once they have arrived, as
        ``os.pread``: the position does not move.

        Raises:
            DeadlineExceededError / TransferError: the bytes did not arrive.
        """
        if self.closed:
            raise ValueError(f"read from a closed reader for {self.path}")
        start = min(max(offset, 0), self.size)
        end = min(start + max(size, 0), self.size)
        self._wait(start, end)
        return bytes(self._view[start:end])

    def untyped_storage(self) -> torch.UntypedStorage:
        """All the bytes as one torch storage over this reader's buffer (no copy).

        Only the bytes that have arrived are valid (see :meth:`pread`, :meth:`verify`). Slices of it
        are views: tensors built on them keep the buffer alive after :meth:`close`, as long as they live.
        """
        import torch  # the reader itself serves torch-less users too

        if self.closed:
            raise ValueError(f"storage of a closed reader for {self.path}")
        if not self.size:
            return torch.UntypedStorage(0)
        return torch.frombuffer(self._buffer, dtype=torch.uint8).untyped_storage()

    def getbuffer(self) -> memoryview:
        """The verified bytes (no copy)."""
        self.verify()
        return self._view.toreadonly()

    # io.RawIOBase ----------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        # torch.load seeks before every read of a record: this is a hot path.
        if whence == io.SEEK_SET:
            base = 0
        elif whence == io.SEEK_CUR:
            base = self._pos
        elif whence == io.SEEK_END:
            base = self.size
        else:
            raise ValueError(f"invalid whence {whence!r}")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, target: bytearray | memoryview) -> int:  # type: ignore[override]
        """Copy the next bytes into ``target`` once they have arrived; the count (0 at the end)."""
        if self.closed:
            raise ValueError(f"read from a closed reader for {self.path}")
        start = min(self._pos, self.size)
        end = min(start + memoryview(target).nbytes, self.size)
        try:
            self._wait(start, end)
        except BaseException as exc:
            self._read_error = exc
            raise
        memoryview(target).cast("B")[: end - start] = self._view[start:end]
        self._pos = end
        return end - start

    def close(self) -> None:
        """Verify the bytes' crc32c (raising on mismatch) and release the buffer."""
        if self.closed:
            return
        try:
            if not self._abandoned and self._error is None:  # a failed fetch was reported already
                self.verify()
        finally:
            self._abandoned = True  # running lanes fetch nothing more; queued ones need not start
            # A cancelled lane counts as done only once a thread dequeues it: wait for the others only.
            started = [lane for lane in self._lanes if not lane.cancel()]
            wait(started)  # a request in flight ends by the deadline on its own
            super().close()
            self._view.release()
            self._buffer = bytearray()  # the mmap is unmapped once no view (or tensor) of it is left

    def abandon(self) -> None:
        """Stop fetching and release the buffer without checking the bytes (they are not to be used)."""
        self._abandoned = True
        self.close()

    def __del__(self) -> None:
        if "_lanes" in self.__dict__ and not self.closed:  # not when __init__ failed
            self._abandoned = True
            self.close()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._abandoned = True  # an error is already on its way out; skip the verification
        self.close()


class ObjectReader(RangedReader):
    """A seekable, read-only file-like over one GCS object generation.

    Args:
        gcs: the GCS helper to talk through.
        path: the object to read.
        chunk_size: bytes per ranged GET.
        max_workers: concurrent ranged GETs (at most ``gcs.connections``: they run on
            :meth:`Gcs.transfer_threads`); ``parallel=False`` fetches the object with one GET.
        deadline_s: waiting for the bytes (the whole download) ends by this many seconds from now.

    Raises:
        FileNotFoundError: no object at ``path`` (the message names it).
        BucketNotFoundError: the bucket does not exist.
        DeadlineExceededError: the download did not finish in time (from reads and :meth:`verify`).
        DataCorruptionError: from :meth:`verify` and ``close()``, when the bytes do not match their crc32c.
    """

    def __init__(self, gcs: Gcs, path: GcsPath, *, chunk_size: int, max_workers: int, parallel: bool = True,
                 deadline_s: float = DEADLINE_S) -> None:
        deadline = Deadline(deadline_s, "load", path.uri)
        info = gcs.stat(path, deadline)
        self._gcs, self.generation = gcs, info.generation
        super().__init__(path, info.size, info.crc32c, range_bytes=chunk_size if parallel else None,
                         tail_first=parallel, deadline=deadline)
        # Each lane fetches the next range not yet taken until none is left: ``max_workers`` GETs at a
        # time on the helper's long-lived threads, however many ranges there are.
        self._start(gcs.transfer_threads().submit, max_workers if parallel else 1)

    @override
    def _describe(self, start: int, end: int) -> str:
        return f"download of bytes {start}-{end - 1} of {self.path.uri} (bucket {self.path.bucket}, key {self.path.key})"

    @override
    def _fill(self, index: int, what: str) -> None:
        self._gcs.retry.call(lambda: self._fetch_once(index, what), what, self._deadline)

    @override
    def _failure(self, exc: BaseException, what: str) -> BaseException:
        if isinstance(exc, DeadlineExceededError):
            return exc
        error = TransferError(f"{what} failed: {exc}")
        error.__cause__ = exc
        return error

    @override
    def _ended_early(self, what: str, got: int, total: int) -> BaseException:
        return ConnectionError(f"{what}: connection closed after {got} of {total} bytes")  # retried

    @override
    def _mismatch(self, actual: str) -> str:
        return f"{self.path}: downloaded bytes have crc32c {actual}, the server says {self._expected_crc}"

    def _fetch_once(self, index: int, what: str) -> None:
        start, end = self._ranges[index]
        with self._gcs.open_range(self.path, self.generation, start, end, self._deadline) as response:
            source = _gcs_compat.raw_body_reader(response)
            self._receive(index, lambda block, offset: source.readinto(block), what)
            _gcs_compat.release_read_connection(response, source)
