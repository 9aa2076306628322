"""Data aggregation scaling: producers fill an aggregation list, one consumer drains it.

As SmartSim-Scaling's ``aggregation_producer.cpp`` / ``aggregation_consumer.py``: each producer rank puts a
dataset of ``tensors_per_dataset`` float32 tensors of ``tensor_bytes`` bytes once, then per
iteration appends it to the list ``iteration_i`` (rank 0 first waits until the consumer has
deleted the previous list). The consumer, with ``client_threads`` client threads, polls until the
list holds one dataset per producer (``poll_list``), reads them all (``get_list``:
``get_datasets_from_list``, or with several threads one ``get_dataset_list_range`` slice each) and
deletes the list. Where the published SmartRedis package is installed, the iterations are split
in rounds that alternate between smartredis_io and the published client at both ends (timings
``smartredis_FUNCTION`` for the latter, with lists and datasets of their own).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.smartsim_scaling.launch import (
    BARRIER_TIMEOUT_S,
    NAME_TAGS,
    PUBLISHED,
    App,
    Comm,
    Deployment,
    Sweep,
    Timings,
    published_available,
    published_client,
    published_dataset,
)
from benchmarks.smartsim_scaling.options import add_int_list, tensor_bytes
from benchmarks.smartsim_scaling.results import derived, read_timings

COMMAND = "aggregation"
POLL_FREQUENCY_MS = 5
ROUNDS = 4  # smartredis_io and the published client take turns this many times
PRODUCER_WAIT_S = 0.002
HELP = "producers put_dataset + append_to_list; one consumer poll_list_length + get_datasets_from_list"
DESCRIPTION = f"""{HELP}.

