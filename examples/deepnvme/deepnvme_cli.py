"""Shared command line, timing and DeepNVMe handles for the DeepNVMe-style example scripts."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

MiB = 1024**2
GB = 1024**3  # DeepNVMe's examples report 2**30-byte "GB"
BLOCK_BYTES = 1 * MiB  # DeepNVMe's example configuration: aio_handle(1 MiB, 128, True, True, 1)
QUEUE_DEPTH = 128
DIRECT_IO_ALIGNMENT = 4096


def load_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--input_file", required=True, help="File on NVMe device that will read as input.")
    parser.add_argument(
        "--loop", type=int, default=3, help="The number of times to repeat the operation (default 3)."
    )
    parser.add_argument(
        "--validate", action="store_true", help="Compare the tensor against a Python file read."
    )
    return parser.parse_args()


def store_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--nvme_folder", required=True, help="NVMe folder for file write.")
    parser.add_argument(
        "--mb_size", type=int, default=1024, help="Size of tensor to save in MB (default 1024)."
    )
    parser.add_argument(
        "--loop", type=int, default=3, help="The number of times to repeat the operation (default 3)."
    )
    parser.add_argument(
        "--validate", action="store_true", help="Compare the file against the tensor (Python read)."
    )
    args = parser.parse_args()
    if not os.path.isdir(args.nvme_folder):
        parser.error(f"--nvme_folder {args.nvme_folder} is not a directory")
    return args


def run(name: str, num_bytes: int, loop: int, operation: Callable[[], Any]) -> Any:
    """Run ``operation`` ``loop`` times and print the mean throughput; returns its last result."""
    result, seconds = None, 0.0
    for _ in range(loop):
        start = time.perf_counter()
        result = operation()
        seconds += time.perf_counter() - start
    seconds /= max(loop, 1)
    print(f"{name} -- {num_bytes / GB:.2f} GB, {seconds:.3f} secs, {num_bytes / GB / seconds:.2f} GB/s")
    return result


def load_example(
    name: str, args: argparse.Namespace, num_bytes: int, read: Callable[[], torch.Tensor]
) -> None:
    """Time ``read()`` of ``--input_file``; with ``--validate`` compare its result with a Python read."""
    loaded = run(name, num_bytes, args.loop, read)
    if args.validate:
        validate(name, loaded, py_read(args.input_file))


def store_example(
    name: str, args: argparse.Namespace, tensor: torch.Tensor, write: Callable[[str], Any]
) -> None:
    """Time ``write(path)`` of ``tensor`` into ``--nvme_folder``; with ``--validate`` read the file back."""
    path = output_file(args.nvme_folder, name, args.mb_size)
    run(name, args.mb_size * MiB, args.loop, lambda: write(path))
    if args.validate:
        validate(name, py_read(path), tensor)


def py_read(path: str) -> torch.Tensor:
    """The whole file as a CPU uint8 tensor, read with plain Python file I/O."""
    with open(path, "rb") as handle:
        return torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8)


def py_write(path: str, tensor: torch.Tensor) -> None:
    """Write a CPU uint8 tensor with plain Python file I/O, flushed to the device."""
    with open(path, "wb") as handle:
        handle.write(memoryview(tensor.numpy()))
        handle.flush()
        os.fsync(handle.fileno())


def validate(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    ok = torch.equal(got.cpu(), want.cpu())
    print(f"{name} validation {'success' if ok else 'FAILED'}")
    if not ok:
        sys.exit(1)


def require_cuda(name: str, gds_folder: str | None = None) -> None:
    """Exit with a message (no traceback, no native error lines) where CUDA, or GDS in ``gds_folder``, is unusable."""
    if not torch.cuda.is_available():
        sys.exit(f"{name}: CUDA is not available on this machine; this example needs a GPU")
    if gds_folder is not None:
        from fastpersist import FastPersistContext

        reason = FastPersistContext(engine="gds").gds_unusable_reason(gds_folder)
        if reason is not None:
            sys.exit(f"{name}: GPUDirect Storage cannot be used here: {reason}")


def aio_handle() -> Any:
    from fastpersist import get_aio_handle

    return get_aio_handle(BLOCK_BYTES, QUEUE_DEPTH, True, True, 1)


def gds_handle() -> Any:
    from fastpersist.aio import AioConfig, new_gds_handle

    return new_gds_handle(AioConfig(BLOCK_BYTES, QUEUE_DEPTH, 1, True, True))


def direct_io_size(path: str) -> int:
    """The file's size, which O_DIRECT reads need to be a whole number of 4 KiB blocks."""
    num_bytes = os.path.getsize(path)
    if num_bytes % DIRECT_IO_ALIGNMENT:
        sys.exit(
            f"{path}: {num_bytes} bytes is not a multiple of {DIRECT_IO_ALIGNMENT} (needed for O_DIRECT reads)"
        )
    return num_bytes


def completed(count: int, what: str) -> None:
    """Exit with a message unless a synchronous DeepNVMe call completed its one operation."""
    if count != 1:
        sys.exit(f"{what} failed: DeepNVMe completed {count} operations")


def random_bytes(mb_size: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 256, (mb_size * MiB,), dtype=torch.uint8, device=device)


def output_file(folder: str, name: str, mb_size: int) -> str:
    return os.path.join(folder, f"{name}_{mb_size}MB.pt")
