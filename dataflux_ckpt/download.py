"""Parallel ranged downloads into one preallocated buffer, readable while it fills.

:class:`ObjectReader` runs ``chunk_size`` ranged GETs, ``max_workers`` at a time on the GCS helper's
transfer threads (the object's last MiB first, as a range of its own: a torch zip archive is read
from its end), and serves reads as soon as the bytes they touch have arrived, so loading overlaps
with the download (``DatafluxCheckpointIO`` unpickles a checkpoint while it arrives, with its tensors
as views of the buffer). The whole object's crc32c, combined from the crc32c each download thread
takes of its range, is checked against the server's metadata by :meth:`ObjectReader.verify` (called
on close).
"""

from __future__ import annotations

import bisect
import io
import logging
import mmap
import threading
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

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


class ObjectReader(io.RawIOBase):
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
        super().__init__()
        self._gcs, self.path = gcs, path
        self._deadline = Deadline(deadline_s, "load", path.uri)
        info = gcs.stat(path, self._deadline)
        self.size, self._expected_crc, self.generation = info.size, info.crc32c, info.generation
        # The one copy of the object in memory; loaded tensors are views of it. Anonymous mmap
        # pages are zeroed lazily by the kernel, as the download threads first touch them, not all
        # up front by this thread as bytearray(size) would.
        self._buffer: mmap.mmap | bytearray = mmap.mmap(-1, info.size) if info.size else bytearray()
        self._view = memoryview(self._buffer)
        self._pos = 0
        step = chunk_size if parallel else max(info.size, 1)
        self._ranges = [(start, min(start + step, info.size)) for start in range(0, info.size, step)]
        if parallel and info.size > 2 * TAIL_BYTES:
            # The end of the object gets a range of its own, fetched first: a torch archive's zip
            # directory is there, and a loader reads it before any record.
            cut = info.size - TAIL_BYTES
            self._ranges = [(start, min(end, cut)) for start, end in self._ranges if start < cut] + [(cut, info.size)]
        self._starts = [start for start, _ in self._ranges]
        self._arrived = [threading.Event() for _ in self._ranges]  # done, or failed
        # How many bytes from the start of each range have arrived: a reader waits only for the bytes
        # it reads, so unpickling follows the download instead of waiting for whole ranges.
        self._got = [0] * len(self._ranges)
        self._progress = threading.Condition()
        # Each range's crc32c, taken by its download thread block by block as the bytes arrive;
        # verify() combines them instead of reading the whole buffer once more at the end.
        self._range_crcs = [0] * len(self._ranges)
        self._complete = False  # every range arrived without error: reads skip the waits
        self._pending = len(self._ranges)
        self._pending_lock = threading.Lock()
        self._error: BaseException | None = None
        self._read_error: BaseException | None = None
        self._verified = False
        order = list(range(len(self._ranges)))
        if len(order) > 1:
            order = order[-1:] + order[:-1]
        self._abandoned = False
        # Each lane fetches the next range not yet taken until none is left: ``max_workers`` GETs at a
        # time on the helper's long-lived threads, however many ranges there are.
        self._queue = iter(order)
        self._queue_lock = threading.Lock()
        threads = gcs.transfer_threads()
        lanes = min(max_workers if parallel else 1, len(order))
        self._lanes: list[Future[None]] = [threads.submit(self._lane) for _ in range(lanes)]

    # Download --------------------------------------------------------------------------------
    def _lane(self) -> None:
        while True:
            with self._queue_lock:
                index = next(self._queue, None)
            if index is None:
                return
            self._fetch(index)

    def _fetch(self, index: int) -> None:
        start, end = self._ranges[index]
        what = f"download of bytes {start}-{end - 1} of {self.path.uri} (bucket {self.path.bucket}, key {self.path.key})"
        try:
            if self._error is None and not self._abandoned:
                self._gcs.retry.call(lambda: self._fetch_once(index, what), what, self._deadline)
        except BaseException as exc:
            if isinstance(exc, DeadlineExceededError):
                self._error = exc
            else:
                self._error = TransferError(f"{what} failed: {exc}")
                self._error.__cause__ = exc
            for event in self._arrived:
                event.set()
        finally:
            self._arrived[index].set()
            with self._pending_lock:
                self._pending -= 1
                self._complete = self._pending == 0 and self._error is None
            with self._progress:
                self._progress.notify_all()

    def _fetch_once(self, index: int, what: str) -> None:
        start, end = self._ranges[index]
        with self._gcs.open_range(self.path, self.generation, start, end, self._deadline) as response:
            source = _gcs_compat.raw_body_reader(response)
            target = self._view[start:end]
            got = crc = 0
            while got < end - start:
                self._deadline.check(what)
                block = target[got : got + READ_BLOCK_BYTES]
                n = source.readinto(block)
                if not n:
                    raise ConnectionError(f"{what}: connection closed after {got} of {end - start} bytes")
                crc = crc32c_extend(crc, block[:n])  # while the bytes are still in the CPU's cache
                got += n
                # A retry writes the same generation's bytes again: what arrived stays valid.
                if got > self._got[index]:
                    with self._progress:
                        self._got[index] = got
                        self._progress.notify_all()
            _gcs_compat.release_read_connection(response, source)
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
        """Raise the error a read met (a failed download, the deadline), if any.

        A reader's errors reach a caller that reads through ``torch.load`` disguised (torch's zip
        reader reports a failed read as a missing ``read`` attribute); this gives the real one.
        """
        error = self._read_error or self._error
        if error is not None:
            raise error

    def wait_all(self) -> None:
        """Block until every range's download has ended (and raise if one failed)."""
        for event in self._arrived:
            # Requests end by the deadline on their own; the grace covers a last backoff.
            if not event.wait(max(self._deadline.remaining(), 0) + 1.0):
                raise self._deadline.exceeded(f"waiting for the download of {self.path.uri}")
        if self._error is not None:
            raise self._error

    def verify(self) -> None:
        """Wait for the download and check the whole object's crc32c against the server's."""
        if self._verified:
            return
        self.wait_all()
        crc = 0
        for (start, end), range_crc in zip(self._ranges, self._range_crcs, strict=True):
            crc = crc32c_combine(crc, range_crc, end - start)
        actual = crc32c_b64(crc)
        if actual != self._expected_crc:
            raise DataCorruptionError(
                f"{self.path}: downloaded bytes have crc32c {actual}, the server says {self._expected_crc}"
            )
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
        """The whole object as one torch storage over this reader's buffer (no copy).

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
        """The verified bytes of the object (no copy)."""
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
        """Verify the object's crc32c (raising on mismatch) and release the buffer."""
        if self.closed:
            return
        try:
            if not self._abandoned and self._error is None:  # a failed download was reported already
                self.verify()
        finally:
            self._abandoned = True  # running lanes fetch nothing more; queued ones need not start
            # A cancelled lane counts as done only once a thread dequeues it: wait for the others only.
            started = [lane for lane in self._lanes if not lane.cancel()]
            wait(started)  # a request in flight ends by the deadline on its own
            super().close()
            self._view.release()
            self._buffer = bytearray()  # the mmap is unmapped once no view (or tensor) of it is left

    def __del__(self) -> None:
        if "_lanes" in self.__dict__ and not self.closed:  # not when __init__ failed
            self._abandoned = True
            self.close()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self._abandoned = True  # an error is already on its way out; skip the verification
        self.close()

