"""``ckpt_path="last"`` and Slurm's ``hpc_ckpt_N`` resume from gs:// and redis:// directories, whichever
way the directory is given: ``ModelCheckpoint(dirpath=...)``, ``Trainer(default_root_dir=...)``, or a
logger's ``save_dir``. Real Trainer runs on fake-gcs-server and a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.loggers.logger import DummyExperiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from dataflux_ckpt import DatafluxCheckpointIO, DatafluxModelCheckpoint
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from smartredis_io import SmartRedisCheckpointIO, SmartRedisModelCheckpoint

# The environment in which Lightning's SLURMEnvironment.detect() says the job runs under Slurm.
SLURM_ENV = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242"}


@dataclass
class Scheme:
    """A storage: where its run directories go, and its plugin and ModelCheckpoint."""

    root: str
    plugin: Callable[[], Any]
    checkpoint: type
    service: list[str]  # how a new process reaches the storage (tests.support.restart's options)

    def restart(self, max_steps: int, env: dict[str, str]) -> dict[str, Any]:
        """A new training process on this storage, as a requeued job starts (see tests.support.restart)."""
        command = [sys.executable, "-m", "tests.support.restart", "--scheme", self.root.partition(":")[0],
                   "--root", self.root, "--max-steps", str(max_steps), *self.service]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(params=["gs", "redis"])
def scheme(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scheme]:
    run = f"run-{uuid.uuid4().hex[:8]}"
    if request.param == "gs":
        bucket = request.getfixturevalue("gcs_bucket")
        yield Scheme(f"gs://{bucket}/{run}", lambda: DatafluxCheckpointIO(chunk_size=C, max_workers=2),
                     DatafluxModelCheckpoint, ["--gcs-url", request.getfixturevalue("gcs_emulator").url])
    else:
        server = request.getfixturevalue("redis_server")
        monkeypatch.setenv("SSDB", server.address)  # how Lightning's redis:// filesystem finds the database
        yield Scheme(f"redis://{run}", lambda: SmartRedisCheckpointIO(server.address), SmartRedisModelCheckpoint,
                     ["--redis", server.address])


class StartStep(Callback):
    """Records the step each fit starts at."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.steps.append(trainer.global_step)


class QuietLogger(Logger):
    """A logger that keeps nothing, with the ``save_dir``, ``name`` and ``version`` Lightning puts checkpoints under."""

    def __init__(self, save_dir: str | None, name: str, version: int | str) -> None:
        super().__init__()
        self._save_dir, self._name, self._version = save_dir, name, version

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        return self._version

    @property
    @rank_zero_only
    def experiment(self) -> DummyExperiment:
        return DummyExperiment()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _fit(scheme: Scheme, max_steps: int, start: StartStep, *, dirpath: str | None = None,
         logger: Any = False, ckpt_path: str | None = "last", env_root: str | None = None) -> Trainer:
    trainer = Trainer(
        max_steps=max_steps, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1, default_root_dir=env_root or scheme.root, logger=logger,
        plugins=[scheme.plugin()],
        callbacks=[start, scheme.checkpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)],
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


