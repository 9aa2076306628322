"""SIGKILL a two-rank tiered DCP job at random points of its local writes, its uploads and its
publishes, round after round, and check what each restart finds.

Each round starts two gloo ranks (:mod:`tests.support.dcp_ranks`, op ``tiered_loop`` of
:mod:`tests.support.dcp_tiered`) that resume the checkpoint ``<root>/last`` through a reader with
``local_dir`` (the newest version both find whole), take over what the killed job left, and save
seed after seed until the parent kills both:

* ``save``: a random time into one of their saves (each rank's local write, the coordinator's
  metadata);
* ``upload``: when the n-th part of a shard upload reaches the GCS proxy (before or just after it is
  forwarded);
* ``publish``: when a ``.metadata`` upload (the publish) reaches the proxy (before or just after).

After every kill the parent checks, through the public APIs (a reader in this one process):

* the node's local tier loads a whole checkpoint (every tensor of one seed), at least the newest
  save both ranks returned from and at most the newest started;
* GCS holds a whole checkpoint or none, never older than the previous round's, never newer than the
  newest save started, and never one of the saves ``remote_every`` keeps on the node;
* a new node (an empty ``local_dir``) loads GCS's;
* the next job resumes from the newest whole checkpoint of the tier it reads: the node's on the same
  node, GCS's on a new node (every third round).

At the end a job that is not killed takes over what the last one left, and GCS then holds the
newest checkpoint of the last node meant for GCS: the local tier's newest, or with ``remote_every``
an older one the job uploaded while it went on saving on the node.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support import tiered_crash
from tests.support.dcp_ranks import Ranks
from tests.support.tiered_crash import Trigger

PHASES = ("save", "upload", "publish")
NEW_NODE_EVERY = 3
SAVES_PER_ROUND = 40
ROUND_WAIT_S = 240.0


def _object_name(request: Any) -> str:
    """The object a media upload names (``""`` for any other request)."""
    if getattr(request, "method", "") != "POST" or "uploadType=media" not in getattr(request, "path", ""):
        return ""
    return parse_qs(urlsplit(request.path).query).get("name", [""])[0]


def is_shard_part(request: Any) -> bool:
    """A part of a shard's upload (composite uploads put each part as an object of its own)."""
    name = _object_name(request)
    return ".distcp.dataflux-parts/" in name


def is_publish(request: Any) -> bool:
    """The upload of a checkpoint's ``.metadata``."""
    return _object_name(request).endswith("/.metadata")


@dataclass
class Round(tiered_crash.Round):
    """What one round saw (``saved``: the newest save both ranks returned from)."""

    fired: bool = False  # the kill landed where the phase aims


@dataclass
class Crashes(tiered_crash.Crashes):
    """The rounds of one phase, and what went wrong."""

    final_seconds: float = 0.0


def _seeds(events: Path, kind: str, rank: int) -> list[int]:
    return [int(path.name.rsplit("-", 1)[1]) for path in events.glob(f"{rank}-{kind}-*")]


def _load(path: str, local_dir: str | None) -> int:
    """The seed of the checkpoint a reader in this process loads (0: none); AssertionError if mixed."""
    from tests.support.dcp_tiered import load_seed

    try:
        seed, bad, _ = load_seed(path, local_dir)
    except FileNotFoundError:
        return 0
    assert bad == [], f"tensors {bad} are not seed {seed}'s"
    return seed


