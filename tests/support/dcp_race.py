"""Two saves to one DCP checkpoint, released together round after round, in the ways users call DCP.

Each job is a real process (two ranks in a gloo group, in ``gloo`` mode) that saves its own state to
one path in every round; one ``multiprocessing.Barrier`` (the parent is a party) releases every
process of both jobs at once, and holds them while the parent checks the round:

* the checkpoint loads, whole, as the state of a save that reported success;
* a save that did not succeed failed with ``ConcurrentWriteError`` (on every rank);
* nothing else is left: the path holds ``.metadata`` and the files it names, no save lock, no
  temporary, part object or multipart upload.

Modes: ``script`` (a plain script, no process group: ``dcp.save``), ``async`` (the same through
``dcp.async_save``), ``gloo`` (two ranks in a gloo group, DTensors sharded over them). Storages:
``nvme`` (``FastPersistStorageWriter``), ``gs`` (``DatafluxStorageWriter`` on the emulator as users
start it, through the JSON API) and ``gs-xml`` (the XML multipart server in front, parts uploaded by
XML multipart). Processes fork from a server that imported torch once (``forkserver``), so a race
costs its rounds, not interpreter start-ups.

From a shell, every mode and storage with the save of the quick start (four tensors of 256 floats,
1 MiB parts, two workers, a 60 s deadline), on a local stack of its own::

    python -m tests.support.dcp_race --rounds 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import sys
import tempfile
import threading
import traceback
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_storage_plugins.services import die_with_parent, free_port
from tests.support.processes import forkserver_context

MODES = ("script", "async", "gloo")
STORAGES = ("nvme", "gs", "gs-xml")
JOBS = 2
TENSORS, ELEMENTS = 4, 256
CHUNK_SIZE = 1 << 20
WAIT_S = 120.0  # the longest a round may take before the race is called hung
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "dataflux_ckpt.dcp",
            "fastpersist.dcp"]


@dataclass(frozen=True)
class Stack:
    """Where a storage's race saves: ``root`` (a ``gs://`` prefix or an O_DIRECT directory), the
    endpoint ``STORAGE_EMULATOR_HOST`` names in the saving processes, and the bucket on it."""

    storage: str
    root: str
    endpoint: str = ""
    bucket: str = ""


@dataclass
class Tally:
    """What the rounds of one race ended in."""

    rounds: int = 0
    whole: int = 0  # rounds that ended in one whole checkpoint of a save that reported success
    lost: int = 0  # saves that failed with ConcurrentWriteError
    both_won: int = 0  # rounds in which the saves did not overlap and both succeeded, one after the other
    leftovers: int = 0  # rounds after which anything but the checkpoint was left
    problems: list[str] = field(default_factory=list)


def state(seed: int) -> dict[str, Any]:
    """What job ``seed`` saves: four float tensors of 256 elements, distinct for every seed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {f"t{index}": torch.randn(ELEMENTS, generator=generator) for index in range(TENSORS)}


def seed_of(job: int, round_: int) -> int:
    return 1000 * (round_ + 1) + job


def writer(stack: Stack, path: str, chunk_size: int) -> Any:
    """The storage writer a user would pass for ``stack``."""
    if stack.storage == "nvme":
        from fastpersist import FastPersistStorageWriter

        return FastPersistStorageWriter(path, io_buffer_mb=1)
    from dataflux_ckpt import DatafluxStorageWriter

    mode = {"upload_mode": "xml"} if stack.storage == "gs-xml" else {}
    return DatafluxStorageWriter(path, chunk_size=chunk_size, max_workers=2, deadline_s=60, **mode)


def _failure_kinds(err: BaseException) -> list[str]:
    """The class names of what made a save fail (each rank's, from a ``CheckpointException``), each
    with its bases, so that the parent can tell a ``ConcurrentWriteError`` from anything else."""
    failures = getattr(err, "failures", None)
    inner = [value[0] if isinstance(value, tuple) else value for value in failures.values()] if failures else [err]
    return sorted({"/".join(cls.__name__ for cls in type(exc).__mro__) for exc in inner})


