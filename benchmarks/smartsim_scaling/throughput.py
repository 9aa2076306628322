"""Throughput scaling: each client loops ``put_tensor`` + ``unpack_tensor`` of one float32 tensor.

As SmartSim-Scaling's ``throughput_scaling.cpp``: every rank connects (``client()``), then runs
``iterations`` x (``put_tensor`` of a tensor of ``tensor_bytes`` bytes under its own key, then
``unpack_tensor`` into a preallocated array), recording each call and the ``loop_time``. In the
same processes, against the same server, the same loop with raw redis-py ``SET``/``GET`` of the
same bytes is the ceiling (``redis_set``, ``redis_get``, ``redis_loop_time``), and where the
published SmartRedis package is installed its client runs the same loop through the smartredis_io
Redis module (``smartredis_put_tensor``, ``smartredis_unpack_tensor``, ``smartredis_loop_time``); the
loops take turns in rounds so that all see the same load on a shared machine.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.smartsim_scaling.launch import (
    NAME_TAGS,
    PUBLISHED,
    App,
    Comm,
    Deployment,
    Sweep,
    Timings,
    published_available,
    published_client,
    raw_client,
)
from benchmarks.smartsim_scaling.options import add_int_list, tensor_bytes
from benchmarks.smartsim_scaling.results import derived, read_timings

COMMAND = "throughput"
# SmartSim-Scaling's sizes (1 KiB to 4 MiB) and iterations: the default sweep (11 sizes x {1, 4} clients x
# {standalone, 3-shard cluster}) takes about 2 minutes on this 2-core machine.
DEFAULT_TENSOR_BYTES = [1024, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576, 2097152, 4194304]
DEFAULT_ITERATIONS = 100
ROUNDS = 4  # our loop and the redis-py loop take turns this many times
Loop = tuple[list[float], list[float], float]  # put times, get times, loop wall time
HELP = "put_tensor + unpack_tensor loop against tensor size and client count, with the redis-py ceiling"
DESCRIPTION = f"""{HELP}.

