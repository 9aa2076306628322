"""smartredis_io client benchmark: per-call costs against raw redis-py, measured in one run.

1. put_tensor + unpack_tensor loop of a float32 tensor, one client, against raw redis-py SET + GET
   of the same bytes, at each ``--sizes`` on a standalone server and a 3-shard cluster. The two loops
   take turns in ``--rounds`` rounds (A B A B ...) and each row is the median round. Bars: >= 0.9x
   raw redis-py below 1 MiB, >= 1.0x from 1 MiB. The ceiling is two in-memory copies of the bytes.
2. unpack_tensor of a 16 MiB tensor: payload-sized buffers allocated after the socket read, traced
   with tracemalloc (bar: none, i.e. the only copy is the socket read into the caller's array).
3. run_model of a tiny model (Linear 16 -> 4) through one execution worker, as TorchScript and as a
   torch.export program: median latency minus the median of the model's own forward (bar: <= 0.5
   ms). The baseline is the worker a user would write with raw redis-py: it pops a request, GETs
   the input, runs the same model and pipelines SET output + RPUSH reply, with the same overhead
   taken off. The floor is a bare redis-py request/reply through another process (RPUSH, BLPOP
   there, RPUSH back, BLPOP here): the two wake-ups any worker design pays. All of them take turns
   in rounds. Bars: <= 1.15x the hand-rolled worker, <= 2.5x the floor.

4. run_model of the same models through a worker the Redis module started itself (``WORKERS 1``: a
   redis-server with the module and nothing else, as SmartSim starts one), in the same rounds as the
   external worker of 3. (``python -m smartredis_io.worker``): bar <= 1.1x the external worker's
   overhead.

Where the published SmartRedis package (``smartredis`` 0.6.1, its C++ core) is installed, it is the
third client in the same rounds, through the smartredis_io Redis module: put_tensor + get_tensor (its
Python client has no unpack_tensor) in 1., bar >= 0.9x smartredis_io from 128 KiB; run_model in 3.,
bar <= 1.1x smartredis_io's overhead. Beside it, in the same rounds, redis-py sends the published
client's own commands (AI.TENSORSET ... BLOB, AI.TENSORGET ... BLOB): ``AI.*/SET+GET`` is what the
module costs over plain SET + GET with the client side held equal, and ``SmartRedis/redis-py`` what
the published client costs against redis-py's SET + GET of the same bytes.

Everything runs on embedded servers (redis-server, a 3-shard Redis Cluster, one worker) on loopback.
"""

from __future__ import annotations

import argparse
import functools
import io
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import redis
import torch

from benchmarks.report import configure_logging, format_table, latencies_seconds, ratio, write_json
from benchmarks.smartsim_scaling.launch import published_available, published_client, raw_client
from benchmarks.worker_python import WORKER_USER, start_servers_reaching_python
from smartredis_io import Client, Orchestrator, RedisCluster, RedisServer
from smartredis_io.error import RedisReplyError

log = logging.getLogger("benchmarks.smartredis_client")

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [KiB, 8 * KiB, 128 * KiB, MiB]
COPY_BYTES = 16 * MiB
DEFAULT_ROUNDS = 5
LOOP_SECONDS = 0.25  # target duration of one round of one loop (sets its iteration count)
DEFAULT_CALLS = 200  # run_model calls per format per round
SMALL_BAR, LARGE_BAR = 0.9, 1.0  # ours / redis-py, below and from 1 MiB
COPY_BAR = 0.0  # extra payload-sized buffers after the socket read
OVERHEAD_BAR_MS = 0.5
RAW_WORKER_BAR, FLOOR_BAR = 1.15, 2.5  # run_model overhead: ours / hand-rolled redis-py worker, ours / echo floor
PUBLISHED_PUT_GET_BAR, PUBLISHED_PUT_GET_FROM = 0.9, 128 * KiB  # published client / ours, from that size
PUBLISHED_RUN_BAR = 1.1  # published client's run_model overhead / ours
MODULE_WORKER_BAR = 1.1  # run_model overhead: a module-started worker / an external worker
ECHO_TIMEOUT_S = 10
HELPER_START_TIMEOUT_S = 300
COLUMNS = {
    "metric": "metric", "ours": "smartredis_io", "baseline": "baseline", "ceiling": "ceiling",
    "unit": "unit", "ratio": "ours/baseline", "ratio_ceiling": "ours/ceiling", "published": "SmartRedis 0.6.1",
    "ratio_published": "SmartRedis/ours", "published_vs_redis_py": "SmartRedis/redis-py",
    "module_vs_set_get": "AI.*/SET+GET", "spread": "spread", "bar": "bar", "ok": "ok",
}


