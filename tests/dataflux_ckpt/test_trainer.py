"""Lightning end to end: fit with gs:// checkpoints, top-k removal, resume; pickling the plugin."""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle

import pytest
import torch
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from dataflux_ckpt import DatafluxCheckpointIO, DatafluxModelCheckpoint
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C


class ScoredModel(BoringModel):
    """BoringModel with Adam (it has state) and a metric that grows, so top-k keeps the newest."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("score", float(self.global_step))
        return out

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class CaptureStartState(Callback):
    def on_train_start(self, trainer, pl_module):
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())


def _trainer(plugin, dirpath: str, max_steps: int, callbacks=()) -> Trainer:
    return Trainer(
        max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
        plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=dirpath, monitor="score", mode="max", save_top_k=2,
                                   every_n_train_steps=1, save_last=True), *callbacks],
    )


@pytest.mark.slow
@pytest.mark.parametrize("wrap_async", [False, True], ids=["sync", "async"])
def test_fit_top_k_and_resume_with_identical_state(gcs_emulator, gcs_bucket, wrap_async):
    def make_plugin():
        plugin = DatafluxCheckpointIO(chunk_size=C, max_workers=2)
        return AsyncCheckpointIO(plugin) if wrap_async else plugin

    dirpath = f"gs://{gcs_bucket}/run1"
    torch.manual_seed(0)
    model = ScoredModel()
    _trainer(make_plugin(), dirpath, max_steps=5).fit(model)
    reader = DatafluxCheckpointIO()
    kept = [f"{dirpath}/epoch=0-step=4.ckpt", f"{dirpath}/epoch=0-step=5.ckpt", f"{dirpath}/last.ckpt"]
    # Behind AsyncCheckpointIO too: a removal that overtakes a still-queued save cancels it.
    assert reader.list_checkpoints(f"{dirpath}/") == kept

    saved = reader.load_checkpoint(f"{dirpath}/last.ckpt")  # torch's default: weights only
    assert saved["global_step"] == 5
    for key, value in model.state_dict().items():
        assert torch.equal(saved["state_dict"][key], value)

    capture = CaptureStartState()
    resumed = ScoredModel()
    trainer = _trainer(make_plugin(), f"gs://{gcs_bucket}/run2", max_steps=7, callbacks=[capture])
    trainer.fit(resumed, ckpt_path=f"{dirpath}/last.ckpt")
    assert trainer.global_step == 7
    for key, value in saved["state_dict"].items():
        assert torch.equal(capture.weights[key], value)
    expected_opt = saved["optimizer_states"][0]
    assert capture.optimizer["param_groups"] == expected_opt["param_groups"]
    for index, state in expected_opt["state"].items():
        for name, tensor in state.items():
            assert torch.equal(capture.optimizer["state"][index][name], tensor)


@pytest.mark.slow
def test_ckpt_path_last_resumes_from_a_gs_directory(gcs_emulator, gcs_bucket):
    """Stock ModelCheckpoint hands Lightning ``bucket/run/last.ckpt`` (no ``gs://``) and the run
    trains from scratch; DatafluxModelCheckpoint keeps the URL."""
    dirpath = f"gs://{gcs_bucket}/last-run"
    started = []

    class Started(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    for max_steps in (4, 6):
        trainer = Trainer(max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, accelerator="cpu", devices=1,
                          plugins=[DatafluxCheckpointIO(chunk_size=C, max_workers=2)],
                          callbacks=[Started(), DatafluxModelCheckpoint(dirpath=dirpath, every_n_train_steps=2,
                                                                        save_last=True)])
        trainer.fit(ScoredModel(), ckpt_path="last")
    assert started == [0, 4]
    assert trainer.ckpt_path == f"{dirpath}/last.ckpt"


def test_lightning_lists_gs_urls_as_local_paths_without_the_subclass(gcs_emulator, gcs_bucket):
    """Why DatafluxModelCheckpoint exists; fails loudly when Lightning stops dropping the protocol."""
    dirpath = f"gs://{gcs_bucket}/listed"
    DatafluxCheckpointIO().save_checkpoint({"w": torch.ones(1)}, f"{dirpath}/last.ckpt")
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    stock, ours = ModelCheckpoint(dirpath=dirpath), DatafluxModelCheckpoint(dirpath=dirpath)
    assert ours._find_last_checkpoints(trainer) == {f"{dirpath}/last.ckpt"}
    assert stock._find_last_checkpoints(trainer) == {f"{gcs_bucket}/listed/last.ckpt"}, "Lightning changed"


def test_plugin_pickles_without_its_client(make_plugin, ckpt_path):
    """A storage client (sockets, credentials) cannot be pickled; the plugin leaves it behind."""
    client = storage.Client(project="p", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": os.environ["STORAGE_EMULATOR_HOST"]})
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(client)
    plugin = make_plugin(client, deadline_s=77.0)
    plugin.save_checkpoint({"x": torch.ones(3)}, ckpt_path)  # connections are open now
    clone = pickle.loads(pickle.dumps(plugin))
    assert (clone.chunk_size, clone.deadline_s) == (plugin.chunk_size, 77.0)
    assert torch.equal(clone.load_checkpoint(ckpt_path)["x"], torch.ones(3))
    assert clone.gcs is not plugin.gcs


@pytest.mark.slow
def test_spawned_process_saves_with_its_own_client(ckpt_io, ckpt_path):
    state = {"w": torch.arange(C // 2, dtype=torch.float32)}
    process = multiprocessing.get_context("spawn").Process(target=ckpt_io.save_checkpoint, args=(state, ckpt_path))
    process.start()
    process.join(120)
    assert process.exitcode == 0
    assert torch.equal(ckpt_io.load_checkpoint(ckpt_path)["w"], state["w"])
