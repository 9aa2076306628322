"""Concurrent sharded saves to one checkpoint, by real processes in their own gloo groups released
together round after round: every round ends with one whole checkpoint holding the state of a save
that reported success, and a save that did not succeed failed with ``ConcurrentWriteError``."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.dcp_ranks import Ranks, load_whole, race_seed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group exists

JOBS = 2


def _reader(storage: str, path: str) -> Any:
    from dataflux_ckpt import DatafluxStorageReader
    from fastpersist import FastPersistStorageReader

    return DatafluxStorageReader(path) if storage == "gs" else FastPersistStorageReader(path)


def _wait(jobs: list[Ranks], world: int, kind: str, round_: int) -> list[Path]:
    """Wait until every rank of every job has reported ``kind`` for ``round_``; a job that exits first
    fails the test with its output."""
    paths = [[Path(job.workdir, f"{kind}-{round_}-{index}-{rank}") for rank in range(world)]
             for index, job in enumerate(jobs)]
    while not all(path.exists() for job_paths in paths for path in job_paths):
        for job, job_paths in zip(jobs, paths, strict=True):
            if job.exited() and not all(path.exists() for path in job_paths):
                raise AssertionError(f"a job exited before {kind} {round_}:\n{job.output()}")
        time.sleep(0.002)
    return [path for job_paths in paths for path in job_paths]


def _race(storage: str, root: str, world: int, rounds: int, folder: Path) -> tuple[list[str], int]:
    """Run ``rounds`` rounds of two ``world``-rank jobs saving to one path; what went wrong in each, and
    in how many rounds one save lost to the other."""
    folder.mkdir()
    gates = []
    for round_ in range(rounds):
        gate = os.open(folder / f"gate-{round_}", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(gate, fcntl.LOCK_EX)
        gates.append(gate)
    path = f"{root}/race"
    problems: list[str] = []
    contested = 0
    jobs = [Ranks([{"op": "race", "storage": storage, "path": path, "dir": str(folder), "job": job,
                    "rounds": rounds}], world, folder, timeout_s=240) for job in range(JOBS)]
    try:
        for round_ in range(rounds):
            _wait(jobs, world, "ready", round_)
            fcntl.flock(gates[round_], fcntl.LOCK_UN)  # both jobs start their save now
            done = _wait(jobs, world, "done", round_)
            outcomes = [json.loads(p.read_text()) for p in done]
            winners = {job for job in range(JOBS) if outcomes[job * world]["ok"]}
            contested += len(winners) < JOBS
            for outcome in outcomes:
                if not outcome["ok"] and not all("ConcurrentWriteError" in kind for kind in outcome["errors"]):
                    problems.append(f"round {round_}: a save failed with {outcome['errors']}: {outcome['text']}")
            if not winners:
                problems.append(f"round {round_}: no save succeeded")
                continue
            try:
                mismatched = {job: load_whole(_reader(storage, path), race_seed(job, round_)) for job in winners}
            except BaseException as err:  # noqa: BLE001 - DCP reports a failed load as a BaseException
                problems.append(f"round {round_}: {sorted(winners)} reported success, the checkpoint does not "
                                f"load: {str(err)[-300:]}")
                continue
            if not any(not keys for keys in mismatched.values()):
                problems.append(f"round {round_}: the checkpoint is no successful save's state: {mismatched}")
        for job in jobs:
            job.join()
    finally:
        for job in jobs:
            job.__exit__(None, None, None)
        for gate in gates:
            os.close(gate)
    return problems, contested


@pytest.fixture
def preconditions(gcs_xml_server: Any) -> Any:
    """GCS's generation preconditions (fake-gcs-server ignores them; the XML server in front enforces
    them), for this process and the processes it starts."""
    with gcs_xml_server.activated():
        yield gcs_xml_server


@pytest.mark.parametrize("storage", ["nvme", "gs"])
def test_two_processes_save_one_checkpoint(storage: str, gs_root: str, nvme_root: Path, tmp_path: Path,
                                           preconditions: Any) -> None:
    root = gs_root if storage == "gs" else str(nvme_root)
    problems, contested = _race(storage, root, 1, 30, tmp_path / "race")
    assert problems == [], f"{len(problems)} of 30 rounds went wrong:\n" + "\n".join(problems)
    assert contested > 0, "the saves never overlapped: the test raced nothing"


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["nvme", "gs"])
def test_two_jobs_of_two_ranks_save_one_checkpoint(storage: str, gs_root: str, nvme_root: Path,
                                                  tmp_path: Path, preconditions: Any) -> None:
    root = gs_root if storage == "gs" else str(nvme_root)
    problems, contested = _race(storage, root, 2, 12, tmp_path / "race")
    assert problems == [], f"{len(problems)} of 12 rounds went wrong:\n" + "\n".join(problems)
    assert contested > 0, "the saves never overlapped: the test raced nothing"
