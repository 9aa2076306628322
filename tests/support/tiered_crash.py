"""SIGKILL a ``TieredCheckpointIO`` writer at random points of its saves, uploads and publishes, round
after round, and check what each restart finds.

Each round forks a writer (from a server that imported torch and the plugin once: ``forkserver``)
that resumes ``last.ckpt`` through the plugin, becomes the local tier's writer (finishing what the
previous one left pending) and saves step after step, until the parent kills it:

* ``save``: a random time into one of its local writes;
* ``upload``: when one of its part uploads reaches the GCS proxy (before or just after it is forwarded);
* ``publish``: when its compose (the publish) reaches the proxy (before or just after it is forwarded).

After every kill the parent checks, through the public APIs:

* the local tier loads a whole checkpoint (every tensor of one step), at least the newest save that
  returned and at most the newest that started;
* GCS holds a whole checkpoint or none, never newer than the newest save started, never older than
  the previous round's, and never one of the saves ``remote_every`` keeps on the node;
* a manifest that says durable names the very object in GCS (crc32c and generation);
* a new node (an empty ``local_dir``) loads GCS's copy;
* the next writer resumes from the newest whole checkpoint of the tier it reads: the local tier's on
  the same node, GCS's on a new node (every fifth restart).

At the end a writer that is not killed finishes what the last one left, and GCS then holds the
newest checkpoint of the last node meant for GCS: the local tier's newest, or with ``remote_every``
one it replaced on the node while it was uploading.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_storage_plugins.services import die_with_parent
from tests.support.processes import forkserver_context

PHASES = ("save", "upload", "publish")
NUMEL = 250_000  # 1 MB of float32 per checkpoint
CHUNK_SIZE = 256 * 1024  # four parts per upload
NEW_NODE_EVERY = 5
ROUND_WAIT_S = 120.0
# DeepSpeed too: a writer's first save loads its aio op (a second and a half to import it afresh).
_PRELOAD = ["torch", "deepspeed", "dataflux_ckpt.tiered", "fastpersist"]


def state(step: int) -> dict[str, Any]:
    """What the writer saves at ``step``: every tensor derived from the step."""
    import torch

    generator = torch.Generator().manual_seed(step)
    return {"global_step": step, "w": torch.randn(NUMEL, generator=generator), "b": torch.full((3,), float(step))}


def whole_step(loaded: dict[str, Any]) -> int:
    """The step of ``loaded`` if all of it is that step's, else an AssertionError naming what is mixed."""
    import torch

    step = loaded["global_step"]
    expected = state(step)
    for name in ("w", "b"):
        assert torch.equal(loaded[name], expected[name]), f"tensor {name} is not step {step}'s"
    return step


def plugin_options(local_dir: str, remote_every: int = 1) -> dict[str, Any]:
    from tests.support.gcs import FAST_RETRY

    return {"local_dir": local_dir, "chunk_size": CHUNK_SIZE, "max_workers": 2, "upload_mode": "composite",
            "retry": FAST_RETRY, "io_buffer_mb": 4, "keep_local": None, "teardown_timeout_s": 60.0,
            "deadline_s": 60.0, "remote_every": remote_every}


# The writer (a forked child) -------------------------------------------------------------------
def _writer(spec: dict[str, Any], conn: Any) -> None:
    die_with_parent(signal.SIGKILL)
    os.environ["STORAGE_EMULATOR_HOST"] = spec["endpoint"]
    import torch

    from dataflux_ckpt import TieredCheckpointIO

    torch.set_num_threads(1)
    try:
        plugin = TieredCheckpointIO(**plugin_options(spec["local_dir"], spec["remote_every"]))
        try:
            resumed = plugin.load_checkpoint(spec["uri"], weights_only=True)["global_step"]
        except FileNotFoundError:
            resumed = 0
        conn.send(("resumed", resumed))
        plugin.preflight([])  # the local tier's writer now: what the last one left is finished first
        for step in range(resumed + 1, resumed + 1 + spec["saves"]):
            conn.send(("saving", step))
            started = time.perf_counter()
            plugin.save_checkpoint(state(step), spec["uri"])
            conn.send(("saved", step, time.perf_counter() - started))
        plugin.teardown()
        conn.send(("done", plugin.stats().uploads_done))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        os._exit(0)


# The parent --------------------------------------------------------------------------------------
@dataclass
class Round:
    """What one round saw."""

    phase: str
    new_node: bool
    resumed: int
    saving: int = 0  # the newest save started
    saved: int = 0  # the newest save that returned
    inside: bool = False  # the kill landed before the save it aimed at returned (save phase)
    local: int = 0
    gcs: int = 0  # 0: no object
    seconds: float = 0.0


