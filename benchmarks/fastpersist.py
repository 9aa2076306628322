"""FastPersist checkpoint benchmark: the DeepNVMe FastPersist micro-benchmarks, no-patch, offline.

``python -m benchmarks.fastpersist tensor|model|deepspeed --folder DIR --io_buffer_mb 256 [--json PATH]``

Each row is the median of ``--repeat`` runs, printed in the seed's form
(``test_save -- 14.23 GB, 11.40 secs, 1.25 GB/s``), then as a table with ratios to the baseline
(torch.save / torch.load) and to the ceiling (raw sequential O_DIRECT transfers of the same byte count
through the same aio handle, measured in the same run).

- ``tensor``: a state dict of ``--num_tensors`` float32 tensors totalling ``--size_mb`` MiB.
- ``model``: a GPT-style model built in code with random weights, about ``--params`` parameters.
- ``deepspeed``: that model under a DeepSpeed engine (CPU, one process), ``engine.save_checkpoint``
  with DeepSpeed's torch.save engine against the FastPersist checkpoint engine.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.report import PeakRSS, configure_logging, format_table, ratio, timed, write_json
from fastpersist import fastpersist_load, fastpersist_save, get_aio_handle, get_pinned_buffer
from fastpersist.aio import aio_unavailable_reason
from fastpersist.memory import ALIGNMENT_BYTES, MiB

log = logging.getLogger("benchmarks.fastpersist")

GB = 1024**3  # the seed's "GB" (2**30 bytes)
RSS_ALLOWANCE_MB = 64  # issue 3: extra RSS during a save <= pinned buffer + 64 MiB
VOCAB_SIZE = 50257
CONTEXT = 1024
MODEL_WIDTHS = ((2e8, 768), (6e8, 1024), (2e9, 2048), (math.inf, 4096))  # (params below, d_model)
SAVE_ROWS = ("test_save", "test_fastpersist_aio_nopatch", "test_fastpersist_py_nopatch")
LOAD_ROWS = ("test_fastpersist_load", "test_torch_load")


@dataclass
class Row:
    name: str
    bytes: int
    seconds: float
    engine: str
    rss_extra_mb: float | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / GB / self.seconds if self.seconds > 0 else 0.0

    def seed_line(self) -> str:
        return f"{self.name:<30} -- {self.bytes / GB:.2f} GB, {self.seconds:.2f} secs, {self.gbps:.2f} GB/s"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fastpersist", description=__doc__.split("\n")[0]
    )
    parser.add_argument("workload", choices=["tensor", "model", "deepspeed"])
    parser.add_argument("--folder", required=True, type=Path, help="directory on the NVMe device to write to")
    parser.add_argument("--io_buffer_mb", type=int, default=256, help="pinned staging buffer size (MiB)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the median is reported")
    parser.add_argument("--size_mb", type=int, default=1024, help="tensor workload: total MiB")
    parser.add_argument("--num_tensors", type=int, default=64, help="tensor workload: number of tensors")
    parser.add_argument(
        "--params", default="125M", help="model/deepspeed workloads: parameter count, e.g. 125M, 1.3B"
    )
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"--folder {args.folder} is not a directory")
    return args


def parse_count(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def tensor_state(size_mb: int, num_tensors: int) -> dict[str, torch.Tensor]:
    """``num_tensors`` random float32 tensors of ``size_mb`` MiB in total."""
    numel = size_mb * MiB // 4 // num_tensors
    return {f"layer{i}.weight": torch.randn(numel) for i in range(num_tensors)}


class GPTBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, max(1, width // 64), batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-shaped decoder with random weights and a tied output head (one shared storage)."""

    def __init__(self, params: int) -> None:
        super().__init__()
        width = next(w for limit, w in MODEL_WIDTHS if params < limit)
        layers = max(1, round((params - (VOCAB_SIZE + CONTEXT) * width) / (12 * width * width)))
        self.wte, self.wpe = nn.Embedding(VOCAB_SIZE, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.Sequential(*(GPTBlock(width) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        return self.lm_head(self.ln_f(self.blocks(x)))


def torch_save_fsync(obj: Any, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def drop_file_cache(path: Path) -> None:
    """Evict ``path`` from the page cache so buffered reads hit the device (O_DIRECT never uses it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_odirect(path: Path, num_bytes: int, handle: Any, buffer: torch.Tensor, write: bool) -> None:
    """The ceiling: ``num_bytes`` as whole-buffer sequential O_DIRECT transfers, one in flight, no copies."""
    num_bytes = num_bytes // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    fd = os.open(path, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | os.O_DIRECT, 0o644)
    try:
        if write:
            os.posix_fallocate(
                fd, 0, num_bytes
            )  # as fastpersist_save does: in-file O_DIRECT writes run async
        for offset in range(0, num_bytes, buffer.numel()):
            chunk = buffer.narrow(0, 0, min(buffer.numel(), num_bytes - offset))
            status = (
                handle.async_pwrite(chunk, fd, offset)
                if write
                else handle.async_pread(chunk, str(path), offset)
            )
            if status != 0 or handle.wait() != 1:
                raise OSError(
                    f"raw O_DIRECT {'write' if write else 'read'} failed at offset {offset} of {path}"
                )
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)


def bench_state(
    obj: Any, folder: Path, args: argparse.Namespace, handle: Any, buffer: torch.Tensor
) -> list[Row]:
    """Every row for one object: saves, loads and the raw O_DIRECT ceiling."""
    rows = []
    torch_file, fast_file, raw_file = (
        folder / "torch_save.pt",
        folder / "fastpersist.pt",
        folder / "raw_odirect.bin",
    )
    # Every write goes to a fresh file: freeing the previous one's blocks is not what is measured.
    seconds, _ = timed(
        lambda: torch_save_fsync(obj, torch_file), args.repeat, lambda: torch_file.unlink(missing_ok=True)
    )
    rows.append(Row("test_save", torch_file.stat().st_size, seconds, "torch.save"))
    for name, engine in (("test_fastpersist_aio_nopatch", "aio"), ("test_fastpersist_py_nopatch", "python")):
        with PeakRSS() as rss:
            seconds, stats = timed(
                lambda e=engine: fastpersist_save(obj, fast_file, handle, buffer, engine=e),
                args.repeat,
                lambda: fast_file.unlink(missing_ok=True),
            )
        rows.append(Row(name, stats.bytes, seconds, stats.engine, rss.peak_mb - rss.start_mb))
    seconds, _ = timed(lambda: fastpersist_load(fast_file, None, True, handle, buffer), args.repeat)
    rows.append(
        Row(
            "test_fastpersist_load",
            fast_file.stat().st_size,
            seconds,
            "aio" if aio_unavailable_reason() is None else "python",
        )
    )
    seconds, _ = timed(
        lambda: torch.load(torch_file, weights_only=True), args.repeat, lambda: drop_file_cache(torch_file)
    )
    rows.append(Row("test_torch_load", torch_file.stat().st_size, seconds, "torch.load"))
    num_bytes = fast_file.stat().st_size
    seconds, _ = timed(
        lambda: raw_odirect(raw_file, num_bytes, handle, buffer, write=True),
        args.repeat,
        lambda: raw_file.unlink(missing_ok=True),
    )
    rows.append(Row("raw_odirect_write", num_bytes, seconds, "aio"))
    seconds, _ = timed(lambda: raw_odirect(raw_file, num_bytes, handle, buffer, write=False), args.repeat)
    rows.append(Row("raw_odirect_read", num_bytes, seconds, "aio"))
    for path in (torch_file, fast_file, raw_file):
        path.unlink(missing_ok=True)
    return rows


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """torch.distributed over gloo for one local process, as DeepSpeed needs; torn down after."""
    import importlib

    import deepspeed

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    # One process needs no shared-memory allreduce op (a minutes-long JIT build on CPU).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def bench_deepspeed(model: nn.Module, folder: Path, args: argparse.Namespace, handle: Any) -> list[Row]:
    """``engine.save_checkpoint`` with DeepSpeed's torch.save engine, then with FastPersist."""
    import deepspeed

    from fastpersist import enable_fastpersist

    config = {"train_batch_size": 1, "zero_optimization": {"stage": 0}}
    with single_process_group():
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
        )
        engine.backward(engine(torch.randint(0, VOCAB_SIZE, (1, 8))).float().mean())
        engine.step()  # optimizer state exists from here on
        rows = []
        for name in ("test_deepspeed_save", "test_deepspeed_fastpersist"):
            target = folder / name
            if name == "test_deepspeed_fastpersist":
                enable_fastpersist(engine, io_buffer_mb=args.io_buffer_mb, aio_handle=handle)
            seconds, _ = timed(lambda t=target: engine.save_checkpoint(t, tag="bench"), args.repeat)
            num_bytes = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
            rows.append(Row(name, num_bytes, seconds, engine.checkpoint_engine.name))
            shutil.rmtree(target)
    return rows


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    """JSON rows with ratios to the baseline (torch) and the ceiling (raw O_DIRECT) of the same kind."""
    by_name = {row.name: row for row in rows}

    def gbps(name: str) -> float | None:
        return by_name[name].gbps if name in by_name else None

    out = []
    for row in rows:
        is_load = row.name in LOAD_ROWS or row.name == "raw_odirect_read"
        baseline = gbps("test_torch_load" if is_load else "test_save") or gbps("test_deepspeed_save")
        ceiling = gbps("raw_odirect_read" if is_load else "raw_odirect_write")
        out.append(
            {
                "name": row.name,
                "bytes": row.bytes,
                "seconds": row.seconds,
                "gbps": row.gbps,
                "engine": row.engine,
                "vs_baseline": ratio(row.gbps, baseline),
                "vs_ceiling": ratio(row.gbps, ceiling),
                "rss_extra_mb": row.rss_extra_mb,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(logging.WARNING)
    if aio_unavailable_reason() is not None:
        log.warning("DeepSpeed async_io op unavailable: aio rows run on the Python engine, no ceiling rows")
        return 1
    handle = get_aio_handle()
    buffer = get_pinned_buffer(args.io_buffer_mb, handle)
    if args.workload == "tensor":
        rows = bench_state(tensor_state(args.size_mb, args.num_tensors), args.folder, args, handle, buffer)
    else:
        torch.manual_seed(0)
        model = GPT(parse_count(args.params))
        if args.workload == "model":
            rows = bench_state(model.state_dict(), args.folder, args, handle, buffer)
        else:
            rows = bench_deepspeed(model, args.folder, args, handle)
    for row in rows:
        print(row.seed_line())
    summary = summarize(rows)
    print()
    print(
        format_table(
            summary,
            {
                "name": "row",
                "gbps": "GB/s",
                "vs_baseline": "x baseline",
                "vs_ceiling": "x ceiling",
                "rss_extra_mb": "extra RSS MB",
            },
        )
    )
    print(
        f"\n(median of {args.repeat}; extra RSS allowance = {args.io_buffer_mb} MiB buffer + {RSS_ALLOWANCE_MB} MiB)"
    )
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
