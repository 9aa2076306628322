"""Slurm's requeue with each plugin, on a private Slurm cluster (the ``slurm_cluster`` fixture).

A batch job (``sbatch --requeue``) runs the recovery job with ``srun``; Lightning's
``SLURMEnvironment(auto_requeue=True)`` handles the requeue signal (``USR1``, what
``--signal=USR1@90`` sends 90 s before the time limit, here sent at a random point of a step or a save
with ``scancel --signal=USR1``): it saves ``hpc_ckpt_1.ckpt`` through the plugin and runs
``scontrol requeue``. Slurm stops the job and starts it again (its hold of about two minutes lifted);
the requeued run resumes from that hpc checkpoint, with the state saved there, trains on, and the job
ends ``COMPLETED``. The README's own batch script and training script do the same.
"""

from __future__ import annotations

import shlex
import zlib
from pathlib import Path

import pytest

from benchmarks.recovery.events import ProcessLauncher, check_resume, hpc_number, slurm_requeue, wait_point
from tests.support import ROOT
from tests.support.recovery import EVENT_PLUGINS, Rounds, Storage, in_flight

pytestmark = [pytest.mark.recovery, pytest.mark.slow]

PLUGINS = EVENT_PLUGINS
# Steps of 0.2 s: the job is still training when Slurm's SIGTERM (after the requeue) reaches it.
STEP_TIME_S = 0.2
MAX_STEPS = 40
START_TIMEOUT_S = 300.0


def batch_script(command: list[str], output: Path) -> str:
    """A batch script as users write one for Lightning's requeue (``--requeue``, ``--signal``), running
    ``command`` as a job step."""
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH --job-name=recovery",
        "#SBATCH --ntasks=1",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@90",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={output}",
        f"cd {shlex.quote(str(ROOT))}",
        "srun " + shlex.join(command),
        "",
    ])


@pytest.mark.parametrize("plugin", PLUGINS, ids=[f"{plugin}-slurm-requeue" for plugin in PLUGINS])
def test_slurm_requeue_resumes_from_the_hpc_checkpoint(plugin: str, storage: Storage, slurm_cluster,
                                                       tmp_path: Path) -> None:
    rounds = Rounds(None, storage, tmp_path / "events.jsonl", seed=zlib.crc32(plugin.encode()))
    config = storage.config(rounds.log_path, max_steps=MAX_STEPS, step_time_s=STEP_TIME_S)
    job_id = slurm_cluster.sbatch(script=batch_script(ProcessLauncher().command(config), tmp_path / "slurm.out"))
    follower = rounds.follower
    first = follower.wait_for(lambda e: e["event"] == "train_start", START_TIMEOUT_S, f"Slurm job {job_id} training")
    assert first["step"] == 0
    # After the first whole last.ckpt, Lightning's requeue signal at a random point of a step or a save.
    follower.wait_for(lambda e: e["event"] == "save_end" and e["path"].endswith("/last.ckpt"), START_TIMEOUT_S,
                      "a whole last.ckpt", since=0)
    point = rounds.rng.choice(["step", "save"])

    class Running:  # the first run, as a Job for wait_point: it runs until Slurm says otherwise
        pid = first["pid"]

        @staticmethod
        def poll() -> int | None:
            return None if slurm_cluster.job_info(job_id)["JobState"] == "RUNNING" else 0

        @staticmethod
        def output_tail(max_bytes: int = 3000) -> str:
            return slurm_cluster.output(job_id)[-max_bytes:]

    trigger, _ = wait_point(Running(), follower, point, rounds.rng, skip=rounds.rng.randrange(2))
    injection = slurm_requeue(slurm_cluster, job_id, follower, restarts=1, log=rounds.log)
    assert injection.extra["hpc_saved"] == "save_end", f"the hpc checkpoint was not saved: {injection}"
    hpc = injection.extra["hpc"]
    assert hpc_number(hpc) == 1 and hpc.startswith(storage.root), hpc
    slurm_cluster.wait_for(job_id, "COMPLETED", START_TIMEOUT_S, restarts=1)

    follower.poll()
    events = follower.events
    first_run = [e for e in events if e.get("pid") == first["pid"]]
    assert any(e["event"] == "signal" and e["name"] == "SIGUSR1" for e in first_run)
    # The requeue's SIGTERM came after the hpc save and was handled as Lightning does (SIGTERMException).
    assert [e["reason"] for e in first_run if e["event"] == "exit"] == ["SIGTERMException"]
    assert not [e for e in first_run if e["event"] == "save_error"]
    (resumed,) = [e for e in events if e["event"] == "train_start" and e["pid"] != first["pid"]]
    check = check_resume(events, resumed, slurm=True)
    assert check.ok and check.expected is not None and check.expected.path == hpc, check.describe()
    assert resumed["step"] == injection.extra["hpc_step"]
    (start,) = [e for e in events if e["event"] == "start" and e["pid"] == resumed["pid"]]
    assert start["attempt"] == 1 and start["slurm_job"] == str(job_id)
    exits = [e for e in events if e["event"] == "exit" and e["pid"] == resumed["pid"]]
    assert exits and exits[-1]["reason"] == "completed" and exits[-1]["step"] == MAX_STEPS
    print(f"job {job_id}: USR1 at {point} (after {trigger['event']} at step {trigger.get('step')}); "
          f"hpc_ckpt_1 at step {resumed['step']}; saves in flight at USR1: "
          f"{[e['path'] for e in in_flight(events, first['pid'], injection.time)]}")
