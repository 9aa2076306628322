"""smartredis_io client benchmark: the three performance bars of issue 4, measured in one run.

1. put_tensor + unpack_tensor of a 1 MiB float32 tensor, one client, against raw redis-py SET + GET of
   the same bytes (bar: >= 0.8x); the ceiling is two in-memory copies of the bytes.
2. unpack_tensor of a 16 MiB tensor: payload-sized buffers allocated after the socket read, traced
   with tracemalloc (bar: none, i.e. the only copy is the socket read into the caller's array);
   redis-py GET + copy and get_tensor are shown for comparison.
3. run_model of a tiny TorchScript model through one execution worker: median overhead over the
   model's own forward time (bar: <= 1 ms); the floor is a bare redis-py request/reply through
   another process (RPUSH, BLPOP there, RPUSH back, BLPOP here): the two wake-ups any worker design pays.

Everything runs on an embedded Orchestrator (redis-server + one worker) on loopback.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Sequence

import numpy as np
import redis
import torch

from benchmarks.report import (
    configure_logging,
    format_table,
    latencies_seconds,
    median_seconds,
    ratio,
    write_json,
)
from smartredis_io import Client, Orchestrator

log = logging.getLogger("benchmarks.smartredis_client")

MiB = 1 << 20
THROUGHPUT_BYTES = 1 * MiB
COPY_BYTES = 16 * MiB
DEFAULT_ITERATIONS = 100
DEFAULT_REPEATS = 5
DEFAULT_CALLS = 300  # run_model calls whose latencies give the median
THROUGHPUT_BAR = 0.8  # ours / redis-py
COPY_BAR = 0.0  # extra payload-sized buffers after the socket read
OVERHEAD_BAR_MS = 1.0
ECHO_TIMEOUT_S = 10
COLUMNS = {
    "metric": "metric", "ours": "smartredis_io", "baseline": "baseline", "ceiling": "ceiling",
    "unit": "unit", "ratio": "ours/baseline", "ratio_ceiling": "ours/ceiling", "bar": "bar", "ok": "ok",
}


def _loop(calls: Sequence[Callable[[], object]], iterations: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(iterations):
            for call in calls:
                call()

    return run


def _per_second(seconds: float, iterations: int, nbytes: int) -> float:
    """MB/s of payload moved by ``iterations`` put+get pairs (each moves the payload twice)."""
    return 2 * nbytes * iterations / seconds / 1e6


def throughput(client: Client, raw: redis.Redis, iterations: int, repeats: int) -> dict:
    array = np.random.default_rng(0).random(THROUGHPUT_BYTES // 4, dtype=np.float32)
    out = np.empty_like(array)
    payload = array.tobytes()
    scratch = bytearray(THROUGHPUT_BYTES)
    ours = median_seconds(_loop([lambda: client.put_tensor("bench.t", array),
                                 lambda: client.unpack_tensor("bench.t", out)], iterations), repeats)
    base = median_seconds(_loop([lambda: raw.set("bench.raw", payload), lambda: raw.get("bench.raw")], iterations),
                          repeats)
    ceiling = median_seconds(_loop([lambda: scratch.__setitem__(slice(None), payload),
                                    lambda: np.copyto(out, array)], iterations), repeats)
    assert np.array_equal(out, array)
    ours_mbs, base_mbs = _per_second(ours, iterations, array.nbytes), _per_second(base, iterations, array.nbytes)
    ceil_mbs = _per_second(ceiling, iterations, array.nbytes)
    r = ratio(ours_mbs, base_mbs)
    return {"metric": "put_tensor+unpack_tensor 1 MiB f32 (baseline: redis-py SET+GET; ceiling: 2 memcpy)",
            "ours": ours_mbs, "baseline": base_mbs, "ceiling": ceil_mbs, "unit": "MB/s", "ratio": r,
            "ratio_ceiling": ratio(ours_mbs, ceil_mbs), "bar": f">= {THROUGHPUT_BAR}", "ok": r >= THROUGHPUT_BAR}


def _peak_extra_bytes(fn: Callable[[], object]) -> int:
    fn()  # warm up: connections, scratch buffers
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - start


def copies(client: Client, raw: redis.Redis) -> dict:
    array = np.random.default_rng(1).random(COPY_BYTES // 4, dtype=np.float32)
    out = np.empty_like(array)
    client.put_tensor("bench.big", array)
    raw.set("bench.bigraw", array.tobytes())
    ours = _peak_extra_bytes(lambda: client.unpack_tensor("bench.big", out)) / array.nbytes
    base = _peak_extra_bytes(lambda: np.copyto(out, np.frombuffer(raw.get("bench.bigraw"), np.float32))) / array.nbytes
    fresh = _peak_extra_bytes(lambda: client.get_tensor("bench.big")) / array.nbytes
    assert np.array_equal(out, array)
    log.info("get_tensor (new array) allocates %.2f payloads: the result itself", fresh)
    return {"metric": "unpack_tensor 16 MiB: payload-sized buffers after the socket read "
                      "(baseline: redis-py GET + copyto; ceiling: get_tensor's own result array)",
            "ours": ours, "baseline": base, "ceiling": fresh, "unit": "x payload", "ratio": None,
            "ratio_ceiling": None, "bar": f"<= {COPY_BAR} (one copy: socket -> out)", "ok": ours < 0.01}


ECHO_SCRIPT = """
import sys, redis
r = redis.Redis.from_url("redis://" + sys.argv[1], socket_timeout=None)
while True:
    _, reply_key = r.blpop(["bench.echo"])
    r.rpush(reply_key, b"ok")
