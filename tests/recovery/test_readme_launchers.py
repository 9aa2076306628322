"""The README's "Preemption and restarts" scripts, run as a user runs them: its Slurm batch script and
``train.py`` on the private Slurm cluster, requeued by Lightning after ``USR1``; its ``torchrun`` command
and ``train_sharded.py``, with a rank killed. (``tests/test_readme.py`` runs the two Python scripts
alone, as the rest of the README's snippets.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.support import ROOT
from tests.support.recovery import kill_tree
from tests.support.slurm import TERMINAL_STATES

pytestmark = [pytest.mark.recovery, pytest.mark.slow]

SECTION = "## Preemption and restarts"
POLL_S = 0.1


def readme_blocks() -> list[tuple[str, str]]:
    """The fenced blocks (language, text) of the README's "Preemption and restarts" section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    return re.findall(r"^```(\w+)\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)


def block(language: str, contains: str) -> str:
    found = [text for lang, text in readme_blocks() if lang == language and contains in text]
    assert len(found) == 1, f"the README's {SECTION[3:]} section has {len(found)} {language} blocks with {contains!r}"
    return found[0]


def wait_until(condition, timeout: float, what: str, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not alive():  # it may have made what is waited for between the two checks, then ended
            assert condition(), f"the job ended while waiting for {what}"
            return
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(POLL_S)


def test_the_readme_batch_script_requeues_and_resumes_from_the_hpc_checkpoint(slurm_cluster, tmp_path: Path) -> None:
    script = block("bash", "#SBATCH --requeue")
    assert "srun python train.py" in script
    (tmp_path / "train.py").write_text(block("python", "SLURMEnvironment(auto_requeue=True)"))
    run_dir, output = tmp_path / "run", tmp_path / "slurm.out"
    script = script.replace("srun python train.py", f"srun {sys.executable} train.py").replace(
        "#SBATCH --requeue", f"#SBATCH --requeue\n#SBATCH --output={output}", 1)
    max_steps = 3000
    job_id = slurm_cluster.sbatch(script=script, cwd=tmp_path,
                                  env={"RUN_DIR": str(run_dir), "MAX_STEPS": str(max_steps)})

    def running() -> bool:
        # Lightning's handler requeues the job itself (REQUEUED, then PENDING); a handler that fell inside a
        # save has its own save deferred to just after that one, so the job may leave RUNNING first.
        return slurm_cluster.job_info(job_id)["JobState"] not in TERMINAL_STATES

    wait_until((run_dir / "checkpoints" / "last.ckpt").exists, 300, "last.ckpt", running)
    slurm_cluster.signal(job_id, "USR1", batch=False)  # what --signal=USR1@90 sends before the time limit
    hpc = run_dir / "hpc_ckpt_1.ckpt"
    wait_until(hpc.exists, 120, "hpc_ckpt_1.ckpt", running)
    slurm_cluster.requeue_now(job_id, restarts=1)
    slurm_cluster.wait_for(job_id, "COMPLETED", 300, restarts=1)
    saved_step = torch.load(hpc, weights_only=True, map_location="cpu")["global_step"]
    log = output.read_text()
    assert 0 < saved_step < max_steps
    assert re.search(rf"Restor\w+ .*{re.escape(str(hpc))}", log), log[-3000:]
    assert log.count(f"trained to step {max_steps}") == 1, log[-3000:]  # the first run ended in the requeue
    # The accounting database records the end a moment after the controller: wait for its record.
    slurm_cluster.wait_for(job_id, "COMPLETED", 120, restarts=1, source="sacct")


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7),
                    reason="FSDP2 (fully_shard) cannot train on CPU before torch 2.7")
def test_the_readme_torchrun_command_restarts_every_rank_from_the_sharded_checkpoint(tmp_path: Path) -> None:
    command = block("bash", "torchrun").strip()
    assert command.startswith("torchrun ") and command.endswith(" train_sharded.py")
    (tmp_path / "train_sharded.py").write_text(block("python", "join_this_restarts_process_group()"))
    run_dir, output = tmp_path / "run", tmp_path / "torchrun.out"
    max_steps = 200
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with open(output, "wb") as stream:
        process = subprocess.Popen([torchrun, *command.split()[1:]], cwd=tmp_path, stdout=stream,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "RUN_DIR": str(run_dir), "MAX_STEPS": str(max_steps)})
    try:
        agent = psutil.Process(process.pid)
        wait_until((run_dir / "checkpoints" / "last.ckpt" / ".metadata").exists, 300, "a whole last.ckpt",
                   lambda: process.poll() is None)
        ranks = [child for child in agent.children() if "train_sharded.py" in " ".join(child.cmdline())]
        assert len(ranks) == 2, ranks
        ranks[1].send_signal(signal.SIGKILL)
        code = process.wait(600)
    finally:
        kill_tree(process.pid)
        process.wait()
    log = output.read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert re.search(r"Restor\w+ .*last\.ckpt", log), log[-3000:]
    assert log.count(f"trained to step {max_steps}") == 2, log[-3000:]  # both ranks, after the restart