def _loop(calls: Sequence[Callable[[], object]], iterations: int) -> Callable[[], float]:
    """A function running ``iterations`` x ``calls`` and returning seconds per iteration."""
    def run() -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            for call in calls:
                call()
        return (time.perf_counter() - start) / iterations

    return run


def _rounds(loops: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each loop's result per round, the loops taking turns (A B A B ...) so they see the same load."""
    results: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            results[name].append(loop())
    return results


def _spread(values: list[float]) -> str:
    """min..max of a row's rounds, relative to their median."""
    mid = statistics.median(values)
    return f"{min(values) / mid:.2f}..{max(values) / mid:.2f}" if mid else "-"


def _iterations(nbytes: int) -> int:
    # ~0.5 ms per small loop on a quiet machine; large tensors are bandwidth-bound (~1 GB/s)
    per_iteration_s = 5e-4 + 2 * nbytes / 1e9
    return max(5, int(LOOP_SECONDS / per_iteration_s))


def throughput(client: Client, raw: redis.Redis | redis.RedisCluster, nbytes: int, database: str,
               rounds: int, published: object | None = None) -> dict:
    array = np.random.default_rng(nbytes).random(nbytes // 4, dtype=np.float32)
    out, theirs = np.empty_like(array), np.empty_like(array)
    payload = array.tobytes()
    scratch = bytearray(nbytes)
    n = _iterations(nbytes)
    key = f"bench.{database}.{nbytes}"
    loops = {
        "ours": _loop([lambda: client.put_tensor(key, array), lambda: client.unpack_tensor(key, out)], n),
        "base": _loop([lambda: raw.set(key + ".raw", payload), lambda: raw.get(key + ".raw")], n),
        "ceiling": _loop([lambda: scratch.__setitem__(slice(None), payload), lambda: np.copyto(out, array)], n),
    }
    if published is not None:
        loops["published"] = _loop([lambda: published.put_tensor(key + ".published", array),
                                    lambda: np.copyto(theirs, published.get_tensor(key + ".published"))], n)
        # The published client's commands sent by redis-py: what the module costs over SET + GET, with the
        # client side the same as the baseline's.
        loops["redis-py AI.*"] = _loop([
            lambda: raw.execute_command("AI.TENSORSET", key + ".ai", "FLOAT", array.size, "BLOB", payload),
            lambda: raw.execute_command("AI.TENSORGET", key + ".ai", "BLOB")], n)
    results = _rounds(loops, rounds)
    assert np.array_equal(out, array) and (published is None or np.array_equal(theirs, array))
    client.delete_tensor(key)
    raw.delete(key + ".raw")
    per_s = {name: 2 * nbytes / statistics.median(times) / 1e6 for name, times in results.items()}
    r = ratio(per_s["ours"], per_s["base"])
    bar = LARGE_BAR if nbytes >= MiB else SMALL_BAR
    size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
    ok, bars = r is not None and r >= bar, [f">= {bar}"]
    r_published = ratio(per_s.get("published"), per_s["ours"]) if published is not None else None
    if published is not None:
        if raw.execute_command("AI.TENSORGET", key + ".ai", "BLOB") != payload:
            raise AssertionError(f"AI.TENSORGET of {key}.ai returned other bytes than AI.TENSORSET stored")
        raw.delete(key + ".ai")
        client.delete_tensor(key + ".published")
        if nbytes >= PUBLISHED_PUT_GET_FROM:
            bars.append(f"SmartRedis >= {PUBLISHED_PUT_GET_BAR}x ours")
            ok = ok and r_published is not None and r_published >= PUBLISHED_PUT_GET_BAR
    return {"metric": f"put_tensor+unpack_tensor {size} f32, {database} (baseline: redis-py SET+GET; ceiling: "
                      "2 memcpy; SmartRedis 0.6.1: put_tensor+get_tensor)", "database": database, "bytes": nbytes,
            "ours": per_s["ours"], "baseline": per_s["base"], "ceiling": per_s["ceiling"], "unit": "MB/s",
            "ratio": r, "ratio_ceiling": ratio(per_s["ours"], per_s["ceiling"]), "published": per_s.get("published"),
            "ratio_published": r_published,
            "published_vs_redis_py": ratio(per_s.get("published"), per_s["base"]),
            "module_vs_set_get": ratio(per_s.get("redis-py AI.*"), per_s["base"]),
            "spread": _spread(results["ours"]),
            "rounds": results, "iterations": n, "bar": "; ".join(bars), "ok": ok}


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


def _echo(raw: redis.Redis) -> Callable[[], None]:
    """One request/reply through the echo process with bare redis-py."""
    counter = [0]

    def ask() -> None:
        counter[0] += 1
        pipe = raw.pipeline(transaction=False)
        pipe.rpush("bench.echo", f"bench.echo.{counter[0]}")
        pipe.blpop([f"bench.echo.{counter[0]}"], timeout=ECHO_TIMEOUT_S)
        if pipe.execute()[1] is None:
            raise RuntimeError("the echo process did not answer")

    return ask


# The worker a user would write with raw redis-py: no deadlines, retries, batching or checks.
RAW_WORKER_SCRIPT = """
import sys, warnings, numpy as np, redis, torch
warnings.simplefilter("ignore")  # torch.jit's deprecation: TorchScript is one of the formats measured
torch.set_num_threads(1)
r = redis.Redis.from_url("redis://" + sys.argv[1], socket_timeout=None)
models = {"TorchScript": torch.jit.load(sys.argv[2]).eval(), "torch.export": torch.export.load(sys.argv[3]).module()}
r.set("bench.raw.ready", 1)
with torch.inference_mode():
    while True:
        _, request = r.blpop(["bench.raw.requests"])
        name, x_key, y_key, reply_key = request.decode().split()
        x = torch.from_numpy(np.frombuffer(r.get(x_key), np.float32).reshape(1, 16))
        y = models[name](x).numpy()
        pipe = r.pipeline(transaction=False)
        pipe.set(y_key, y.tobytes())
        pipe.rpush(reply_key, b"ok")
        pipe.execute()
"""


def _raw_run(raw: redis.Redis, name: str) -> Callable[[], None]:
    """One run of model ``name`` through the raw redis-py worker."""
    counter = [0]

    def run() -> None:
        counter[0] += 1
        reply = f"bench.raw.reply.{counter[0]}"
        pipe = raw.pipeline(transaction=False)
        pipe.rpush("bench.raw.requests", f"{name} bench.raw.x bench.raw.y {reply}")
        pipe.blpop([reply], timeout=ECHO_TIMEOUT_S)
        if pipe.execute()[1] is None:
            raise RuntimeError("the raw redis-py worker did not answer")

    return run


def _latencies(fn: Callable[[], object], calls: int) -> Callable[[], list[float]]:
    """A round of ``calls`` timed calls of ``fn``, to run later (rows are interleaved in rounds)."""
    return functools.partial(latencies_seconds, fn, calls)


def tiny_models() -> tuple[torch.nn.Module, dict[str, bytes]]:
    """A Linear(16, 4) with seeded weights, as TorchScript and as a torch.export program."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).eval()
    example = torch.zeros(1, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated; it is one format measured
        scripted = io.BytesIO()
        torch.jit.save(torch.jit.trace(model, example), scripted)
    program = torch.export.export(model, (torch.zeros(2, 16),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},))
    exported = io.BytesIO()
    torch.export.save(program, exported)
    return model, {"TorchScript": scripted.getvalue(), "torch.export": exported.getvalue()}


def module_worker_args() -> tuple[str, ...]:
    """The module arguments of a redis-server whose module starts one worker (as ``WORKER_USER`` when root)."""
    return ("WORKERS", "1", "WORKER_PYTHON", sys.executable, *(("WORKER_USER", WORKER_USER) if os.geteuid() == 0 else ()))


def _set_models(client: Client, blobs: dict[str, bytes], x: np.ndarray, start_timeout_s: float = 0.0) -> None:
    """Store the models and run each a few times (the worker loads them on the first call); with
    ``start_timeout_s``, the first run is tried again until a worker has started (not when the module
    says its workers cannot start)."""
    client.put_tensor("bench.x", x)
    deadline = time.monotonic() + start_timeout_s
    for name, blob in blobs.items():
        client.set_model(f"bench.{name}", blob, "TORCH", "CPU")
        while True:
            try:
                client.run_model(f"bench.{name}", ["bench.x"], ["bench.y"])
                break
            except RedisReplyError as exc:
                if "no execution worker" not in str(exc) or "cannot start" in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)  # the module's worker is still importing torch
        for _ in range(10):
            client.run_model(f"bench.{name}", ["bench.x"], ["bench.y"])


def run_model_overhead(client: Client, address: str, calls: int, rounds: int, scratch: Path,
                       published: object | None = None, module_client: Client | None = None) -> list[dict]:
    model, blobs = tiny_models()
    x = np.random.default_rng(2).random((1, 16), dtype=np.float32)
    _set_models(client, blobs, x)
    for name, blob in blobs.items():
        (scratch / f"{name}.pt").write_bytes(blob)
    if module_client is not None:
        _set_models(module_client, blobs, x, HELPER_START_TIMEOUT_S)
    tensor = torch.from_numpy(x)
    with torch.inference_mode():
        forward = statistics.median(_latencies(lambda: model(tensor), 1000)())
    raw = redis.Redis.from_url(f"redis://{address}")
    raw.set("bench.raw.x", x.tobytes())
    worker_log = scratch / "raw_worker.log"
    with worker_log.open("wb") as log_file:  # the console stays clean; the log explains a failed start
        helpers = [
            subprocess.Popen([sys.executable, "-c", ECHO_SCRIPT, address]),
            subprocess.Popen([sys.executable, "-c", RAW_WORKER_SCRIPT, address,
                              *(str(scratch / f"{n}.pt") for n in blobs)], stderr=log_file),
        ]
    try:
        deadline = time.monotonic() + HELPER_START_TIMEOUT_S
        while not raw.exists("bench.raw.ready"):  # it imports torch and loads both models first
            if time.monotonic() > deadline or helpers[1].poll() is not None:
                raise RuntimeError(f"the raw redis-py worker did not start: {worker_log.read_text()[-2000:]}")
            time.sleep(0.1)
        loops = {}
        for name in blobs:
            ours, baseline = (lambda name=name: client.run_model(f"bench.{name}", ["bench.x"], ["bench.y"])), \
                _raw_run(raw, name)
            for _ in range(10):
                ours()
                baseline()
            loops[name], loops[f"raw {name}"] = _latencies(ours, calls), _latencies(baseline, calls)
            if published is not None:
                theirs = functools.partial(published.run_model, f"bench.{name}", ["bench.x"], ["bench.y"])
                for _ in range(10):
                    theirs()
                loops[f"published {name}"] = _latencies(theirs, calls)
            if module_client is not None:
                loops[f"module {name}"] = _latencies(
                    functools.partial(module_client.run_model, f"bench.{name}", ["bench.x"], ["bench.y"]), calls)
        ask = _echo(raw)
        for _ in range(10):
            ask()
        loops["floor"] = _latencies(ask, calls)
        results = {name: [] for name in loops}
        for _ in range(rounds):
            for name, loop in loops.items():
                results[name].extend(loop())
    finally:
        for helper in helpers:
            helper.kill()
            helper.wait()
        raw.close()
    floor_ms = statistics.median(results["floor"]) * 1e3
    rows = []
    for name in blobs:
        overhead_ms = (statistics.median(results[name]) - forward) * 1e3
        baseline_ms = (statistics.median(results[f"raw {name}"]) - forward) * 1e3
        published_ms = (statistics.median(results[f"published {name}"]) - forward) * 1e3 \
            if f"published {name}" in results else None
        r_base, r_floor = ratio(overhead_ms, baseline_ms), ratio(overhead_ms, floor_ms)
        r_published = ratio(published_ms, overhead_ms)
        ok = r_base is not None and r_base <= RAW_WORKER_BAR and r_floor is not None and r_floor <= FLOOR_BAR
        bars = [f"<= {RAW_WORKER_BAR}x baseline", f"<= {FLOOR_BAR}x floor"]
        if published_ms is not None:
            bars.append(f"SmartRedis <= {PUBLISHED_RUN_BAR}x ours")
            ok = ok and r_published is not None and r_published <= PUBLISHED_RUN_BAR
        rows.append({
            "metric": f"run_model tiny model ({name}): median overhead over forward, lower is better (baseline: "
                      "hand-rolled redis-py worker; ceiling: bare redis-py echo via another process)",
            "ours": overhead_ms, "baseline": baseline_ms, "ceiling": floor_ms, "unit": "ms",
            "ratio": r_base, "ratio_ceiling": r_floor, "published": published_ms, "ratio_published": r_published,
            "forward_ms": forward * 1e3, "spread": f"p90 {np.percentile(results[name], 90) * 1e3:.3f} ms",
            "bar": "; ".join(bars), "ok": ok, "under_0.5_ms": overhead_ms <= OVERHEAD_BAR_MS,
        })
    for name in blobs:
        if f"module {name}" not in results:
            continue
        external_ms = (statistics.median(results[name]) - forward) * 1e3
        module_ms = (statistics.median(results[f"module {name}"]) - forward) * 1e3
        r_external = ratio(module_ms, external_ms)
        rows.append({
            "metric": f"run_model tiny model ({name}), worker started by the Redis module (WORKERS 1): median "
                      "overhead over forward, lower is better (baseline: the external worker, python -m "
                      "smartredis_io.worker, in the same rounds; ceiling: bare redis-py echo)",
            "ours": module_ms, "baseline": external_ms, "ceiling": floor_ms, "unit": "ms",
            "ratio": r_external, "ratio_ceiling": ratio(module_ms, floor_ms), "forward_ms": forward * 1e3,
            "spread": f"p90 {np.percentile(results[f'module {name}'], 90) * 1e3:.3f} ms",
            "bar": f"<= {MODULE_WORKER_BAR}x external worker",
            "ok": r_external is not None and r_external <= MODULE_WORKER_BAR,
        })
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.smartredis_client",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES,
                        help="tensor sizes in bytes for the put+unpack loop (multiples of 4); default: 1 KiB "
                             "8 KiB 128 KiB 1 MiB")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help="rounds in which the compared loops take turns (the median is reported); "
                             "default: %(default)s")
    parser.add_argument("--calls", type=int, default=DEFAULT_CALLS,
                        help="run_model calls per format per round; default: %(default)s")
    parser.add_argument("--no-cluster", action="store_true", help="skip the 3-shard cluster rows")
    parser.add_argument("--no-published", action="store_true",
                        help="leave out the published SmartRedis client (measured when it is installed)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if any(size <= 0 or size % 4 for size in args.sizes):
        parser.error(f"--sizes must be positive multiples of 4, got {args.sizes}")
    configure_logging(logging.INFO)
    if (server := start_servers_reaching_python()) is not None:
        log.info("redis-server runs through %s: the Redis module's workers (%s) may not search this Python's "
                 "directories", server, WORKER_USER)
    rows = []
    published = not args.no_published and published_available()
    if not published:
        log.warning("the published SmartRedis client is not measured (pip install smartredis==0.6.1)")
    with Orchestrator(shards=1, workers=1) as orchestrator, Client(False, orchestrator.address) as client:
        raw = raw_client(orchestrator.address)
        theirs = published_client(orchestrator.address, cluster=False) if published else None
        rows += [throughput(client, raw, size, "standalone", args.rounds, theirs) for size in args.sizes]
        rows.append(copies(client, raw))
        raw.close()
        with tempfile.TemporaryDirectory(prefix="bench-models-") as scratch, \
                RedisServer(module_args=module_worker_args()) as module_server, \
                Client(False, module_server.address) as module_client:
            rows += run_model_overhead(client, orchestrator.address, args.calls, args.rounds, Path(scratch), theirs,
                                       module_client)
    if not args.no_cluster:
        with RedisCluster(shards=3) as cluster, Client(True, cluster.address) as client:
            raw = raw_client(cluster.address, cluster=True)
            theirs = published_client(cluster.address, cluster=True) if published else None
            rows[len(args.sizes):len(args.sizes)] = [
                throughput(client, raw, size, "cluster x3", args.rounds, theirs) for size in args.sizes
            ]
            raw.close()
    sys.stdout.write(format_table(rows, COLUMNS) + "\n")
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
