"""``ckpt_path="last"`` with sharded checkpoints on gs://, through stock Lightning.

Lightning dates each candidate (``DatafluxModelCheckpoint``'s ``last.ckpt``, ``OnExceptionCheckpoint``'s
``on_exception.ckpt``) with ``get_filesystem(path).modified(path)`` and resumes from the newest; gcsfs
gives a prefix no modification time (``KeyError: 'mtime'``), so a sharded checkpoint's commit writes an
object at its own name. Real Trainer runs in new processes (one rank, Lightning's ``FSDPStrategy`` and
``ModelParallelStrategy`` through the Dataflux DCP storage, on fake-gcs-server), with the checkpoint
directory given to ``DatafluxModelCheckpoint`` as ``dirpath`` or taken from ``default_root_dir``: a run
fails at step 5 after saving ``last.ckpt`` at step 4, and Lightning saves ``on_exception.ckpt``; the
next resumes from that (step 5, the newer), saves ``last.ckpt`` at step 6 and is killed at step 7; the
next resumes from ``last.ckpt`` (step 6, now the newer), ends, and ``OnExceptionCheckpoint`` removes
its checkpoint, commit record included.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from typing import Any

import pytest
import torch
from google.cloud import storage as gcs

VARIANTS = [("fsdp", True), ("model_parallel", False)]


def start(kind: str, root: str, dirpath: bool, gcs_url: str, max_steps: int, *, fail_at: int | None = None,
          kill_at: int | None = None) -> dict[str, Any]:
    """One start of the run in a new process: where it started from, and the step it reached (None
    when it was killed)."""
    command = [sys.executable, "-m", "tests.support.dcp_resume_last", "--kind", kind, "--root", root,
               "--max-steps", str(max_steps), "--gcs-url", gcs_url, *(["--dirpath"] if dirpath else []),
               *(["--fail-at", str(fail_at)] if fail_at is not None else []),
               *(["--kill-at", str(kill_at)] if kill_at is not None else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == (-signal.SIGKILL if kill_at is not None else 0), done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {"reached": None, **{key: value for line in lines for key, value in line.items()}}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "dirpath"), VARIANTS, ids=["fsdp-dirpath", "model_parallel-default_root_dir"])
def test_ckpt_path_last_resumes_the_newest_sharded_checkpoint_on_gcs(kind: str, dirpath: bool, gcs_bucket: str,
                                                                     gcs_emulator: Any) -> None:
    if kind == "model_parallel" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 7):
        pytest.skip("FSDP2 (fully_shard) cannot train on CPU before torch 2.7 (CPU streams lack record_event)")
    root = f"gs://{gcs_bucket}/run-{uuid.uuid4().hex[:8]}"
    prefix = root.removeprefix(f"gs://{gcs_bucket}/") + "/checkpoints/"

    def stored() -> set[str]:
        return {blob.name[len(prefix):] for blob in gcs.Client().list_blobs(gcs_bucket, prefix=prefix)}

    failed = start(kind, root, dirpath, gcs_emulator.url, 10, fail_at=5)
    assert (failed["started_at"], failed["ckpt_path"], failed["reached"]) == (0, None, 5)
    killed = start(kind, root, dirpath, gcs_emulator.url, 10, kill_at=7)
    assert killed["ckpt_path"].endswith("/checkpoints/on_exception.ckpt"), killed
    assert killed["started_at"] == 5
    ended = start(kind, root, dirpath, gcs_emulator.url, 10)
    assert ended["ckpt_path"].endswith("/checkpoints/last.ckpt"), ended
    assert (ended["started_at"], ended["reached"]) == (6, 10)
    assert {name.split("/", 1)[0] for name in stored()} == {"last.ckpt"}, stored()
