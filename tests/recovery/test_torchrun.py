"""torchrun restarts every rank after one is killed, and they load the sharded (DCP) checkpoint.

Two ranks on gloo, FSDP (sharded state dicts) and ModelParallel (FSDP2), the job's checkpoints through
the FastPersist and Dataflux DCP storages. One rank is SIGKILLed at a random point of a step or a save, 10
times in one run of torch's elastic agent (``--max-restarts 10``) per strategy, 20 per storage: each
restart resumes every rank from the newest checkpoint the event log says is whole, each rank with the
shards it saved (its own digest), and a killed save leaves no checkpoint without ``.metadata`` and no
temporary of a dead rank. The agent is torch's own (what ``torchrun --standalone`` runs), its ranks
forked from the fork server; one more test runs ``torchrun`` itself, as the README shows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from benchmarks.recovery.events import Job, ProcessJob, ProcessLauncher, check_resume, kill_rank
from tests.support.recovery import (
    Rounds,
    Storage,
    attempt_started,
    expect_no_leftovers,
    kill_tree,
    sharded_leftovers,
)

pytestmark = [pytest.mark.recovery, pytest.mark.slow]

RESTARTS = 10
RANKS = 2
CASES = [("fastpersist-dcp", "fsdp"), ("fastpersist-dcp", "model_parallel"), ("dataflux-dcp", "fsdp"),
         ("dataflux-dcp", "model_parallel")]
FSDP2_ON_CPU = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 7)


def _restarts(rounds: Rounds, job: Job, restarts: int) -> tuple[list[int], dict[int, list[str]]]:
    """Check each attempt's resume, kill a rank, until ``restarts`` restarts are used. Returns the steps
    resumed at, and what killed saves had left when each attempt started (by attempt), directories that
    hold only a killed save's lock included."""
    resumed: list[int] = []
    leftovers: dict[int, list[str]] = {}
    for attempt in range(restarts + 1):
        started = attempt_started(rounds.follower, job, attempt, RANKS)
        for start in started.values():
            check = check_resume(rounds.follower.events, start, ranks=RANKS)
            assert check.ok, f"attempt {attempt}, rank {start['rank']}: {check.describe()}"
        steps = {start["step"] for start in started.values()}
        assert len(steps) == 1, f"attempt {attempt}: the ranks resumed at different steps {started}"
        resumed.append(steps.pop())
        if attempt == restarts:
            break
        live = {start["pid"] for start in started.values()}
        left, locks = sharded_leftovers(rounds.storage, rounds.follower, live)
        left += [f"{checkpoint}: only a killed save's lock" for checkpoint in locks]
        if left:
            leftovers[attempt] = left
        point = ("step", "save")[attempt % 2]
        kill_rank(job, rounds.follower, rounds.rng.randrange(RANKS), point, rounds.rng, attempt=attempt,
                  log=rounds.log, skip=rounds.rng.randrange(3))
    return resumed, leftovers


@pytest.mark.parametrize(("plugin", "strategy"), CASES, ids=[f"{p}-{s}-torchrun" for p, s in CASES])
def test_torchrun_restarts_every_rank_from_the_newest_whole_sharded_checkpoint(plugin: str, strategy: str,
                                                                                storage: Storage, fork_server,
                                                                                tmp_path: Path) -> None:
    if strategy == "model_parallel" and not FSDP2_ON_CPU:
        pytest.skip("FSDP2 (fully_shard) cannot train on CPU before torch 2.7 (CPU streams lack record_event)")
    rounds = Rounds(fork_server, storage, tmp_path / "events.jsonl", seed=zlib.crc32(f"{plugin}{strategy}".encode()))
    config = storage.config(rounds.log_path, strategy=strategy, devices=RANKS)
    agent = fork_server.start_elastic(config, nproc=RANKS, max_restarts=RESTARTS)
    try:
        resumed, leftovers = _restarts(rounds, agent, RESTARTS)
    finally:
        agent.kill_group()
    assert max(resumed) > 0, f"no restart resumed from a checkpoint: {resumed}"
    print(f"resumed at {resumed}")
    expect_no_leftovers(plugin, leftovers)  # every restart above resumed right


@pytest.mark.parametrize("plugin", ["fastpersist-dcp"], ids=["fastpersist-dcp-fsdp-torchrun-cli"])
def test_the_torchrun_command_restarts_from_the_sharded_checkpoint(plugin: str, storage: Storage,
                                                                   tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m benchmarks.recovery.job ...`` in fresh
    processes, as a user runs it: two kills, two restarts, each from the newest whole checkpoint."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun is not None, "torchrun is not installed beside this Python"
    rounds = Rounds(None, storage, tmp_path / "events.jsonl", seed=3)
    config = storage.config(rounds.log_path, strategy="fsdp", devices=RANKS)
    job_args = ProcessLauncher().command(config)[3:]  # after python -m benchmarks.recovery.job
    output = tmp_path / "torchrun.out"
    with open(output, "wb") as stream:
        process = subprocess.Popen([torchrun, "--standalone", f"--nproc-per-node={RANKS}", "--max-restarts=2",
                                    "-m", "benchmarks.recovery.job", *job_args], stdout=stream,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    job = ProcessJob(process, str(output))
    try:
        resumed, leftovers = _restarts(rounds, job, 2)
    finally:
        kill_tree(process.pid)
        process.wait()
    assert resumed[-1] > 0, resumed
    assert not leftovers, leftovers
