"""FastPersist checkpoint benchmark: the DeepNVMe FastPersist micro-benchmarks, no-patch, offline.

``python -m benchmarks.fastpersist tensor|model|deepspeed --folder DIR [--device cuda] [--json PATH]``

Rows run interleaved in rounds (A B C A B C ...), ``--repeat`` rounds; each row reports the median
(and min/max) of its rounds, printed as ``test_save -- 14.23 GB, 11.40 secs, 1.25 GB/s`` lines (GB: 10^9 bytes) and a
table with ratios to the baseline (torch.save / torch.load, durable with durable) and to the ceiling
(raw sequential O_DIRECT transfers of the same byte count, through the same aio handle, in the same
run). Loads are also compared with a raw O_DIRECT read into memory allocated for it, as a load's
result must be (``x ceiling (new memory)``): the first ceiling reuses one buffer and never pays for
faulting in fresh pages. ``CPU s`` is the process's CPU time (every thread, user and system) during
a row's round, median: what a save or load takes from the training beside it. With
``--device cuda`` the state dict lives on the GPU, loads map to it, and the pinned device-to-host /
host-to-device copy rates are measured as further ceilings.

- ``tensor``: a state dict of ``--num_tensors`` float32 tensors totalling ``--size_mb`` MiB.
- ``model``: a GPT-style model built in code with random weights, about ``--params`` parameters
  (bf16 on the GPU).
- ``deepspeed``: that model under a DeepSpeed engine (one process), ``engine.save_checkpoint`` with
  DeepSpeed's torch.save engine (as is, and made durable by fsyncing every file it wrote) against
  the FastPersist checkpoint engine (durable: every file is fsynced before it is renamed into place).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.report import GB, PeakRSS, configure_logging, format_table, ratio, write_json
from fastpersist import FastPersistContext, _deepspeed_compat, fastpersist_load, fastpersist_save
from fastpersist.aio import aio_unavailable_reason
from fastpersist.engines import Transfer, open_file
from fastpersist.memory import ALIGNMENT_BYTES, MiB, aligned_empty
from lightning_storage_plugins._torch_compat import mirror_verdicts
from lightning_storage_plugins.services import free_port

log = logging.getLogger("benchmarks.fastpersist")

RSS_ALLOWANCE_MB = 64  # extra RSS during a save stays within pinned buffer + 64 MiB
VOCAB_SIZE = 50257
CONTEXT = 1024
MODEL_WIDTHS = ((2e8, 768), (6e8, 1024), (2e9, 2048), (math.inf, 4096))  # (params below, d_model)
LOAD_ROWS = ("test_fastpersist_load", "test_torch_load")


@dataclass
class Row:
    name: str
    bytes: int
    times: list[float]
    engine: str
    rss_extra_mb: float | None = None
    note: str = ""
    cpu_times: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def gbps(self) -> float:
        return self.bytes / GB / self.seconds if self.seconds > 0 else 0.0

    def summary_line(self) -> str:
        return f"{self.name:<30} -- {self.bytes / GB:.2f} GB, {self.seconds:.2f} secs, {self.gbps:.2f} GB/s"


@dataclass
class Case:
    """One row: ``run`` timed once per round, ``before`` untimed ahead of it.

    What ``run`` returns (a load's result) is freed after the clock stops: a load ends when the caller
    has the object, and freeing a GiB of tensors is the caller's later cost, not the load's.
    """

    name: str
    engine: str
    run: Callable[[], Any]
    size: Callable[[], int]
    before: Callable[[], None] = lambda: None
    note: str = ""
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    rss_extra_mb: float = 0.0


def run_rounds(cases: list[Case], rounds: int) -> list[Row]:
    """Each case once per round, in order, ``rounds`` times (A B C A B C ...)."""
    for _ in range(rounds):
        for case in cases:
            case.before()
            with PeakRSS() as rss:
                start, cpu_start = time.perf_counter(), time.process_time()
                result = case.run()
                case.times.append(time.perf_counter() - start)
                case.cpu_times.append(time.process_time() - cpu_start)
                del result
            case.rss_extra_mb = max(case.rss_extra_mb, rss.peak_mb - rss.start_mb)
    return [Row(c.name, c.size(), c.times, c.engine, c.rss_extra_mb, c.note, c.cpu_times) for c in cases]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fastpersist", description=__doc__.split("\n")[0]
    )
    parser.add_argument("workload", choices=["tensor", "model", "deepspeed"])
    parser.add_argument("--folder", required=True, type=Path, help="directory on the NVMe device to write to")
    parser.add_argument("--io_buffer_mb", type=int, default=256, help="pinned staging buffer size (MiB)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each row reports its median")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the state dict lives")
    parser.add_argument("--size_mb", type=int, default=1024, help="tensor workload: total MiB")
    parser.add_argument("--num_tensors", type=int, default=64, help="tensor workload: number of tensors")
    parser.add_argument(
        "--params", default="125M", help="model/deepspeed workloads: parameter count, e.g. 125M, 1.3B"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
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
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
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
            if not _deepspeed_compat.partial_file_transfers(handle):
                # This DeepSpeed's handle can hang on part of a file: the same transfer, synchronously.
                view = [memoryview(chunk.numpy())]
                if (os.pwritev(fd, view, offset) if write else os.preadv(fd, view, offset)) != chunk.numel():
                    raise OSError(f"raw O_DIRECT {'write' if write else 'read'} failed at offset {offset} of {path}")
                continue
            status = (
                _deepspeed_compat.async_pwrite(handle, chunk, fd, str(path), offset)
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


def raw_odirect_into_new_memory(path: Path, num_bytes: int, context: FastPersistContext) -> torch.Tensor:
    """The ceiling of a load, which must return memory of its own: ``num_bytes`` read with O_DIRECT into
    memory allocated for them, as ``fastpersist_load`` reads a file (the python engine's parallel
    ``preadv``, pages faulted in ahead of the reads), and nothing else. Returns the memory read into."""
    num_bytes = num_bytes // ALIGNMENT_BYTES * ALIGNMENT_BYTES
    target = aligned_empty(num_bytes)
    file = open_file(str(path), write=False)
    try:
        engine = context.io_engine("python")
        engine.submit(Transfer(file, target, 0, write=False, fresh=True))
        engine.wait()
    finally:
        file.close()
    return target


def bench_state(obj: Any, folder: Path, args: argparse.Namespace, context: FastPersistContext) -> list[Row]:
    """Every row for one object, interleaved in rounds: saves, loads, raw O_DIRECT and copy ceilings."""
    handle, buffer = context.aio_handle(), context.staging_buffer()
    torch_file, fast_file, raw_file = (
        folder / "torch_save.pt",
        folder / "fastpersist.pt",
        folder / "raw_odirect.bin",
    )
    location = args.device
    # Every write goes to a fresh file: freeing the previous one's blocks is not what is measured.
    fresh = {path: (lambda p=path: p.unlink(missing_ok=True)) for path in (torch_file, fast_file, raw_file)}
    save_engines = [("test_fastpersist_aio_nopatch", "aio")]
    if args.device == "cuda" and context.gds_unusable_reason(str(folder)) is None:
        save_engines.append(("test_fastpersist_gds_nopatch", "gds"))
    save_engines.append(("test_fastpersist_py_nopatch", "python"))
    cases = [
        Case(
            "test_save",
            "torch.save",
            lambda: torch_save_fsync(obj, torch_file),
            lambda: torch_file.stat().st_size,
            fresh[torch_file],
            "durable (fsync)",
        )
    ]
    for name, engine in save_engines:
        with_engine = (
            FastPersistContext(engine=engine, io_buffer_mb=args.io_buffer_mb, aio_handle=handle)
            if engine == "gds"
            else context
        )
        cases.append(
            Case(
                name,
                engine,
                lambda e=engine, c=with_engine: fastpersist_save(obj, fast_file, context=c, engine=e),
                lambda: fast_file.stat().st_size,
                fresh[fast_file],
                "durable (fsync)",
            )
        )
    cases += [
        Case(
            "test_torch_load",
            "torch.load",
            lambda: torch.load(torch_file, map_location=location, weights_only=True),
            lambda: torch_file.stat().st_size,
            lambda: drop_file_cache(torch_file),
        ),
        Case(
            "test_fastpersist_load",
            "python",
            lambda: fastpersist_load(fast_file, map_location=location, context=context),
            lambda: fast_file.stat().st_size,
        ),
        Case(
            "raw_odirect_write",
            "aio",
            lambda: raw_odirect(raw_file, fast_file.stat().st_size, handle, buffer, write=True),
            lambda: fast_file.stat().st_size,
            fresh[raw_file],
            "ceiling",
        ),
        Case(
            "raw_odirect_read",
            "aio",
            lambda: raw_odirect(raw_file, fast_file.stat().st_size, handle, buffer, write=False),
            lambda: fast_file.stat().st_size,
            note="ceiling",
        ),
        Case(
            "raw_odirect_read_new_memory",
            "aio",
            lambda: raw_odirect_into_new_memory(raw_file, fast_file.stat().st_size, context),
            lambda: fast_file.stat().st_size,
            note="ceiling",
        ),
    ]
    if args.device == "cuda":
        device_bytes = torch.empty(buffer.numel(), dtype=torch.uint8, device="cuda")
        pinned = buffer if buffer.is_pinned() else buffer.pin_memory()
        copies = max(1, state_bytes(obj) // pinned.numel())
        cases += [
            Case(
                "pinned_d2h_copy",
                "cuda",
                lambda: copy_rounds(pinned, device_bytes, copies),
                lambda: copies * pinned.numel(),
                note="ceiling",
            ),
            Case(
                "pinned_h2d_copy",
                "cuda",
                lambda: copy_rounds(device_bytes, pinned, copies),
                lambda: copies * pinned.numel(),
                note="ceiling",
            ),
        ]
    # The files the loads and the read ceiling need exist before the first round.
    torch_save_fsync(obj, torch_file)
    fastpersist_save(obj, fast_file, context=context)
    raw_odirect(raw_file, fast_file.stat().st_size, handle, buffer, write=True)
    try:
        return run_rounds(cases, args.repeat)
    finally:
        for path in (torch_file, fast_file, raw_file):
            path.unlink(missing_ok=True)


def state_bytes(obj: Any) -> int:
    """Bytes of the distinct storages in a (nested) state dict."""
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            seen[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(seen.values())


def copy_rounds(target: torch.Tensor, source: torch.Tensor, count: int) -> None:
    """``count`` whole-buffer copies between pinned host and device memory, then a sync."""
    for _ in range(count):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()


@contextlib.contextmanager
def single_process_group(device: str) -> Iterator[None]:
    """torch.distributed (gloo on CPU, nccl on CUDA) for one local process, as DeepSpeed needs."""
    import importlib

    import deepspeed

    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    # One process needs no shared-memory allreduce op (a minutes-long JIT build on CPU).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def bench_deepspeed(
    model: nn.Module, folder: Path, args: argparse.Namespace, context: FastPersistContext
) -> list[Row]:
    """``engine.save_checkpoint`` with DeepSpeed's torch.save engine (as is, and durable) and FastPersist."""
    import deepspeed

    from fastpersist import FastPersistCheckpointEngine

    config = {"train_batch_size": 1, "zero_optimization": {"stage": 0}}
    if args.device == "cuda":
        config["bf16"] = {"enabled": True}
    with single_process_group(args.device):
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
        )
        tokens = torch.randint(0, VOCAB_SIZE, (1, 8), device=args.device)
        engine.backward(engine(tokens).float().mean())
        engine.step()  # optimizer state exists from here on
        default_engine = engine.checkpoint_engine
        fast_engine = FastPersistCheckpointEngine(context=context)
        targets = {
            name: folder / name
            for name in ("deepspeed_save", "deepspeed_save_durable", "deepspeed_fastpersist")
        }

        def save(name: str, checkpoint_engine: Any, durable: bool = False) -> None:
            engine.checkpoint_engine = checkpoint_engine
            engine.save_checkpoint(targets[name], tag="bench")
            if durable:  # what FastPersist guarantees: every file and directory entry on disk
                fsync_tree(targets[name])

        def size(name: str) -> Callable[[], int]:
            return lambda: sum(p.stat().st_size for p in targets[name].rglob("*") if p.is_file())

        def fresh(name: str) -> Callable[[], None]:
            return lambda: shutil.rmtree(targets[name], ignore_errors=True)

        cases = [
            Case(
                "test_deepspeed_save",
                getattr(default_engine, "name", None) or "torch",
                lambda: save("deepspeed_save", default_engine),
                size("deepspeed_save"),
                fresh("deepspeed_save"),
                "not durable (no fsync)",
            ),
            Case(
                "test_deepspeed_save_durable",
                getattr(default_engine, "name", None) or "torch",
                lambda: save("deepspeed_save_durable", default_engine, durable=True),
                size("deepspeed_save_durable"),
                fresh("deepspeed_save_durable"),
                "baseline: + fsync of every file",
            ),
            Case(
                "test_deepspeed_fastpersist",
                fast_engine.name,
                lambda: save("deepspeed_fastpersist", fast_engine),
                size("deepspeed_fastpersist"),
                fresh("deepspeed_fastpersist"),
                "durable (fsync)",
            ),
        ]
        try:
            return run_rounds(cases, args.repeat)
        finally:
            engine.checkpoint_engine = default_engine
            for target in targets.values():
                shutil.rmtree(target, ignore_errors=True)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for path in [*root.rglob("*"), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    """JSON rows with ratios to the baseline and the ceiling of the same kind (save/load)."""
    by_name = {row.name: row for row in rows}

    def gbps(name: str) -> float | None:
        return by_name[name].gbps if name in by_name else None

    out = []
    for row in rows:
        is_load = row.name in LOAD_ROWS or row.name.startswith("raw_odirect_read")
        baseline = gbps("test_torch_load" if is_load else "test_save") or gbps("test_deepspeed_save_durable")
        ceiling = gbps("raw_odirect_read" if is_load else "raw_odirect_write")
        is_ceiling = row.note == "ceiling"
        out.append(
            {
                "name": row.name,
                "bytes": row.bytes,
                "seconds": row.seconds,
                "seconds_min": min(row.times),
                "seconds_max": max(row.times),
                "cpu_seconds": statistics.median(row.cpu_times) if row.cpu_times else None,
                "gbps": row.gbps,
                "engine": row.engine,
                "vs_baseline": None if is_ceiling else ratio(row.gbps, baseline),
                "vs_ceiling": None
                if is_ceiling or row.name.startswith("test_deepspeed")
                else ratio(row.gbps, ceiling),
                "vs_ceiling_new_memory": ratio(row.gbps, gbps("raw_odirect_read_new_memory"))
                if is_load and not is_ceiling
                else None,
                "rss_extra_mb": row.rss_extra_mb,
                "note": row.note,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(logging.WARNING)
    if aio_unavailable_reason() is not None:
        log.error("DeepSpeed async_io op unavailable (%s): no aio rows or ceilings", aio_unavailable_reason())
        return 1
    with FastPersistContext(io_buffer_mb=args.io_buffer_mb) as context:
        if args.workload == "tensor":
            state = {k: v.to(args.device) for k, v in tensor_state(args.size_mb, args.num_tensors).items()}
            rows = bench_state(state, args.folder, args, context)
        else:
            torch.manual_seed(0)
            model = GPT(parse_count(args.params))
            if args.device == "cuda":
                model = model.to(device="cuda", dtype=torch.bfloat16)
            if args.workload == "model":
                rows = bench_state(model.state_dict(), args.folder, args, context)
            else:
                rows = bench_deepspeed(model, args.folder, args, context)
    for row in rows:
        print(row.summary_line())
    summary = summarize(rows)
    print()
    columns = {"name": "row", "gbps": "GB/s", "seconds": "s (median)", "seconds_min": "min", "seconds_max": "max",
               "cpu_seconds": "CPU s",
               "vs_baseline": "x baseline", "vs_ceiling": "x ceiling",
               "vs_ceiling_new_memory": "x ceiling (new memory)", "rss_extra_mb": "extra RSS MB", "note": "note"}  # fmt: skip
    print(format_table(summary, columns))
    print(
        f"\n({args.repeat} interleaved rounds on {args.device}; extra RSS allowance = {args.io_buffer_mb} MiB buffer + {RSS_ALLOWANCE_MB} MiB)"
    )
    off = [name for name, holds in mirror_verdicts().items() if not holds]
    print(f"torch {torch.__version__}: fast paths off: {', '.join(off) if off else 'none'}")
    if args.json:
        write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