Each permutation of --client_nodes x --clients_per_node x --tensor_bytes x --db_nodes is one run
directory under --exp_dir. GB/s is SmartSim-Scaling's aggregate throughput: tensor_bytes x iterations /
loop_time summed over clients (each iteration moves the bytes twice, put and get). The ceiling is
raw redis-py SET + GET of the same bytes in the same processes, taking turns with our loop in
{ROUNDS} rounds, with the published SmartRedis client (0.6.1, when installed) as a third loop;
redis-py sends the value without copying it (its pure-Python packer: the hiredis
one copies large values at ~0.1 GB/s). The default sweep is SmartSim-Scaling's tensor sizes and 100
iterations with 1 and 4 clients on a standalone server and a 3-shard cluster: about 2 minutes on
2 cores, well under 10."""
TABLE = {
    "db_nodes": "db", "clients": "clients", "tensor_bytes": "bytes", "loop_ms_per_iter": "ms/iter",
    "throughput_gbps": "GB/s", "redis_gbps": "redis-py GB/s", "ratio_to_redis": "ratio",
    "smartredis_gbps": "SmartRedis GB/s", "smartredis_to_ours": "SmartRedis/ours",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_int_list(parser, "--client_nodes", default=[1],
                 help="client nodes (on one machine: multiplies the process count); default: 1")
    add_int_list(parser, "--clients_per_node", default=[1, 4],
                 help="client processes per node; default: 1 4")
    add_int_list(parser, "--db_nodes", default=[1, 3],
                 help="database shards: 1 = standalone, >= 3 = Redis Cluster; default: 1 3")
    add_int_list(parser, "--tensor_bytes", default=DEFAULT_TENSOR_BYTES,
                 help="tensor sizes in bytes (multiples of 4); default: SmartSim-Scaling's 1 KiB .. 4 MiB")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS,
                        help=f"put/unpack loops per client; default: {DEFAULT_ITERATIONS}")


def build_sweep(args: argparse.Namespace) -> Sweep:
    permutations = [
        {"client_nodes": n, "clients_per_node": c, "clients": n * c, "tensor_bytes": b,
         "iterations": args.iterations}
        for n, c, b in itertools.product(args.client_nodes, args.clients_per_node, tensor_bytes(args.tensor_bytes))
    ]
    return Sweep(
        command=COMMAND,
        deployments=[{"db_nodes": d} for d in args.db_nodes],
        permutations=permutations,
        prepare=_apps,
        summarize=summarize,
        name_keys=NAME_TAGS,
    )


def _apps(dep: Deployment, attributes: dict[str, Any], run_dir: Path) -> list[App]:
    params = {"address": dep.address, "cluster": dep.cluster, "tensor_bytes": attributes["tensor_bytes"],
              "iterations": attributes["iterations"], "key_prefix": f"{run_dir.name}.",
              "published": published_available()}
    return [App("clients", f"{__name__}:throughput_client", attributes["clients"], params,
                nodes=attributes["client_nodes"])]


def summarize(run_dir: Path, attributes: dict[str, Any]) -> dict[str, Any]:
    return {**{k: attributes[k] for k in ("db_nodes", "clients", "tensor_bytes")},
            **derived(attributes, read_timings(run_dir))}


def _timed_loop(iterations: int, put: Callable[[], object], get: Callable[[], object]) -> Loop:
    puts, gets = [], []
    clock = time.perf_counter
    loop_start = clock()
    for _ in range(iterations):
        t0 = clock()
        put()
        t1 = clock()
        get()
        t2 = clock()
        puts.append(t1 - t0)
        gets.append(t2 - t1)
    return puts, gets, clock() - loop_start


def alternating_loops(comm: Comm, iterations: int, loops: Sequence[tuple[Callable, Callable]],
                      rounds: int = ROUNDS) -> list[Loop]:
    """Each loop's ``iterations`` x (put, get), timed call by call, in ``rounds`` alternating rounds.

    Every loop first runs one untimed pair (it opens redis-py's lazy connections: SmartSim-Scaling's C++
    client connects in its constructor, timed as ``client()``). Then the loops take turns, all ranks
    together (a barrier before each turn), so that on a shared machine both see the same load; a
    loop's time is the sum of its rounds' wall times.
    """
    for put, get in loops:
        put()
        get()
    rounds = max(1, min(rounds, iterations))
    sizes = [iterations // rounds + (r < iterations % rounds) for r in range(rounds)]
    puts: list[list[float]] = [[] for _ in loops]
    gets: list[list[float]] = [[] for _ in loops]
    seconds = [0.0 for _ in loops]
    for n in sizes:
        for i, (put, get) in enumerate(loops):
            comm.barrier()
            p, g, t = _timed_loop(n, put, get)
            puts[i] += p
            gets[i] += g
            seconds[i] += t
    return list(zip(puts, gets, seconds, strict=True))


def throughput_client(comm: Comm, params: Mapping[str, Any], timings: Timings) -> None:
    """One rank of the throughput application (SmartSim-Scaling's ``run_throughput``), and its ceiling."""
    from smartredis_io import Client

    start = time.perf_counter()
    client = Client(params["cluster"], params["address"])
    timings.add("client()", time.perf_counter() - start)
    comm.barrier()

    array = np.arange(params["tensor_bytes"] // 4, dtype=np.float32)
    result = np.zeros_like(array)
    key = f"{params['key_prefix']}throughput_rank_{comm.rank}"
    # The ceiling: raw redis-py SET + GET of the same bytes, same server, same ranks, same run.
    raw = raw_client(params["address"], params["cluster"])
    payload = array.tobytes()
    raw_key = f"{key}.raw"
    loops = [
        (lambda: client.put_tensor(key, array), lambda: client.unpack_tensor(key, result)),
        (lambda: raw.set(raw_key, payload), lambda: raw.get(raw_key)),
    ]
    names = [("put_tensor", "unpack_tensor", "loop_time"), ("redis_set", "redis_get", "redis_loop_time")]
    published = published_client(params["address"], params["cluster"]) if params.get("published") else None
    published_key, published_result = f"{key}.published", np.zeros_like(array)
    if published is not None:
        # its Python client has no unpack_tensor (a C++ call): get_tensor returns a new array
        loops.append((lambda: published.put_tensor(published_key, array),
                      lambda: published_result.__setitem__(Ellipsis, published.get_tensor(published_key))))
        names.append(tuple(PUBLISHED + name for name in names[0]))
    # Keys are overwritten each iteration, as in SmartSim-Scaling, so that memory stays flat.
    measured = alternating_loops(comm, params["iterations"], loops)
    if not np.array_equal(result, array) or (published is not None and not np.array_equal(published_result, array)):
        raise AssertionError(f"rank {comm.rank}: unpack_tensor returned other values than were put")
    for (puts, gets, seconds), (put_name, get_name, loop_name) in zip(measured, names, strict=True):
        timings.extend(put_name, puts)
        timings.extend(get_name, gets)
        timings.add(loop_name, seconds)
    client.delete_tensor(key)
    if published is not None:
        published.delete_tensor(published_key)
    raw.delete(raw_key)
    raw.close()
    comm.barrier()