Each permutation of --client_nodes x --clients_per_node (producers) x --tensor_bytes x
--tensors_per_dataset x --client_threads x --db_nodes is one run directory under --exp_dir. The
consumer's timings are rank_0_timing.csv (client(), poll_list, get_list, loop_time); the producers'
are producer_rank_N_timing.csv (client(), put_dataset, append_to_list)."""
TABLE = {
    "db_nodes": "db", "producers": "producers", "tensors_per_dataset": "tensors/ds",
    "tensor_bytes": "bytes", "client_threads": "threads", "get_list_ms": "get_list ms",
    "poll_list_ms": "poll_list ms", "get_list_gbps": "get_list GB/s",
    "smartredis_get_list_ms": "SmartRedis get_list ms",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_int_list(parser, "--client_nodes", default=[1],
                 help="producer nodes (on one machine: multiplies the producer count); default: 1")
    add_int_list(parser, "--clients_per_node", default=[4],
                 help="producer processes per node; default: 4")
    add_int_list(parser, "--db_nodes", default=[1],
                 help="database shards: 1 = standalone, >= 3 = Redis Cluster; default: 1")
    add_int_list(parser, "--tensor_bytes", default=[1024, 65536, 1048576],
                 help="tensor sizes in bytes (multiples of 4); default: 1024 65536 1048576")
    add_int_list(parser, "--tensors_per_dataset", default=[1, 2, 4],
                 help="tensors in each dataset; default: 1 2 4")
    add_int_list(parser, "--client_threads", default=[1, 2, 4],
                 help="consumer client threads (each reads a slice of the list); default: 1 2 4")
    parser.add_argument("--iterations", type=int, default=20,
                        help="aggregation lists produced and consumed; default: 20 (SmartSim-Scaling's)")


def build_sweep(args: argparse.Namespace) -> Sweep:
    permutations = [
        {"client_nodes": n, "clients_per_node": c, "producers": n * c, "clients": n * c + 1,
         "tensor_bytes": b, "tensors_per_dataset": t, "client_threads": thr, "iterations": args.iterations}
        for n, c, b, t, thr in itertools.product(args.client_nodes, args.clients_per_node, tensor_bytes(args.tensor_bytes),
                                                 args.tensors_per_dataset, args.client_threads)
    ]
    return Sweep(
        command=COMMAND,
        deployments=[{"db_nodes": d} for d in args.db_nodes],
        permutations=permutations,
        prepare=_apps,
        summarize=summarize,
        name_keys={**NAME_TAGS, "tensors_per_dataset": "TPD", "client_threads": "THR"},
    )


def _apps(dep: Deployment, attributes: dict[str, Any], run_dir: Path) -> list[App]:
    common = {"address": dep.address, "cluster": dep.cluster, "iterations": attributes["iterations"],
              "list_prefix": f"{run_dir.name}.iteration_", "published": published_available()}
    producer = {**common, "tensor_bytes": attributes["tensor_bytes"],
                "tensors_per_dataset": attributes["tensors_per_dataset"],
                "dataset_prefix": f"{run_dir.name}.aggregation_rank_"}
    consumer = {**common, "list_length": attributes["producers"], "client_threads": attributes["client_threads"]}
    return [
        App("producer", f"{__name__}:producer", attributes["producers"], producer, prefix="producer_",
            nodes=attributes["client_nodes"]),
        App("consumer", f"{__name__}:consumer", 1, consumer),
    ]


def summarize(run_dir: Path, attributes: dict[str, Any]) -> dict[str, Any]:
    times = read_timings(run_dir)
    row = {k: attributes[k] for k in ("db_nodes", "producers", "tensors_per_dataset", "tensor_bytes",
                                      "client_threads")}
    for function in ("get_list", "poll_list", PUBLISHED + "get_list", PUBLISHED + "poll_list"):
        if times.get(function):
            row[f"{function}_ms"] = float(np.median(times[function])) * 1e3
    return {**row, **derived(attributes, times)}


def schedule(iterations: int, published: bool) -> list[str]:
    """The library of each iteration: ``""`` (smartredis_io) or ``PUBLISHED``, in rounds that alternate."""
    libraries = ["", PUBLISHED] if published else [""]
    rounds = max(1, min(ROUNDS * len(libraries), iterations))
    sizes = [iterations // rounds + (r < iterations % rounds) for r in range(rounds)]
    return [libraries[r % len(libraries)] for r, size in enumerate(sizes) for _ in range(size)]


def _connect(params: Mapping[str, Any], timings: Timings, library: str = ""):
    start = time.perf_counter()
    if library:
        client = published_client(params["address"], params["cluster"])
    else:
        from smartredis_io import Client

        client = Client(params["cluster"], params["address"])
    timings.add(f"{library}client()", time.perf_counter() - start)
    return client


def producer(comm: Comm, params: Mapping[str, Any], timings: Timings) -> None:
    """One producer rank (SmartSim-Scaling's ``run_aggregation_production``)."""
    from smartredis_io import Dataset

    plan = schedule(params["iterations"], params.get("published", False))
    clients, datasets = {}, {}
    for library in dict.fromkeys(plan):
        clients[library] = _connect(params, timings, library)
    comm.barrier()
    array = np.arange(params["tensor_bytes"] // 4, dtype=np.float32)
    for library, client in clients.items():
        name = f"{params['dataset_prefix']}{library}{comm.rank}"
        dataset = published_dataset(name) if library else Dataset(name)
        for j in range(params["tensors_per_dataset"]):
            dataset.add_tensor(f"tensor_{j}", array)
        start = time.perf_counter()
        client.put_dataset(dataset)
        timings.add(f"{library}put_dataset", time.perf_counter() - start)
        datasets[library] = dataset

    prefix = params["list_prefix"]
    for i, library in enumerate(plan):
        # Rank 0 holds everyone back until the consumer has deleted the previous list.
        if comm.rank == 0 and i:
            previous = clients[plan[i - 1]]
            deadline = time.monotonic() + BARRIER_TIMEOUT_S
            while previous.get_list_length(f"{prefix}{plan[i - 1]}{i - 1}") != 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the consumer never consumed list {prefix}{plan[i - 1]}{i - 1}")
                time.sleep(PRODUCER_WAIT_S)
        comm.barrier()
        start = time.perf_counter()
        clients[library].append_to_list(f"{prefix}{library}{i}", datasets[library])
        timings.add(f"{library}append_to_list", time.perf_counter() - start)


def _slices(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous inclusive index ranges covering ``0..length-1`` (none empty)."""
    parts = max(1, min(parts, length))
    bounds = [length * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1] - 1) for k in range(parts)]


def consumer(comm: Comm, params: Mapping[str, Any], timings: Timings) -> None:
    """The consumer (SmartSim-Scaling's ``run_aggregation_consumer``), with ``client_threads`` client threads.

    SmartRedis sizes its client's thread pool from ``SR_THR_COUNT`` (the published client uses it);
    ``smartredis_io`` has no such pool, so with more than one thread the consumer fans the list out
    itself: one client per thread, each reading a contiguous slice with ``get_dataset_list_range``,
    all timed as ``get_list``.
    """
    threads = params["client_threads"]
    os.environ["SR_THR_COUNT"] = str(threads)
    plan = schedule(params["iterations"], params.get("published", False))
    client = _connect(params, timings)
    published = _connect(params, timings, PUBLISHED) if PUBLISHED in plan else None
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    clients = [client] + [_connect(params, timings) for _ in range(threads - 1)]
    comm.barrier()
    prefix, length = params["list_prefix"], params["list_length"]
    num_tries = int(BARRIER_TIMEOUT_S * 1000 / POLL_FREQUENCY_MS)
    clock = time.perf_counter
    seconds = dict.fromkeys(plan, 0.0)
    for i, library in enumerate(plan):
        name = f"{prefix}{library}{i}"
        reader = published if library else client
        t0 = clock()
        if not reader.poll_list_length(name, length, POLL_FREQUENCY_MS, num_tries):
            raise TimeoutError(f"aggregation list {name} never reached length {length}")
        t1 = clock()
        if pool is None or library:
            datasets = reader.get_datasets_from_list(name)
        else:
            ranges = _slices(length, threads)
            parts = pool.map(lambda c, r, n=name: c.get_dataset_list_range(n, *r), clients, ranges)
            datasets = [d for part in parts for d in part]
        t2 = clock()
        if len(datasets) != length:
            raise AssertionError(f"{name}: {len(datasets)} datasets, expected {length}")
        timings.add(f"{library}poll_list", t1 - t0)
        timings.add(f"{library}get_list", t2 - t1)
        reader.delete_list(name)
        seconds[library] += clock() - t0
    for library, total in seconds.items():
        timings.add(f"{library}loop_time", total)
    if pool is not None:
        pool.shutdown()