# Saving processes -----------------------------------------------------------------------------------
def _job(spec: dict[str, Any], rank: int, barrier: Any, outcomes: Any) -> None:
    """One process of a job: in every round, wait for the release, save, report the outcome."""
    die_with_parent(signal.SIGKILL)
    os.environ.update(spec["environ"])
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # the no-group modes, on purpose
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        stack, mode = Stack(**spec["stack"]), spec["mode"]
        mesh = None
        if mode == "gloo":
            from torch.distributed.device_mesh import init_device_mesh

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                                    world_size=spec["world"], timeout=timedelta(seconds=WAIT_S))
            mesh = init_device_mesh("cpu", (spec["world"],))
        for round_ in range(spec["rounds"]):
            saved = state(seed_of(spec["job"], round_))
            if mesh is not None:
                from torch.distributed.tensor import Shard, distribute_tensor

                saved = {key: distribute_tensor(value, mesh, [Shard(0)]) for key, value in saved.items()}
            storage_writer = writer(stack, spec["path"], spec["chunk_size"])
            barrier.wait(WAIT_S)
            try:
                if mode == "async":
                    future = dcp.async_save(saved, storage_writer=storage_writer)
                    getattr(future, "upload_completion", future).result(WAIT_S)  # newer torch: a response
                else:
                    dcp.save(saved, storage_writer=storage_writer)
                outcome: dict[str, Any] = {"ok": True}
            except (Exception, dcp.CheckpointException) as err:  # DCP's is a BaseException
                lines = [line for line in str(err).splitlines() if line.strip()]
                outcome = {"ok": False, "errors": _failure_kinds(err), "text": lines[-1][-300:] if lines else ""}
            outcomes.put((round_, spec["job"], rank, outcome))
    except BaseException:
        outcomes.put((-1, spec["job"], rank, {"ok": False, "errors": ["crash"], "text": traceback.format_exc()}))
        raise
    finally:
        outcomes.close()
        outcomes.join_thread()  # what was reported reaches the parent before the process ends
        # No destroy_process_group(): on torch 2.6 destroying a gloo group can deadlock at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _context() -> Any:
    """The forkserver context, whose server imports torch and the plugins once for every race."""
    return forkserver_context(_PRELOAD)


# Parent side -----------------------------------------------------------------------------------------
def race(mode: str, stack: Stack, rounds: int, *, chunk_size: int = CHUNK_SIZE) -> Tally:
    """Race two jobs saving to one path under ``stack`` for ``rounds`` rounds; what each round ended in."""
    if mode not in MODES or stack.storage not in STORAGES:
        raise ValueError(f"mode must be one of {MODES} and storage one of {STORAGES}, not {mode!r}, {stack.storage!r}")
    ctx = _context()
    world = 2 if mode == "gloo" else 1
    path = f"{stack.root}/race-{mode}-{uuid.uuid4().hex[:6]}"
    barrier = ctx.Barrier(JOBS * world + 1)
    outcomes = ctx.Queue()
    environ = {"STORAGE_EMULATOR_HOST": stack.endpoint} if stack.endpoint else {}
    processes = []
    tally = Tally()
    try:
        for job in range(JOBS):
            spec = {"job": job, "world": world, "port": free_port(), "mode": mode, "rounds": rounds, "path": path,
                    "chunk_size": chunk_size, "stack": vars(stack), "environ": environ}
            for rank in range(world):
                process = ctx.Process(target=_job, args=(spec, rank, barrier, outcomes), daemon=True)
                process.start()
                processes.append(process)
        for round_ in range(rounds):
            barrier.wait(WAIT_S)  # every process of both jobs starts its save now
            reported: dict[tuple[int, int], dict[str, Any]] = {}
            while len(reported) < len(processes):
                done, job, rank, outcome = outcomes.get(timeout=WAIT_S)
                if done != round_:
                    raise AssertionError(f"job {job} rank {rank} crashed:\n{outcome['text']}")
                reported[job, rank] = outcome
            _judge(tally, round_, stack, path, world, reported)
    except (queue.Empty, threading.BrokenBarrierError) as err:
        codes = [process.exitcode for process in processes]
        raise AssertionError(f"the race hung or a process died (exit codes {codes}): {err!r}") from None
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
    return tally


def _judge(tally: Tally, round_: int, stack: Stack, path: str, world: int,
           reported: dict[tuple[int, int], dict[str, Any]]) -> None:
    """Count what ``round_`` ended in: the outcomes, the checkpoint at ``path``, what else is there."""
    tally.rounds += 1
    winners = {job for job in range(JOBS) if all(reported[job, rank]["ok"] for rank in range(world))}
    for (job, rank), outcome in sorted(reported.items()):
        if outcome["ok"] != (job in winners):
            tally.problems.append(f"round {round_}: job {job}'s ranks disagree on its outcome: {reported}")
        elif not outcome["ok"]:
            if all("ConcurrentWriteError" in kind for kind in outcome["errors"]):
                tally.lost += rank == 0
            else:
                tally.problems.append(f"round {round_}: job {job} rank {rank} failed with {outcome['errors']}: "
                                      f"{outcome['text']}")
    tally.both_won += len(winners) == JOBS
    if not winners:
        tally.problems.append(f"round {round_}: no save succeeded")
        return
    try:
        mismatched = {job: _mismatches(stack, path, seed_of(job, round_)) for job in winners}
    except BaseException as err:  # noqa: BLE001 - DCP reports a failed load as a BaseException
        tally.problems.append(f"round {round_}: {sorted(winners)} reported success, the checkpoint does not load: "
                              f"{str(err)[-300:]}")
        return
    if not any(not keys for keys in mismatched.values()):
        tally.problems.append(f"round {round_}: the checkpoint is no successful save's state: {mismatched}")
        return
    tally.whole += 1
    extra = leftovers(stack, path)
    if extra:
        tally.leftovers += 1
        tally.problems.append(f"round {round_}: left beside the checkpoint: {extra}")


