"""Inference scaling: put an image batch, preprocess it with a script, run the model, read the result.

As SmartSim-Scaling's ``inference_scaling_imagenet.cpp``: the model (random weights, built in
:mod:`.models`, serialized with ``torch.export`` unless ``--model_format torchscript``) and the preprocessing script are set once per run with ``set_model(...,
batch_size=BATCH_SIZE)`` so that the execution workers batch concurrent requests as RedisAI does;
each client then does one warm-up and ``iterations`` x (``put_tensor`` of an NHWC float32 image
batch, ``run_script`` preprocessing, ``run_model``, ``unpack_tensor`` of the logits into a
preallocated array), recording each step and the ``loop_time``. Where the published SmartRedis
package is installed, each client also runs the same loop with its client (its own copy of the
model and script, set by it, as its cluster mode expects), the two taking turns in rounds; those
timings are ``smartredis_STEP`` and ``smartredis_loop_time``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.smartsim_scaling.launch import (
    PUBLISHED,
    App,
    Comm,
    Deployment,
    Sweep,
    Timings,
    published_available,
    published_client,
)
from benchmarks.smartsim_scaling.options import NUM_CLASSES, add_int_list, device
from benchmarks.smartsim_scaling.results import derived, read_timings

COMMAND = "inference"
ROUNDS = 4  # our client and the published one take turns this many times
STEPS = ("put_tensor", "run_script", "run_model", "unpack_tensor")
SCRIPT_KEY = "scaling_preprocess_script"
# TorchScript source run by the execution workers: NHWC images in 0..255 to normalised NCHW.
PREPROCESS_FN = "pre_process_3ch"
PREPROCESS_SCRIPT = """
def pre_process_3ch(images):
    x = images.float().div(255.0).permute(0, 3, 1, 2).contiguous()
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std
"""
HELP = "put_tensor, run_script, run_model, unpack_tensor latency against clients, batch size and workers"
DESCRIPTION = f"""{HELP}.