@dataclass
class Crashes:
    """The rounds of one phase, and what went wrong."""

    rounds: list[Round] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    final_gcs: int = 0
    final_local: int = 0
    #: The steps a save meant for GCS was made of, on any node (``remote_every``: every N-th save of a writer).
    remote_steps: set[int] = field(default_factory=set)
    #: The step GCS must hold at the end: the last node's newest save meant for GCS, up to ``final_local``
    #: (or what the node resumed from, when it made none).
    final_owed: int = 0
    #: Step -> whether the current node's newest save of it was meant for GCS.
    node_remote: dict[int, bool] = field(default_factory=dict)
    #: The GCS step the current node resumed from.
    node_start: int = 0

    def saving(self, step: int, resumed: int, remote_every: int) -> None:
        """Record a save of ``step`` by a writer that resumed at ``resumed``: every ``remote_every``-th
        save after its resume goes to GCS (each writer counts its own)."""
        self.node_remote[step] = remote = (step - resumed) % remote_every == 0
        if remote:
            self.remote_steps.add(step)

    def new_node(self, start: int) -> None:
        """Move to a new node, whose writers resume from GCS's ``start``."""
        self.node_start = start
        self.node_remote.clear()

    def settle(self, final_local: int, final_gcs: int) -> None:
        """Record what the tiers hold after the last writer, and what GCS owes by then (``final_owed``)."""
        self.final_local, self.final_gcs = final_local, final_gcs
        self.final_owed = max((step for step, remote in self.node_remote.items() if remote and step <= final_local),
                              default=self.node_start)


class Trigger:
    """Calls :attr:`kill` (once it is set) when the proxy sees the n-th request ``matches`` accepts:
    before forwarding it (the request is then cut), or half of the time a few milliseconds after
    letting it through. ``rule`` is the proxy's ``fault``."""

    def __init__(self, matches: Callable[[Any], bool], nth: int, rng: random.Random) -> None:
        self.matches, self.nth, self.rng = matches, nth, rng
        #: What kills the writers.
        self.kill: Callable[[], None] | None = None
        self.seen = 0
        self.fired = threading.Event()
        self.lock = threading.Lock()

    def rule(self, request: Any, seen: int) -> int | str | None:
        with self.lock:
            if self.fired.is_set() or self.kill is None or not self.matches(request):
                return None
            self.seen += 1
            if self.seen < self.nth:
                return None
            self.fired.set()
            kill, before = self.kill, self.rng.random() < 0.5
        if before:
            kill()
            return "reset"
        threading.Timer(self.rng.uniform(0.0, 0.01), kill).start()
        return None


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # its server reaps a writer that died already
        os.kill(pid, signal.SIGKILL)


def _is_part(request: Any) -> bool:
    return request.method == "POST" and ".dataflux-parts" in request.path and "uploadType=media" in request.path


def is_publish(request: Any) -> bool:
    """A composite upload's compose into the checkpoint itself (not into one of its part objects)."""
    return request.method == "POST" and request.path.split("?")[0].endswith("/compose") and \
        ".dataflux-parts" not in request.path.split("/compose")[0]