def _reader(stack: Stack, path: str) -> Any:
    if stack.storage == "nvme":
        from fastpersist import FastPersistStorageReader

        return FastPersistStorageReader(path)
    from dataflux_ckpt import DatafluxStorageReader

    return DatafluxStorageReader(path, storage_client=_client(stack))


def _client(stack: Stack) -> Any:
    from tests.support.gcs import client_for

    return client_for(stack.endpoint)


def _mismatches(stack: Stack, path: str, seed: int) -> list[str]:
    """Load the checkpoint at ``path`` in this process; the keys that differ from ``seed``'s state."""
    import torch
    import torch.distributed.checkpoint as dcp

    want = state(seed)
    loaded = {key: torch.zeros_like(value) for key, value in want.items()}
    dcp.load(loaded, storage_reader=_reader(stack, path))
    return [key for key, value in want.items() if not torch.equal(loaded[key], value)]


def leftovers(stack: Stack, path: str) -> list[str]:
    """What is at ``path`` besides ``.metadata`` and the files it names (and XML multipart uploads in
    progress in the bucket)."""
    from lightning_storage_plugins.dcp import METADATA_NAME

    metadata = _reader(stack, path).read_metadata()
    kept = {METADATA_NAME} | {info.relative_path for info in metadata.storage_data.values()}
    if stack.storage == "nvme":
        present = set(os.listdir(path))
    else:
        from tests.support.gcs import object_names

        prefix = path.removeprefix(f"gs://{stack.bucket}/") + "/"
        present = {name.removeprefix(prefix) for name in object_names(stack.endpoint, stack.bucket, prefix)}
    extra = sorted(present - kept)
    if stack.storage == "gs-xml":
        from tests.support.gcs import uploads_in_progress

        extra += [f"multipart upload of {key}" for key in uploads_in_progress(stack.endpoint, stack.bucket)]
    return extra


# From a shell ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def local_stacks(folder: Path) -> Iterator[dict[str, Stack]]:
    """Each storage's stack, as a user starts it: ``FakeGcsServer()`` (and an ``XmlMultipartServer``
    in front of it, parts of any size accepted), and an O_DIRECT directory under ``folder``."""
    from dataflux_ckpt.testing import FakeGcsServer, XmlMultipartServer

    with FakeGcsServer() as gcs, XmlMultipartServer(gcs, min_part_bytes=0) as front:
        gcs.create_bucket("ckpts")
        yield {"nvme": Stack("nvme", str(folder / "nvme")),
               "gs": Stack("gs", "gs://ckpts/run", gcs.url, "ckpts"),
               "gs-xml": Stack("gs-xml", "gs://ckpts/xml", front.url, "ckpts")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.dcp_race", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds per race (default: %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of %(default)s")
    parser.add_argument("--storages", default=",".join(STORAGES), help="comma list of %(default)s")
    parser.add_argument("--chunk-size", type=int, default=CHUNK_SIZE, help="bytes per uploaded part (default: %(default)s)")
    parser.add_argument("--folder", default=None, help="an O_DIRECT-capable directory for nvme (default: a temporary one)")
    parser.add_argument("--json", default=None, help="write the tallies here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # loads here have no group
    results = []
    with tempfile.TemporaryDirectory(prefix="dcp-race-", dir=args.folder) as folder, \
            local_stacks(Path(folder)) as stacks:
        print(f"{'mode':<7} {'storage':<7} {'rounds':>6} {'whole':>6} {'lost':>5} {'both won':>8} {'leftovers':>9} "
              f"{'problems':>8}", flush=True)
        for mode in args.modes.split(","):
            for storage in args.storages.split(","):
                tally = race(mode, stacks[storage], args.rounds, chunk_size=args.chunk_size)
                results.append({"mode": mode, "storage": storage, **vars(tally)})
                print(f"{mode:<7} {storage:<7} {tally.rounds:>6} {tally.whole:>6} {tally.lost:>5} {tally.both_won:>8} "
                      f"{tally.leftovers:>9} {len(tally.problems):>8}", flush=True)
                for problem in tally.problems[:5]:
                    print(f"    {problem}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(not result["problems"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