Each permutation of --clients x --batch_size x --workers x --db_nodes is one run directory under
--exp_dir. The model is built from code with random weights: 'cnn' (default, a small CNN that keeps
a CPU run short) or 'resnet50' (torchvision's architecture, written out here). --batch_size is the
server-side batch the model is set with (requests of --images_per_request images are batched up to
it); --workers execution worker processes run scripts and models. --colocated serves the clients
on a Unix-domain socket (the one-machine analogue of SmartSim's colocated database)."""
TABLE = {
    "db_nodes": "db", "colocated": "colocated", "workers": "workers", "clients": "clients", "batch_size": "batch",
    "put_tensor_ms": "put ms", "run_script_ms": "script ms", "run_model_ms": "model ms",
    "unpack_tensor_ms": "unpack ms", "loop_ms_per_iter": "ms/iter", "inferences_per_s": "images/s",
    "smartredis_run_model_ms": "SmartRedis model ms", "smartredis_loop_ms_per_iter": "SmartRedis ms/iter",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_int_list(parser, "--clients", default=[1, 2], help="client processes; default: 1 2")
    add_int_list(parser, "--client_nodes", "--nodes", default=[1],
                 help="the driver's client nodes (--nodes for inference_colocated); with --clients_per_node "
                      "the clients are nodes x clients per node; default: 1")
    add_int_list(parser, "--clients_per_node", default=None,
                 help="the driver's client tasks per node; given, it replaces --clients")
    add_int_list(parser, "--batch_size", default=[1],
                 help="batch size the model is set with (worker-side batching); default: 1")
    add_int_list(parser, "--workers", default=[1], help="execution worker processes; default: 1")
    add_int_list(parser, "--db_nodes", default=[1],
                 help="database shards: 1 = standalone, >= 3 = Redis Cluster; default: 1")
    parser.add_argument("--model", choices=["cnn", "resnet50"], default="cnn",
                        help="model built from code with random weights; default: cnn")
    parser.add_argument("--model_format", choices=["export", "torchscript"], default="export",
                        help="how the model is serialized for set_model: torch.export (export) or TorchScript; "
                             "default: export")
    parser.add_argument("--device", type=device, default="cpu", metavar="{cpu,cuda}",
                        help="device the workers run the model on (the driver's CPU and GPU work too); default: cpu")
    parser.add_argument("--images_per_request", type=int, default=1, help="images per put_tensor; default: 1")
    parser.add_argument("--image_size", type=int, default=224, help="image height and width; default: 224")
    parser.add_argument("--iterations", type=int, default=100,
                        help="measured iterations per client, after one warm-up; default: 100")
    parser.add_argument("--colocated", action="store_true",
                        help="clients and workers on the database's Unix-domain socket (standalone only); with "
                             "--launcher slurm, a database on each client node, on its loopback (inference_colocated)")


def build_sweep(args: argparse.Namespace) -> Sweep:
    if args.clients_per_node:
        placements = [(n, n * c) for n, c in itertools.product(args.client_nodes, args.clients_per_node)]
    else:  # --clients: the total, spread over --client_nodes where a workload manager places them
        placements = list(itertools.product(args.client_nodes, args.clients))
    crowded = [(n, c) for n, c in placements if c < n]
    if crowded:
        raise SystemExit(f"fewer clients than client nodes (nodes, clients): {crowded}")
    permutations = [
        {"client_nodes": n, "clients": c, "batch_size": b, "model": args.model, "model_format": args.model_format,
         "device": args.device,
         "images_per_request": args.images_per_request, "image_size": args.image_size,
         "iterations": args.iterations}
        for (n, c), b in itertools.product(placements, args.batch_size)
    ]
    return Sweep(
        command=COMMAND,
        deployments=[{"db_nodes": d, "workers": w} for d, w in itertools.product(args.db_nodes, args.workers)],
        permutations=permutations,
        prepare=_prepare,
        summarize=summarize,
        name_keys={"model": "", "clients": "C", "db_nodes": "DBN", "workers": "W", "batch_size": "BS",
                   "iterations": "ITER"},
        device=args.device,
        colocated=args.colocated,
    )


def _prepare(dep: Deployment, attributes: dict[str, Any], run_dir: Path) -> list[App]:
    """Set the model and the script: here, before the clients start (SmartSim-Scaling's rank 0 does it), or,
    for databases colocated with the application's nodes, by the first client rank of each node."""
    model_format = attributes.get("model_format", "export")
    store = {
        "model": attributes["model"], "image_size": attributes["image_size"], "model_format": model_format,
        "batch_size": attributes["batch_size"], "device": "GPU" if attributes["device"] == "cuda" else "CPU",
        "model_key": f"scaling_{attributes['model']}_{model_format}_bs{attributes['batch_size']}",
        # the published client has no socket-path form
        "published": published_available() and not (dep.address or "").startswith("unix://"),
    }
    if dep.address is not None:
        from smartredis_io import Client

        theirs = published_client(dep.address, dep.cluster) if store["published"] else None
        store_model_and_script(Client(dep.cluster, dep.address), theirs, store)
    params = {
        "address": dep.address, "cluster": dep.cluster, "model_key": store["model_key"], "script_key": SCRIPT_KEY,
        "images_per_request": attributes["images_per_request"], "image_size": attributes["image_size"],
        "iterations": attributes["iterations"], "key_prefix": f"{run_dir.name}.", "published": store["published"],
        "store_per_node": store if dep.address is None else None,
    }
    return [App("clients", f"{__name__}:inference_client", attributes["clients"], params,
                nodes=attributes.get("client_nodes", 1))]


def store_model_and_script(ours: Any, theirs: Any, store: Mapping[str, Any]) -> None:
    """Set the model (built from code, random weights) and the preprocessing script with our client, and
    with the published one (``theirs``, its own copies) unless it is None."""
    from benchmarks.smartsim_scaling.models import model_bytes

    model = model_bytes(store["model"], store["image_size"], store["model_format"])
    for client, suffix in ((ours, ""), *(((theirs, ".published"),) if theirs is not None else ())):
        client.set_model(store["model_key"] + suffix, model, "TORCH", store["device"], batch_size=store["batch_size"])
        client.set_script(SCRIPT_KEY + suffix, PREPROCESS_SCRIPT, store["device"])


def _first_on_node(comm: Comm) -> bool:
    """Whether this rank is the first of its node (Slurm's ``SLURM_LOCALID``; rank 0 without Slurm)."""
    return int(os.environ.get("SLURM_LOCALID", comm.rank)) == 0


def summarize(run_dir: Path, attributes: dict[str, Any]) -> dict[str, Any]:
    times = read_timings(run_dir)
    row = {k: attributes[k] for k in ("db_nodes", "colocated", "workers", "clients", "batch_size")}
    for step in (*STEPS, *(PUBLISHED + step for step in STEPS)):
        if times.get(step):
            row[f"{step}_ms"] = float(np.median(times[step])) * 1e3
    if times.get("loop_time"):
        images = attributes["images_per_request"] * attributes["iterations"]
        row["inferences_per_s"] = sum(images / t for t in times["loop_time"])
    return {**row, **derived(attributes, times)}


def inference_client(comm: Comm, params: Mapping[str, Any], timings: Timings) -> None:
    """One client rank (SmartSim-Scaling's ``run_mnist``): one warm-up, then the measured iterations."""
    from smartredis_io import Client

    start = time.perf_counter()
    client = Client(params["cluster"], params["address"])  # address None: SSDB, the node's colocated database
    timings.add("client()", time.perf_counter() - start)
    theirs = published_client(params["address"], params["cluster"]) if params.get("published") else None
    if params.get("store_per_node") and _first_on_node(comm):
        store_model_and_script(client, theirs, params["store_per_node"])
    comm.barrier()

    n, size = params["images_per_request"], params["image_size"]
    images = np.random.default_rng(comm.rank).uniform(0, 255, (n, size, size, 3)).astype(np.float32)
    loops = [("", _steps(client, params, f"{params['key_prefix']}rank_{comm.rank}", "", images))]
    if theirs is not None:
        loops.append((PUBLISHED, _steps(theirs, params, f"{params['key_prefix']}rank_{comm.rank}.published",
                                        ".published", images)))
    for _, (steps, _, _) in loops:  # warm-up: loads the model and script into the workers; not recorded
        for step in steps:
            step()
    comm.barrier()

    clock = time.perf_counter
    rounds = max(1, min(ROUNDS, params["iterations"]))
    sizes = [params["iterations"] // rounds + (r < params["iterations"] % rounds) for r in range(rounds)]
    samples = {prefix: [[] for _ in STEPS] for prefix, _ in loops}
    seconds = dict.fromkeys(samples, 0.0)
    for count in sizes:
        for prefix, (steps, _, _) in loops:
            comm.barrier()  # the clients take turns, every rank together
            loop_start = clock()
            for _ in range(count):
                for step, times in zip(steps, samples[prefix], strict=True):
                    t0 = clock()
                    step()
                    times.append(clock() - t0)
            seconds[prefix] += clock() - loop_start
    for prefix, (_, result, cleanup) in loops:
        if not np.isfinite(result).all():
            raise AssertionError(f"rank {comm.rank}: the model returned non-finite logits")
        timings.add(f"{prefix}loop_time", seconds[prefix])
        for name, times in zip(STEPS, samples[prefix], strict=True):
            timings.extend(f"{prefix}{name}", times)
        cleanup()
    comm.barrier()


def _steps(client: Any, params: Mapping[str, Any], prefix: str, suffix: str, images: np.ndarray) -> tuple:
    """One iteration's steps with ``client`` (either library: they share SmartRedis's API), the logits
    array they fill, and the clean-up of their keys (per rank, overwritten each iteration: SmartSim-Scaling
    makes one per iteration; this keeps memory flat)."""
    result = np.empty((images.shape[0], NUM_CLASSES), dtype=np.float32)
    in_key, pre_key, out_key = f"{prefix}.input", f"{prefix}.preprocessed", f"{prefix}.output"
    steps = (
        lambda: client.put_tensor(in_key, images),
        lambda: client.run_script(params["script_key"] + suffix, PREPROCESS_FN, [in_key], [pre_key]),
        lambda: client.run_model(params["model_key"] + suffix, [pre_key], [out_key]),
        (lambda: client.unpack_tensor(out_key, result)) if hasattr(client, "unpack_tensor")
        else (lambda: result.__setitem__(Ellipsis, client.get_tensor(out_key))),  # the published Python client
    )

    def cleanup() -> None:
        for key in (in_key, pre_key, out_key):
            client.delete_tensor(key)

    return steps, result, cleanup