def crash_rounds(phase: str, rounds: int, *, bucket: str, proxy: Any, work_dir: Path, seed: int = 0,
                 remote_every: int = 1) -> Crashes:
    """Kill a writer ``rounds`` times in ``phase``; what every round found (see the module docstring).

    ``proxy`` is a :class:`tests.support.gcs.FaultProxy` in front of the emulator; the writers talk through it.
    ``remote_every`` is the writers' (each counts its own saves, so the N-th after a restart goes to GCS).
    """
    from dataflux_ckpt import DatafluxCheckpointIO, TieredCheckpointIO
    from dataflux_ckpt.paths import parse_gcs_path
    from dataflux_ckpt.retry import Deadline
    from dataflux_ckpt.tiered import Manifest
    from tests.support.gcs import FAST_RETRY

    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
    rng = random.Random(seed)
    ctx = forkserver_context(_PRELOAD)
    uri = f"gs://{bucket}/run/last.ckpt"
    gcs = DatafluxCheckpointIO(chunk_size=CHUNK_SIZE, retry=FAST_RETRY)
    result = Crashes()
    node, resume, gcs_step = 0, 0, 0
    save_times = [0.05]

    def read_local(local_dir: Path) -> int:
        reader = TieredCheckpointIO(**plugin_options(str(local_dir)))
        try:
            return whole_step(reader.load_checkpoint(uri, weights_only=True))
        except FileNotFoundError:
            return 0
        finally:
            reader.teardown()

    def read_gcs() -> int:
        try:
            return whole_step(gcs.load_checkpoint(uri, weights_only=True))
        except FileNotFoundError:
            return 0

    def run(local_dir: Path, saves: int, trigger: Trigger | None, problems: list[str], round_: Round) -> None:
        """One writer, killed by ``trigger`` (or by this loop, in the save phase); none: it runs to its end."""
        reader, writer_end = ctx.Pipe(duplex=False)
        spec = {"endpoint": proxy.url, "uri": uri, "local_dir": str(local_dir), "saves": saves,
                "remote_every": remote_every}
        process = ctx.Process(target=_writer, args=(spec, writer_end), daemon=True)
        process.start()
        writer_end.close()
        if trigger is not None:
            trigger.kill = functools.partial(_kill, process.pid)
        aim = rng.randint(2, 6)  # the save phase aims at this save of the round (the first also starts aio)
        killed = False
        try:
            while True:
                if not reader.poll(ROUND_WAIT_S):
                    problems.append(f"round {len(result.rounds)}: the writer said nothing for {ROUND_WAIT_S} s")
                    break
                try:
                    event = reader.recv()
                except (EOFError, OSError):
                    break  # killed
                kind = event[0]
                if kind == "resumed":
                    round_.resumed = event[1]
                elif kind == "saving":
                    round_.saving = event[1]
                    result.saving(round_.saving, round_.resumed, remote_every)
                    if phase == "save" and trigger is not None and round_.saving - round_.resumed == aim:
                        time.sleep(rng.uniform(0.0, 1.2 * statistics.median(save_times)))
                        process.kill()
                        killed = True
                elif kind == "saved":
                    round_.saved = event[1]
                    if round_.saved - round_.resumed > 1:
                        save_times.append(event[2])
                elif kind == "error":
                    problems.append(f"round {len(result.rounds)}: the writer failed: {event[1]}")
                    break
                elif kind == "done":
                    break
        finally:
            if trigger is not None or killed:
                process.kill()  # a trigger that never fired: the round still ends
            process.join(ROUND_WAIT_S)
            reader.close()
        if phase == "save" and killed:
            round_.inside = round_.saved < round_.saving

    local_dir = work_dir / "node-0"
    for number in range(rounds):
        new_node = number % NEW_NODE_EVERY == NEW_NODE_EVERY - 1
        if new_node:
            node += 1
            local_dir = work_dir / f"node-{node}"
            resume = gcs_step
            result.new_node(gcs_step)
        round_ = Round(phase, new_node, resumed=-1)
        problems: list[str] = []
        started = time.perf_counter()
        if phase == "save":
            trigger = Trigger(lambda request: False, 1, rng)  # never fires: this loop kills the writer
        elif phase == "upload":
            trigger = Trigger(_is_part, rng.randint(1, 10), rng)
        else:
            trigger = Trigger(is_publish, rng.randint(1, 2), rng)
        proxy.fault = trigger.rule
        try:
            run(local_dir, saves=50, trigger=trigger, problems=problems, round_=round_)
        finally:
            proxy.fault = None
        if round_.resumed != resume:
            problems.append(f"round {number}: resumed at step {round_.resumed}, not {resume}, the newest whole "
                            f"checkpoint of the {'GCS' if new_node else 'local'} tier")
        try:
            round_.local = read_local(local_dir)
        except AssertionError as exc:
            problems.append(f"round {number}: the local tier holds a mixed checkpoint: {exc}")
        try:
            round_.gcs = read_gcs()
        except AssertionError as exc:
            problems.append(f"round {number}: GCS holds a mixed checkpoint: {exc}")
        if not round_.saved <= round_.local <= round_.saving:
            problems.append(f"round {number}: the local tier loads step {round_.local}; saves returned up to "
                            f"{round_.saved} and started up to {round_.saving}")
        if not gcs_step <= round_.gcs <= max(round_.saving, round_.resumed):
            problems.append(f"round {number}: GCS holds step {round_.gcs}, after step {gcs_step}; saves started "
                            f"up to {round_.saving}")
        if round_.gcs and round_.gcs not in result.remote_steps:
            problems.append(f"round {number}: GCS holds step {round_.gcs}, a save remote_every={remote_every} "
                            "keeps on the node")
        for path in local_dir.glob("*.manifest"):
            manifest = Manifest.from_json(path.read_bytes())
            if manifest.durable:
                target = parse_gcs_path(manifest.uri)
                info = gcs.gcs.stat(target, Deadline(30, "stat", manifest.uri))
                if (info.crc32c, info.generation) != (manifest.crc32c, manifest.durable_generation):
                    problems.append(f"round {number}: the manifest says durable as generation "
                                    f"{manifest.durable_generation} ({manifest.crc32c}); GCS holds "
                                    f"{info.generation} ({info.crc32c})")
        with tempfile.TemporaryDirectory(dir=work_dir) as empty:
            if (fresh := read_local(Path(empty))) != round_.gcs:
                problems.append(f"round {number}: an empty local_dir loads step {fresh}, GCS holds {round_.gcs}")
        gcs_step, resume = max(gcs_step, round_.gcs), round_.local
        round_.seconds = time.perf_counter() - started
        result.rounds.append(round_)
        result.problems.extend(problems)

    # A writer that is not killed finishes what the last one left pending.
    final = Round(phase, False, resumed=-1)
    run(local_dir, saves=0, trigger=None, problems=result.problems, round_=final)
    result.settle(read_local(local_dir), read_gcs())
    gcs.teardown()
    return result