def crash_rounds(phase: str, rounds: int, *, root: str, proxy: Any, work_dir: Path, seed: int = 0,
                 remote_every: int = 1) -> Crashes:
    """Kill the job ``rounds`` times in ``phase``; what every round found (see the module docstring).

    ``proxy`` is a :class:`tests.support.gcs.FaultProxy` in front of the emulator; the ranks talk through it.
    ``remote_every`` is the ranks' tier's (each job counts its own save rounds, so the N-th after a
    restart goes to GCS).
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
    rng = random.Random(seed)
    path = f"{root}/last"
    result = Crashes()
    node, gcs_seed, expected = 0, 0, 0
    local_dir = work_dir / "node-0"
    save_times = [0.3]

    def run(number: int, local: Path, saves: int, trigger: Trigger | None, round_: Round) -> None:
        events = work_dir / f"events-{number}"
        events.mkdir()
        step = {"op": "tiered_loop", "path": path, "local_dir": str(local), "events": str(events), "saves": saves,
                "endpoint": proxy.url, "remote_every": remote_every}
        with Ranks([step], 2, work_dir, timeout_s=ROUND_WAIT_S) as ranks:
            def kill_both() -> None:
                for rank in (0, 1):
                    with contextlib.suppress(IndexError):
                        ranks.kill(rank)

            deadline = time.monotonic() + ROUND_WAIT_S
            while not (_seeds(events, "resumed", 0) and _seeds(events, "resumed", 1)):
                if ranks.exited() or time.monotonic() > deadline:
                    result.problems.append(f"round {number}: the job did not resume:\n{ranks.output()}")
                    return
                time.sleep(0.05)
            round_.resumed = _seeds(events, "resumed", 0)[0]
            if _seeds(events, "resumed", 1) != [round_.resumed]:
                result.problems.append(f"round {number}: the ranks resumed different seeds: "
                                       f"{_seeds(events, 'resumed', 0)} and {_seeds(events, 'resumed', 1)}")
            if trigger is None:
                ranks.join()
            elif phase == "save":
                aim = round_.resumed + rng.randint(2, 4)
                while not (aim in _seeds(events, "saving", 0) and aim in _seeds(events, "saving", 1)):
                    if ranks.exited() or time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 1.2 * statistics.median(save_times)))
                kill_both()
                round_.fired = True
            else:
                trigger.kill = kill_both
                while not trigger.fired.wait(0.05):
                    if ranks.exited() or time.monotonic() > deadline:
                        break
                round_.fired = trigger.fired.is_set()
                time.sleep(0.1)  # a kill just after forwarding lands
                kill_both()
        started = {rank: _seeds(events, "saving", rank) for rank in (0, 1)}
        saved = {rank: set(_seeds(events, "saved", rank)) for rank in (0, 1)}
        round_.saving = max(started[0] + started[1], default=0)
        for seed_ in sorted(set(started[0] + started[1])):
            result.saving(seed_, round_.resumed, remote_every)
        round_.saved = max(saved[0] & saved[1], default=0)
        for seed_ in sorted(saved[0] & saved[1]):
            times = [(events / f"{rank}-saved-{seed_}").stat().st_mtime - (events / f"{rank}-saving-{seed_}").stat().st_mtime
                     for rank in (0, 1)]
            save_times.append(max(times))

    for number in range(rounds):
        new_node = number % NEW_NODE_EVERY == NEW_NODE_EVERY - 1
        if new_node:
            node += 1
            local_dir = work_dir / f"node-{node}"
            expected = gcs_seed
            result.new_node(gcs_seed)
        round_ = Round(phase, new_node, resumed=-1)
        began = time.perf_counter()
        if phase == "save":
            trigger = Trigger(lambda request: False, 1, rng)  # never fires: the loop kills the ranks
        elif phase == "upload":
            trigger = Trigger(is_shard_part, rng.randint(1, 24), rng)
        else:
            trigger = Trigger(is_publish, rng.randint(1, 2), rng)
        proxy.fault = trigger.rule
        try:
            run(number, local_dir, SAVES_PER_ROUND, trigger, round_)
        finally:
            proxy.fault = None
        if round_.resumed != expected:
            result.problems.append(f"round {number}: resumed at seed {round_.resumed}, not {expected}, the newest "
                                   f"whole checkpoint of the {'GCS' if new_node else 'local'} tier")
        try:
            round_.local = _load(path, str(local_dir))
        except AssertionError as exc:
            result.problems.append(f"round {number}: the local tier holds a mixed checkpoint: {exc}")
        try:
            round_.gcs = _load(path, None)
        except AssertionError as exc:
            result.problems.append(f"round {number}: GCS holds a mixed checkpoint: {exc}")
        if not round_.saved <= round_.local <= max(round_.saving, round_.resumed):
            result.problems.append(f"round {number}: the local tier loads seed {round_.local}; saves returned up to "
                                   f"{round_.saved} and started up to {round_.saving}")
        if not gcs_seed <= round_.gcs <= max(round_.saving, round_.resumed):
            result.problems.append(f"round {number}: GCS holds seed {round_.gcs}, after seed {gcs_seed}; saves "
                                   f"started up to {round_.saving}")
        if round_.gcs and round_.gcs not in result.remote_steps:
            result.problems.append(f"round {number}: GCS holds seed {round_.gcs}, a save remote_every={remote_every} "
                                   "keeps on the node")
        if (fresh := _load(path, str(work_dir / f"empty-{number}"))) != round_.gcs:
            result.problems.append(f"round {number}: an empty local_dir loads seed {fresh}, GCS holds {round_.gcs}")
        gcs_seed, expected = max(gcs_seed, round_.gcs), round_.local
        round_.seconds = time.perf_counter() - began
        result.rounds.append(round_)

    # A job that is not killed takes over what the last one left, and publishes it.
    began = time.perf_counter()
    final = Round(phase, False, resumed=-1)
    run(rounds, local_dir, 0, None, final)
    if final.resumed != expected:
        result.problems.append(f"the final job resumed at seed {final.resumed}, not {expected}")
    result.settle(_load(path, str(local_dir)), _load(path, None))
    result.final_seconds = time.perf_counter() - began
    return result