"""


def echo_floor(address: str, raw: redis.Redis, calls: int) -> float:
    """Median seconds of a request/reply through another process with bare redis-py (two wake-ups)."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO_SCRIPT, address])
    try:

        def ask(i: list[int] = [0]) -> None:  # noqa: B006 - a counter for unique reply keys
            i[0] += 1
            pipe = raw.pipeline(transaction=False)
            pipe.rpush("bench.echo", f"bench.echo.{i[0]}")
            pipe.blpop([f"bench.echo.{i[0]}"], timeout=ECHO_TIMEOUT_S)
            if pipe.execute()[1] is None:
                raise RuntimeError("the echo process did not answer")

        for _ in range(10):
            ask()
        return statistics.median(latencies_seconds(ask, calls))
    finally:
        echo.kill()
        echo.wait()


def run_model_overhead(client: Client, raw: redis.Redis, address: str, calls: int) -> dict:
    torch.manual_seed(0)
    model = torch.jit.trace(torch.nn.Linear(16, 4).eval(), torch.zeros(1, 16))
    buffer = io.BytesIO()
    torch.jit.save(model, buffer)
    client.set_model("bench.model", buffer.getvalue(), "TORCH", "CPU")
    x = np.random.default_rng(2).random((1, 16), dtype=np.float32)
    client.put_tensor("bench.x", x)
    for _ in range(10):  # the worker loads the model on the first call
        client.run_model("bench.model", ["bench.x"], ["bench.y"])
    tensor = torch.from_numpy(x)
    with torch.inference_mode():
        forward = statistics.median(latencies_seconds(lambda: model(tensor), calls))
    run = statistics.median(latencies_seconds(lambda: client.run_model("bench.model", ["bench.x"], ["bench.y"]),
                                              calls))
    floor = echo_floor(address, raw, calls)
    overhead_ms = (run - forward) * 1e3
    return {"metric": "run_model tiny model: median overhead over forward "
                      "(baseline: forward; ceiling: bare redis-py echo via another process)",
            "ours": overhead_ms, "baseline": forward * 1e3, "ceiling": floor * 1e3, "unit": "ms", "ratio": None,
            "ratio_ceiling": ratio(overhead_ms, floor * 1e3), "bar": f"<= {OVERHEAD_BAR_MS} ms",
            "ok": overhead_ms <= OVERHEAD_BAR_MS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.smartredis_client",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="put+unpack pairs per repeat")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="repeats (the median is reported)")
    parser.add_argument("--calls", type=int, default=DEFAULT_CALLS, help="run_model calls timed")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)
    with Orchestrator(shards=1, workers=1) as orchestrator, Client(False, orchestrator.address) as client:
        raw = redis.Redis.from_url(f"redis://{orchestrator.address}")
        rows = [
            throughput(client, raw, args.iterations, args.repeats),
            copies(client, raw),
            run_model_overhead(client, raw, orchestrator.address, args.calls),
        ]
        raw.close()
    sys.stdout.write(format_table(rows, COLUMNS) + "\n")
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