LAYOUTS = {
    # how the directory is given -> (Trainer options, the checkpoint directory Lightning resolves)
    "dirpath": (lambda root: {"dirpath": f"{root}/given"}, lambda root: f"{root}/given"),
    "default_root_dir": (lambda root: {}, lambda root: f"{root}/checkpoints"),
    "logger_save_dir": (lambda root: {"logger": QuietLogger(root, "logs", 3)},
                        lambda root: f"{root}/logs/version_3/checkpoints"),
    "logger_without_save_dir": (lambda root: {"logger": QuietLogger(None, "nodir", "v7")},
                                lambda root: f"{root}/nodir/v7/checkpoints"),
    "csv_logger": (lambda root: {"logger": CSVLogger(root, name="csv", version=0)},
                   lambda root: f"{root}/csv/version_0/checkpoints"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ckpt_path_last_resumes_from_the_directory_lightning_resolves(scheme: Scheme, layout: str) -> None:
    if layout == "csv_logger" and scheme.root.startswith("redis:"):
        pytest.skip("CSVLogger writes hparams.yaml into its directory, which Lightning 2.5 requires to exist "
                    "first; a redis:// directory exists only while a key is under it")
    options, directory = LAYOUTS[layout]
    start = StartStep()
    first = _fit(scheme, 4, start, **options(scheme.root))
    assert first.checkpoint_callback.dirpath == directory(scheme.root)
    # A new Trainer, as a restarted job makes: it finds last.ckpt before any callback is set up.
    resumed = _fit(scheme, 6, start, **options(scheme.root))
    assert start.steps == [0, 4]
    assert resumed.ckpt_path == f"{directory(scheme.root)}/last.ckpt"
    assert resumed.global_step == 6


@pytest.mark.slow
def test_ckpt_path_last_finds_the_checkpoints_keyed_by_a_local_default_root_dir(
        redis_server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmartRedisCheckpointIO keys the checkpoints of a local directory in the database: there are no
    files to list, and before setup the directory is known only from default_root_dir."""
    monkeypatch.setenv("SSDB", redis_server.address)  # how Lightning's check of the found URL connects
    run = f"run-{uuid.uuid4().hex[:8]}"
    local = Scheme(str(tmp_path / run), lambda: SmartRedisCheckpointIO(redis_server.address, root_dir=tmp_path),
                   SmartRedisModelCheckpoint, [])
    start = StartStep()
    _fit(local, 4, start)
    resumed = _fit(local, 6, start)
    assert start.steps == [0, 4]
    assert resumed.ckpt_path == f"redis://{run}/checkpoints/last.ckpt"
    assert not any(path.is_file() for path in tmp_path.rglob("*")), "the checkpoints are keys, not files"


def test_stock_model_checkpoint_lists_a_remote_default_root_dir_as_a_local_one(gcs_emulator, gcs_bucket) -> None:
    """Why RemoteModelCheckpoint resolves and lists the directory itself; fails loudly when Lightning does."""
    root = f"gs://{gcs_bucket}/stock"
    DatafluxCheckpointIO().save_checkpoint({"w": torch.ones(1)}, f"{root}/checkpoints/last.ckpt")
    trainer = Trainer(default_root_dir=root, logger=False, enable_progress_bar=False)
    assert DatafluxModelCheckpoint()._find_last_checkpoints(trainer) == {f"{root}/checkpoints/last.ckpt"}
    assert ModelCheckpoint()._find_last_checkpoints(trainer) == set(), "Lightning changed"


def test_ckpt_path_last_without_a_last_checkpoint_trains_from_the_start(scheme: Scheme) -> None:
    start = StartStep()
    with pytest.warns(UserWarning, match="no last checkpoint"):
        trainer = _fit(scheme, 2, start)
    assert start.steps == [0]
    assert trainer.ckpt_path is None


@pytest.mark.slow
def test_slurm_requeue_resumes_from_the_hpc_checkpoint_in_default_root_dir(scheme: Scheme) -> None:
    """What Lightning's SLURMEnvironment(auto_requeue=True) does on USR1, without the signal: it
    saves ``hpc_ckpt_N.ckpt`` in ``default_root_dir`` (numbered after those it lists there), and the
    requeued job, a new process under Slurm, finds the newest one there (an fsspec listing) and
    resumes from it."""
    start = StartStep()
    first = _fit(scheme, 3, start, ckpt_path=None)
    hpc_path = first._checkpoint_connector.hpc_save_path(first.default_root_dir)
    assert hpc_path == f"{scheme.root}/hpc_ckpt_1.ckpt"
    first.save_checkpoint(hpc_path)

    requeued = scheme.restart(5, env=SLURM_ENV)
    assert requeued["start"] == 3
    assert requeued["ckpt_path"] == hpc_path
    assert requeued["global_step"] == 5
    assert requeued["next_hpc"] == f"{scheme.root}/hpc_ckpt_2.ckpt", "numbered after the hpc checkpoint it listed"
