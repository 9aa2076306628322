"""A restart cleans what a killed save left on gs://, at once, and never what a live save is writing.

Real processes and real kills: a child saves through the plugin and holds in the middle of the
save (tests.support.held_save); the test waits for its part objects to reach fake-gcs-server, kills
it with SIGKILL (or keeps it running), and then restarts as a new process would: a Trainer starting,
the next save of the path, the next DCP save of the checkpoint. Leases (30 min for a part object)
never run out here: what is removed is removed because its owner is known to be gone.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from dataflux_ckpt import (
    DatafluxCheckpointIO,
    DatafluxModelCheckpoint,
    DatafluxStorageReader,
    DatafluxStorageWriter,
)
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from dataflux_ckpt.upload import PARTS_SUFFIX
from lightning_storage_plugins.ordering import CheckpointDir
from tests.support.gcs import object_names
from tests.support.held_save import held_save
from tests.support.processes import wait_for

SLURM_JOB = {"SLURM_JOB_ID": "9731", "SLURM_CLUSTER_NAME": "testcluster"}


def _parts(url: str, bucket: str, prefix: str) -> list[str]:
    return [name for name in object_names(url, bucket, prefix) if PARTS_SUFFIX in name]


def _kill(child: subprocess.Popen) -> None:
    child.kill()
    child.wait(30)


class PartsAtStart(Callback):
    """Records the part objects under a prefix when training starts (after the preflight, before any save)."""

    def __init__(self, url: str, bucket: str, prefix: str) -> None:
        self.url, self.bucket, self.prefix = url, bucket, prefix
        self.parts: list[str] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: BoringModel) -> None:
        self.parts = _parts(self.url, self.bucket, self.prefix)


def _train(dirpath: str, *callbacks: Callback) -> Trainer:
    trainer = Trainer(max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1,
                      plugins=[DatafluxCheckpointIO(chunk_size=C, max_workers=2)],
                      callbacks=[*callbacks, DatafluxModelCheckpoint(dirpath=dirpath, save_last=True)])
    trainer.fit(BoringModel())
    return trainer


@pytest.mark.slow
def test_a_trainer_start_removes_a_killed_saves_parts_and_keeps_a_live_saves(gcs_emulator, gcs_bucket, caplog):
    url, run = gcs_emulator.url, f"gs://{gcs_bucket}/run"
    with held_save("gs", url, f"{run}/last.ckpt") as killed, held_save("gs", url, f"{run}/epoch=0.ckpt") as live:
        wait_for(lambda: len(_parts(url, gcs_bucket, "run/last.ckpt")) >= 1, "the first part object", child=killed)
        wait_for(lambda: len(_parts(url, gcs_bucket, "run/epoch=0.ckpt")) >= 3, "the live save's parts", child=live)
        _kill(killed)
        left = _parts(url, gcs_bucket, "run/last.ckpt")
        assert left, "the killed save left its part objects"
        live_parts = _parts(url, gcs_bucket, "run/epoch=0.ckpt")

        start = PartsAtStart(url, gcs_bucket, "run/")
        with caplog.at_level(logging.WARNING, logger="dataflux_ckpt"):
            _train(run, start)
        assert sorted(start.parts or []) == sorted(live_parts), "at the start of training, only the live save's parts are left"
        assert f"pid {killed.pid}" in caplog.text and "has exited" in caplog.text
        assert live.poll() is None
        assert _parts(url, gcs_bucket, "run/") == live_parts, "the run's own saves left the live one's parts"


@pytest.mark.slow
def test_the_next_save_of_the_path_removes_a_killed_saves_parts(gcs_emulator, gcs_bucket):
    url, path = gcs_emulator.url, f"gs://{gcs_bucket}/next/last.ckpt"
    with held_save("gs", url, path) as killed:
        wait_for(lambda: len(_parts(url, gcs_bucket, "next/")) >= 1, "the first part object", child=killed)
        _kill(killed)
    assert _parts(url, gcs_bucket, "next/")
    plugin = DatafluxCheckpointIO(chunk_size=C, max_workers=2)
    plugin.save_checkpoint({"w": torch.ones(3)}, path)
    plugin.teardown()  # waits for the clean-up it started in the background
    assert object_names(url, gcs_bucket, "next/") == ["next/last.ckpt"]


def _unshare_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "--uts", "true"], capture_output=True)
    return probe.returncode == 0


# A process in a pid namespace of its own, under another host name: another machine, for owners.
ANOTHER_HOST = ["unshare", "--pid", "--kill-child", "--mount-proc", "--uts", "sh", "-c", 'hostname other-node && exec "$@"',
                "other-node"]


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs unshare (pid and UTS namespaces) to stand for another host")
def test_parts_of_an_earlier_attempt_of_the_slurm_job_on_another_host_are_removed(
        gcs_emulator, gcs_bucket, monkeypatch, caplog):
    """Slurm ends every process of an attempt before it requeues the job: what attempt 0 wrote, on
    any node, is dead once attempt 1 runs; what another node of attempt 1 or another job writes is not."""
    url, run = gcs_emulator.url, f"gs://{gcs_bucket}/slurm"
    attempt = {**SLURM_JOB, "SLURM_RESTART_COUNT": "0"}
    same_attempt = {**SLURM_JOB, "SLURM_RESTART_COUNT": "1"}
    other_job = {**SLURM_JOB, "SLURM_JOB_ID": "9732", "SLURM_RESTART_COUNT": "0"}
    with (held_save("gs", url, f"{run}/a.ckpt", prefix=ANOTHER_HOST, env=attempt) as earlier,
          held_save("gs", url, f"{run}/b.ckpt", prefix=ANOTHER_HOST, env=same_attempt) as peer,
          held_save("gs", url, f"{run}/c.ckpt", prefix=ANOTHER_HOST, env=other_job) as stranger):
        for name, child in (("a", earlier), ("b", peer), ("c", stranger)):
            wait_for(lambda name=name: len(_parts(url, gcs_bucket, f"slurm/{name}.ckpt")) >= 3,
                      f"the parts of {name}.ckpt", child=child)
        kept = _parts(url, gcs_bucket, "slurm/b.ckpt") + _parts(url, gcs_bucket, "slurm/c.ckpt")
        for name, value in same_attempt.items():  # this process: attempt 1 of the job, on this host
            monkeypatch.setenv(name, value)
        with caplog.at_level(logging.WARNING, logger="dataflux_ckpt"):
            DatafluxCheckpointIO().preflight([CheckpointDir(run, links=False)])
        assert sorted(_parts(url, gcs_bucket, "slurm/")) == sorted(kept)
        assert all(child.poll() is None for child in (earlier, peer, stranger)), "all three were running"
        assert "attempt 0 of this Slurm job" in caplog.text


@pytest.mark.slow
def test_a_dcp_save_after_a_killed_one_takes_its_lock_at_once_and_removes_its_objects(gcs_emulator, gcs_bucket):
    """A killed coordinator's save lock would hold every save of the checkpoint off until its lease
    runs out (30 s); its process is known to be gone, so the next save takes it over at once."""
    url, path = gcs_emulator.url, f"gs://{gcs_bucket}/dcp/step-4"
    with held_save("dcp", url, path) as killed:
        wait_for(lambda: len(_parts(url, gcs_bucket, "dcp/step-4/")) >= 1, "the first shard's part objects", child=killed)
        _kill(killed)
    assert "dcp/step-4/.dcp-save.lock" in object_names(url, gcs_bucket, "dcp/step-4/")

    state = {"a": torch.arange(8.0), "b": torch.ones(2)}
    dcp.save(state, storage_writer=DatafluxStorageWriter(path, chunk_size=C, max_workers=2))
    names = object_names(url, gcs_bucket, "dcp/step-4/")
    assert not [name for name in names if PARTS_SUFFIX in name], names
    assert ".dcp-save.lock" not in " ".join(names)
    assert len([name for name in names if name.endswith(".distcp")]) == 1, "only the new save's shard is left"
    loaded = {"a": torch.zeros(8), "b": torch.zeros(2)}
    dcp.load(loaded, storage_reader=DatafluxStorageReader(path))
    assert torch.equal(loaded["a"], state["a"])
