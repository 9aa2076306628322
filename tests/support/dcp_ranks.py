"""Real multi-process DCP runs: every rank is a fresh ``python -m tests.support.dcp_ranks`` process
in one gloo group (timeouts on every collective), running the steps of a JSON spec.

The parent side, :class:`Ranks`, starts the processes, can SIGKILL one mid-run, and collects each
rank's JSON report; a run that outlives its deadline is killed and fails the test.

The state every run saves and loads is made from a seed: DTensors sharded along dim 0 (rows that do not
divide evenly) and dim 1, bf16 and int64 tensors, a replicated vector, a 0-dim tensor and a pickled
(``BYTE_IO``) dict, so that any world size can load what any other world size saved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_storage_plugins.services import die_with_parent, free_port
from tests.support.processes import alive, wait_for

# Small parts and crc blocks, so that small tensors still span many of them.
GS_OPTIONS = {"chunk_size": 64 * 1024, "block_size": 4096, "max_workers": 3}
GS_READ_OPTIONS = {"chunk_size": 64 * 1024, "max_workers": 3, "coalesce_gap": 2048}
NVME_OPTIONS = {"io_buffer_mb": 1}
COLLECTIVE_TIMEOUT_S = 20.0


# Parent side ----------------------------------------------------------------------------------------
class Ranks:
    """``world`` rank processes running ``steps``; use as a context manager (all are killed on exit).

    One launcher process imports torch and the plugins once, then forks the ranks (a fresh interpreter
    per rank would spend most of a short test importing).
    """

    def __init__(self, steps: Sequence[dict[str, Any]], world: int, workdir: Path, *, timeout_s: float = 150.0) -> None:
        self.world, self.timeout_s, self.workdir = world, timeout_s, workdir
        run_id = uuid.uuid4().hex[:6]
        self._pids = workdir / f"pids-{run_id}.json"
        self.reports = [workdir / f"report-{run_id}-{rank}.json" for rank in range(world)]
        spec = {"steps": list(steps), "world": world,
                "reports": [str(path) for path in self.reports], "pids": str(self._pids)}
        self._launcher = subprocess.Popen(
            [sys.executable, "-m", "tests.support.dcp_ranks", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )
        self._deadline = time.monotonic() + timeout_s
        self._killed: set[int] = set()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        pids = self.pids()
        if self._launcher.poll() is None:
            for pid in pids:
                _kill(pid)
            self._launcher.kill()
        self._launcher.wait()
        # A killed rank may still be exiting (freeing its memory and AIO contexts): what runs next,
        # a restart's clean-up among it, must find it gone.
        wait_for(lambda: not any(alive(pid) for pid in pids), "the ranks' exit")

    def pids(self) -> list[int]:
        """The ranks' process ids (none until they are forked)."""
        try:
            return json.loads(self._pids.read_text())
        except (OSError, ValueError):
            return []

    def exited(self) -> bool:
        """Whether the launcher (every rank) has exited."""
        return self._launcher.poll() is not None

    def kill(self, rank: int) -> None:
        """SIGKILL one rank."""
        self._killed.add(rank)
        _kill(self.pids()[rank])

    def wait_for(self, marker: Path) -> None:
        """Wait until ``marker`` exists (a rank reached a point of its steps)."""
        while not marker.exists():
            if time.monotonic() > self._deadline or self._launcher.poll() is not None:
                raise AssertionError(f"{marker.name} never appeared:\n{self.output()}")
            time.sleep(0.05)

    def join(self) -> list[dict[str, Any] | None]:
        """Wait for every rank not killed to exit 0 before the deadline; each rank's report (``None``
        for a killed rank)."""
        reports = self.finish()
        for rank, report in enumerate(reports):
            if report is None and rank not in self._killed:
                raise AssertionError(f"rank {rank} failed:\n{self.output()}")
        return reports

    def finish(self) -> list[dict[str, Any] | None]:
        """Wait for every rank to end before the deadline, however it ends; each rank's report
        (``None`` for a rank that wrote none: killed, died, or failed).

        Raises:
            AssertionError: a rank was still running at the deadline.
        """
        try:
            self._launcher.wait(timeout=max(self._deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ranks still running after {self.timeout_s} s:\n{self.output()}") from None
        return [None if rank in self._killed or not path.exists() else json.loads(path.read_text())
                for rank, path in enumerate(self.reports)]

    def output(self) -> str:
        if self._launcher.poll() is None:
            for pid in self.pids():
                _kill(pid)
            self._launcher.kill()
        out = self._launcher.stdout.read().decode(errors="replace") if self._launcher.stdout else ""
        return out[-8000:]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(steps: Sequence[dict[str, Any]], world: int, workdir: Path, timeout_s: float = 150.0) -> list[dict[str, Any]]:
    """Run ``steps`` on ``world`` ranks; every rank's report."""
    with Ranks(steps, world, workdir, timeout_s=timeout_s) as ranks:
        return [report for report in ranks.join() if report is not None]


# State -------------------------------------------------------------------------------------------
def full_state(seed: int) -> dict[str, Any]:
    """The whole (unsharded) state a run saves."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(256, 1024, generator=generator),  # first: a victim stalls after writing it
        "w0": torch.randn(37, 29, generator=generator),
        "w1": torch.randn(12, 150, generator=generator).to(torch.bfloat16),
        "emb": torch.randint(-(2**40), 2**40, (41, 7), generator=generator, dtype=torch.int64),
        "r": torch.randn(19, generator=generator),
        "s": torch.tensor(float(seed)),
        "meta": {"step": seed, "name": f"run-{seed}", "lrs": [0.1, 0.01]},
    }


PLACEMENTS = {"big": ("shard", 0), "w0": ("shard", 0), "w1": ("shard", 1), "emb": ("shard", 0), "r": ("replicate",), "s": ("replicate",)}


META_PLACEHOLDER = {"step": -1, "name": "", "lrs": []}


def load_whole(reader: Any, seed: int) -> list[str]:
    """Load a checkpoint into whole tensors in this one process; the keys that differ from ``seed``'s state."""
    import torch
    import torch.distributed.checkpoint as dcp

    want = full_state(seed)
    state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict(META_PLACEHOLDER) for k, v in want.items()}
    dcp.load(state, storage_reader=reader)
    return [k for k, v in want.items() if not (same_bits(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v)]


def sharded_state(full: dict[str, Any], mesh: Any, *, zeros: bool = False) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    state: dict[str, Any] = {}
    for key, value in full.items():
        if key not in PLACEMENTS:
            state[key] = dict(META_PLACEHOLDER) if zeros else value
            continue
        kind = PLACEMENTS[key]
        placement = Shard(kind[1]) if kind[0] == "shard" else Replicate()
        state[key] = distribute_tensor(torch.zeros_like(value) if zeros else value, mesh, [placement])
    return state


def same_bits(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def mismatches(loaded: dict[str, Any], full: dict[str, Any]) -> list[str]:
    """Keys whose loaded value differs from the full state (DTensors compared whole)."""
    bad = []
    for key, want in full.items():
        got = loaded[key]
        if key in PLACEMENTS:
            got = got.full_tensor()
            if not same_bits(got, want):
                bad.append(key)
        elif got != want:
            bad.append(key)
    return bad


# Rank side ------------------------------------------------------------------------------------------
def storage(step: dict[str, Any], *, reader: bool) -> Any:
    """The writer or reader a step names: ``gs`` (Dataflux) or ``nvme`` (FastPersist)."""
    if step["storage"] == "gs":
        from dataflux_ckpt import DatafluxStorageReader, DatafluxStorageWriter

        if reader:
            return DatafluxStorageReader(step["path"], **GS_READ_OPTIONS)
        return DatafluxStorageWriter(step["path"], **GS_OPTIONS)
    from fastpersist import FastPersistStorageReader, FastPersistStorageWriter

    if reader:
        return FastPersistStorageReader(step["path"])
    return FastPersistStorageWriter(step["path"], **NVME_OPTIONS)


def stalling_planner(marker: str, after_items: int, release: str | None = None) -> Any:
    """A save planner that, after ``after_items`` tensors (the first is ``big``), creates ``marker``
    and waits to be killed, or, given ``release``, until that file exists."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Stalling(DefaultSavePlanner):
        resolved = 0

        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            if write_item.type.name != "BYTE_IO":
                self.resolved += 1
                if self.resolved > after_items:
                    Path(marker).touch()
                    if release is None:
                        time.sleep(600)
                    while release is not None and not os.path.exists(release):
                        time.sleep(0.05)  # another process's file: nothing here to wait on
            return data

    return Stalling()


def run_steps(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    if spec["steps"] and spec["steps"][0]["op"] == "deepspeed":
        from tests.support.dcp_deepspeed import run_zero

        step = spec["steps"][0]
        return {"rank": rank, "steps": run_zero(step["stages"], step["root"], rank, world, spec["port"])}
    if spec["steps"] and all(step["op"] == "lightning_links" for step in spec["steps"]):
        from tests.support.dcp_lightning import run_link_rotation, torchrun_environ

        os.environ.update(torchrun_environ(rank, world, spec["port"]))
        return {"rank": rank, "steps": [run_link_rotation(step["kind"], step["storage"], step["root"])
                                        for step in spec["steps"]]}
    if spec["steps"] and all(step["op"] == "lightning_requeue" for step in spec["steps"]):
        from tests.support.dcp_requeue import run_requeue, slurm_environ

        outcomes = []
        for step in spec["steps"]:
            os.environ.update(slurm_environ(rank, world, spec["port"], step["bin"]))
            outcomes.append(run_requeue(step["kind"], step["storage"], step["root"], **step.get("options", {})))
        return {"rank": rank, "steps": outcomes}
    if spec["steps"] and all(step["op"] == "lightning_restart" for step in spec["steps"]):
        from tests.support.dcp_lightning import torchrun_environ
        from tests.support.dcp_restart import run_phase

        os.environ.update(torchrun_environ(rank, world, spec["port"]))
        return {"rank": rank, "steps": [run_phase(step["kind"], step["storage"], step["root"], step["phase"],
                                                  step.get("ckpt_path")) for step in spec["steps"]]}
    if spec["steps"] and all(step["op"].startswith("tiered") for step in spec["steps"]):
        from tests.support.dcp_tiered import run_tiered

        return run_tiered(spec, rank, world)
    if spec["steps"] and all(step["op"] == "lightning" for step in spec["steps"]):
        from tests.support.dcp_lightning import run_trainer, torchrun_environ

        os.environ.update(torchrun_environ(rank, world, spec["port"]))
        return {"rank": rank, "steps": [run_trainer(step["kind"], step["storage"], step["root"])
                                        for step in spec["steps"]]}
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, Any] = {"rank": rank, "steps": []}
    for step in spec["steps"]:
        op, outcome = step["op"], {}
        full = full_state(step.get("seed", 0))
        if op in ("save", "async_save"):
            writer = storage(step, reader=False)
            if op == "save":
                dcp.save(sharded_state(full, mesh), storage_writer=writer)
            else:
                future = dcp.async_save(sharded_state(full, mesh), storage_writer=writer)
                getattr(future, "upload_completion", future).result(timeout=COLLECTIVE_TIMEOUT_S * 2)
        elif op == "load":
            state = sharded_state(full, mesh, zeros=True)
            dcp.load(state, storage_reader=storage(step, reader=True))
            outcome["mismatches"] = mismatches(state, full)
        elif op == "save_killed":
            # The victim stalls mid-write and is SIGKILLed by the test; every other rank must fail
            # promptly (no hang), then clean up after the failed save.
            writer = storage(step, reader=False)
            victim = rank == step["victim"]
            planner = stalling_planner(step["marker"], step.get("after_items", 1)) if victim else None
            started = time.monotonic()
            try:
                dcp.save(sharded_state(full, mesh), storage_writer=writer, planner=planner)
                outcome["error"] = None
            except (Exception, dcp.CheckpointException) as err:  # the peer died: a collective fails
                outcome["error"] = type(err).__name__
                writer.abort()
            outcome["seconds"] = time.monotonic() - started
            report["steps"].append(outcome)
            return report  # the group is broken now
        else:
            raise ValueError(f"unknown step {op!r}")
        dist.barrier()
        report["steps"].append(outcome)
    # No destroy_process_group(): the rank ends with os._exit, and on torch 2.6 destroying a gloo group
    # can deadlock (its destructor joins the worker thread while holding the GIL, and that thread may
    # still be freeing the last collective's tensors, which needs the GIL).
    return report


def launch(spec: dict[str, Any]) -> int:
    """Import once, fork the ranks, wait for them; 0 when every rank exited 0 (or was killed)."""
    from dataflux_ckpt.emulator import configure_gcsfs_for_emulator

    configure_gcsfs_for_emulator()
    import warnings

    warnings.simplefilter("ignore")  # DCP warns about things these runs do on purpose
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import dataflux_ckpt  # noqa: F401
    import fastpersist  # noqa: F401

    if any(step["op"].startswith("lightning") for step in spec["steps"]):
        import dataflux_ckpt.strategies  # noqa: F401 - Lightning too, once here rather than in every rank
        import fastpersist.strategies  # noqa: F401

    # The rendezvous port is picked here, after the imports, and not by the test before this process
    # started: on a busy machine those imports take long enough for another process to take it.
    spec["port"] = free_port()
    pids = []
    for rank in range(spec["world"]):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                die_with_parent(signal.SIGKILL)
                report = run_steps(spec, rank, spec["world"])
                Path(spec["reports"][rank]).write_text(json.dumps(report))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # a group broken by a killed peer must not hang the exit
        pids.append(pid)
    Path(spec["pids"]).write_text(json.dumps(pids))
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(launch(json.loads(sys.argv[1])))
