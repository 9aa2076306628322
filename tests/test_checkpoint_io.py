"""One CheckpointIO contract, checked against all three plugins.

Each plugin is a drop-in for Lightning's ``TorchCheckpointIO``: the same signatures (with
``@override``), ``weights_only`` following torch's default unless the caller chooses, missing
checkpoints reported as ``FileNotFoundError`` naming the path, paths of another storage refused,
copies made by pickling (as spawn-based strategies do) that work, and real ``Trainer`` runs whose
top-k removal leaves only the newest checkpoints, also behind ``AsyncCheckpointIO``. A save pauses
Python's cyclic garbage collector while it pickles, and leaves it as it found it.
"""

from __future__ import annotations

import gc
import inspect
import os
import pickle
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from tests.support.direct_io import o_direct_dir


@dataclass
class Storage:
    """A plugin under test and where it keeps checkpoints."""

    make: Callable[[], CheckpointIO]
    base: str  # a "directory" of this storage (a path, or a URL with a scheme)
    foreign_path: str  # a path of another storage, which the plugin must refuse

    def path(self, name: str) -> str:
        return f"{self.base}/{name}"

    def listing(self) -> list[str]:
        """Names of the checkpoint files under ``base``, through fsspec as Lightning sees them."""
        fs, root = fsspec.core.url_to_fs(self.base)
        fs.invalidate_cache()
        if not fs.exists(root):
            return []
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False) if p.endswith(".ckpt"))


@pytest.fixture(params=["dataflux_ckpt", "fastpersist", "smartredis_io"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    run = uuid.uuid4().hex[:10]
    if request.param == "dataflux_ckpt":
        from dataflux_ckpt import DatafluxCheckpointIO

        bucket = request.getfixturevalue("gcs_bucket")
        yield Storage(lambda: DatafluxCheckpointIO(), f"gs://{bucket}/{run}", str(tmp_path / "local.ckpt"))
    elif request.param == "fastpersist":
        from fastpersist import FastPersistCheckpointIO

        root = o_direct_dir(tmp_path) / run
        root.mkdir()
        yield Storage(lambda: FastPersistCheckpointIO(io_buffer_mb=1), str(root), f"gs://bucket/{run}/x.ckpt")
    else:
        from smartredis_io import SmartRedisCheckpointIO

        address = request.getfixturevalue("redis_server").address
        # Lightning lists and removes redis:// checkpoints through fsspec, which connects where a
        # SmartRedis client would: $SSDB.
        request.getfixturevalue("monkeypatch").setenv("SSDB", address)
        yield Storage(lambda: SmartRedisCheckpointIO(address=address), f"redis://{run}", f"gs://bucket/{run}/x.ckpt")


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    return {
        "state_dict": {
            "weight": torch.randn(64, 33, generator=generator),
            "bias": torch.randn(33, generator=generator).to(torch.bfloat16),
            "steps": torch.arange(5, dtype=torch.int64),
        },
        "global_step": 12,
        "epoch": 1,
        "nested": {"lr": [0.1, 0.01], "name": "adam", "flags": (True, None)},
    }


def _assert_same(loaded: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and loaded.dtype == expected.dtype
        assert torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert loaded.keys() == expected.keys()
        for key in expected:
            _assert_same(loaded[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert type(loaded) is type(expected) and len(loaded) == len(expected)
        for a, b in zip(loaded, expected, strict=True):
            _assert_same(a, b)
    else:
        assert loaded == expected


class _RunsCode:
    """A pickle payload that creates a file when unpickled: what a malicious writer would store."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


class _CollectorProbe:
    """Pickles as ``0``; records whether Python's cyclic garbage collector ran its passes meanwhile."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[bool] = []
        self.fail = fail

    def __reduce__(self) -> tuple[Any, ...]:
        self.seen.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("this object refuses to be pickled")
        return (int, (0,))


@pytest.mark.parametrize("enabled_before", [True, False], ids=["collector-on", "collector-off"])
def test_a_save_pauses_the_garbage_collector_and_leaves_it_as_it_found_it(
    storage: Storage, enabled_before: bool
) -> None:
    plugin = storage.make()
    probe = _CollectorProbe()
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        plugin.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "probe": probe}, storage.path("gc.ckpt"))
        assert probe.seen == [False]
        assert gc.isenabled() is enabled_before
        failing = _CollectorProbe(fail=True)
        with pytest.raises(Exception, match="refuses to be pickled"):
            plugin.save_checkpoint({"state_dict": {}, "probe": failing}, storage.path("gc-failed.ckpt"))
        assert failing.seen == [False]
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()
        plugin.teardown()


def test_a_load_of_many_tensors_leaves_the_collector_one_young_pass(storage: Storage) -> None:
    """Unpickling 10,000 tensors keeps tens of thousands of containers alive in the unpickler's memo
    until it ends: with the collector on, they set off dozens of its passes in every load and are
    promoted, so full passes over the whole process follow. Paused, they are freed by reference
    counting, and the collector meets only the loaded object's containers, once."""
    plugin = storage.make()
    path = storage.path("many.ckpt")
    try:
        state = {f"layer{i}.weight": torch.full((4,), float(i)) for i in range(10_000)}
        plugin.save_checkpoint({"state_dict": state}, path)
        passes: list[int] = []

        def count(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                passes.append(info["generation"])

        gc.collect()  # every generation's count starts at zero
        gc.callbacks.append(count)
        try:
            loaded = plugin.load_checkpoint(path)
            young_pass = [0]  # the first allocation after the load sets it off
        finally:
            gc.callbacks.remove(count)
        assert passes in ([], young_pass)
        assert gc.isenabled()
        assert torch.equal(loaded["state_dict"]["layer9999.weight"], state["layer9999.weight"])
    finally:
        plugin.teardown()


@pytest.mark.parametrize("method", ["save_checkpoint", "load_checkpoint", "remove_checkpoint"])
def test_signatures_are_lightnings_with_override(storage: Storage, method: str) -> None:
    plugin = storage.make()
    ours = inspect.signature(getattr(type(plugin), method))
    lightning = inspect.signature(getattr(CheckpointIO, method))
    expected = list(lightning.parameters)
    if method == "load_checkpoint" and "weights_only" not in expected:
        expected.append("weights_only")  # Lightning before 2.6 has no weights_only; we take it on every version
    assert list(ours.parameters) == expected
    for name, parameter in lightning.parameters.items():
        assert ours.parameters[name].default == parameter.default, f"{method}({name}=...)"
    if method == "load_checkpoint":
        assert ours.parameters["weights_only"].default is None
    assert getattr(getattr(type(plugin), method), "__override__", False), f"{method} lacks @override"


def test_round_trip_is_exact(storage: Storage) -> None:
    plugin = storage.make()
    path = storage.path("round-trip.ckpt")
    plugin.save_checkpoint(_state(), path)
    _assert_same(plugin.load_checkpoint(path, map_location="cpu"), _state())
    _assert_same(plugin.load_checkpoint(path, weights_only=True), _state())
    plugin.teardown()


def test_loading_runs_no_code_unless_the_caller_asks(storage: Storage, tmp_path: Path) -> None:
    plugin = storage.make()
    path = storage.path("payload.ckpt")
    marker = tmp_path / "code-ran"
    plugin.save_checkpoint({"state_dict": {}, "payload": _RunsCode(str(marker))}, path)

    with pytest.raises(Exception) as refused:  # torch's UnpicklingError, or the plugin's error naming the path
        plugin.load_checkpoint(path)
    assert not marker.exists(), "loading with the default weights_only ran code from the checkpoint"
    assert "weights_only" in str(refused.value)

    plugin.load_checkpoint(path, weights_only=False)  # the caller's explicit choice is passed through
    assert marker.exists()
    plugin.teardown()


def test_missing_checkpoint_is_file_not_found_naming_it(storage: Storage) -> None:
    plugin = storage.make()
    path = storage.path("never-saved.ckpt")
    with pytest.raises(FileNotFoundError, match="never-saved.ckpt"):
        plugin.load_checkpoint(path)
    plugin.remove_checkpoint(path)  # removing what is not there is not an error, as in TorchCheckpointIO


def test_remove_then_load_is_file_not_found(storage: Storage) -> None:
    plugin = storage.make()
    path = storage.path("removed.ckpt")
    plugin.save_checkpoint(_state(), path)
    plugin.remove_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(path)


def test_path_of_another_storage_is_refused(storage: Storage, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a plugin that took a URL for a relative local path writes here, not in the checkout
    plugin = storage.make()
    with pytest.raises(ValueError, match=r"gs://|local|path|URL|scheme"):
        plugin.save_checkpoint(_state(), storage.foreign_path)


def test_a_pickled_copy_works(storage: Storage) -> None:
    plugin = storage.make()
    path = storage.path("before-pickling.ckpt")
    plugin.save_checkpoint(_state(), path)  # the original has opened its connections or handles
    copy = pickle.loads(pickle.dumps(plugin))
    _assert_same(copy.load_checkpoint(path), _state())
    copy.save_checkpoint(_state(), storage.path("from-the-copy.ckpt"))
    _assert_same(plugin.load_checkpoint(storage.path("from-the-copy.ckpt")), _state())
    copy.teardown()
    plugin.teardown()


class _ScoredModel(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("score", float(self.global_step))
        return out


@pytest.mark.slow
@pytest.mark.parametrize("wrap_async", [False, True], ids=["sync", "async"])
def test_trainer_top_k_keeps_only_the_newest(storage: Storage, tmp_path: Path, wrap_async: bool) -> None:
    plugin: CheckpointIO = storage.make()
    if wrap_async:
        plugin = AsyncCheckpointIO(plugin)
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=8, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1, plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=storage.base, monitor="score", mode="max", save_top_k=1,
                                   every_n_train_steps=1, save_last=True)],
    )
    trainer.fit(_ScoredModel())
    assert storage.listing() == ["epoch=0-step=8.ckpt", "last.ckpt"]

    resumed = Trainer(
        default_root_dir=tmp_path, max_steps=10, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
        plugins=[storage.make()], enable_checkpointing=False,
    )
    resumed.fit(_ScoredModel(), ckpt_path=storage.path("last.ckpt"))
    assert resumed.global_step == 10


# Fail early, in plain text ------------------------------------------------------------------------
ESCAPE = "\x1b"


def _make_with(storage: Storage, **options: Any) -> CheckpointIO:
    """The storage's plugin made with extra constructor options."""
    plugin = storage.make()
    return type(plugin)(**{**_constructor_options(plugin), **options})


def _constructor_options(plugin: CheckpointIO) -> dict[str, Any]:
    if type(plugin).__name__ == "SmartRedisCheckpointIO":
        return {"address": plugin.address}
    if type(plugin).__name__ == "FastPersistCheckpointIO":
        return {"io_buffer_mb": 1}
    return {}


def test_weights_only_is_a_bool_or_none_at_construction_and_load(storage: Storage) -> None:
    with pytest.raises(TypeError, match=r"weights_only must be True, False or None, not 'yes'"):
        _make_with(storage, weights_only="yes")
    plugin = _make_with(storage, weights_only=False)  # a bool is taken
    path = storage.path("weights-only-arg.ckpt")
    plugin.save_checkpoint(_state(), path)
    with pytest.raises(TypeError, match=r"weights_only must be True, False or None, not 1"):
        plugin.load_checkpoint(path, weights_only=1)
    plugin.teardown()


def test_a_weights_only_refusal_is_typed_plain_text_naming_the_checkpoint(storage: Storage, tmp_path: Path) -> None:
    from lightning_storage_plugins.ordering import WeightsOnlyError

    plugin = storage.make()
    path = storage.path("refused.ckpt")
    plugin.save_checkpoint({"state_dict": {}, "payload": _RunsCode(str(tmp_path / "ran"))}, path)
    with pytest.raises(WeightsOnlyError) as refused:
        plugin.load_checkpoint(path)
    text = str(refused.value)
    assert ESCAPE not in text, text
    assert "refused.ckpt" in text and "io.open" in text and "weights_only=False" in text
    plugin.teardown()


def test_a_weights_only_refusal_reaches_trainer_fit_typed_and_plain(storage: Storage, tmp_path: Path) -> None:
    from lightning_storage_plugins.ordering import WeightsOnlyError

    plugin = storage.make()
    path = storage.path("refused-by-fit.ckpt")
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                      plugins=[plugin])
    trainer.fit(_ScoredModel())
    trainer.save_checkpoint(path)
    state = plugin.load_checkpoint(path, weights_only=False)
    state["payload"] = _RunsCode(str(tmp_path / "ran"))
    plugin.save_checkpoint(state, path)
    resumed = Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                      plugins=[storage.make()])
    with pytest.raises(WeightsOnlyError) as refused:
        resumed.fit(_ScoredModel(), ckpt_path=path)
    assert ESCAPE not in str(refused.value)
    assert not (tmp_path / "ran").exists()


# Links: removing a link removes the link, never its target ----------------------------------------
class _LastNamedByStep(ModelCheckpoint):
    CHECKPOINT_NAME_LAST = "last-{step}"


def _link_run(plugin: CheckpointIO, dirpath: str, root: Path, max_steps: int, **fit: Any) -> Trainer:
    trainer = Trainer(
        default_root_dir=root, max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1, plugins=[plugin],
        callbacks=[_LastNamedByStep(dirpath=dirpath, monitor="score", mode="max", save_top_k=2,
                                    every_n_train_steps=2, save_last="link")],
    )
    trainer.fit(_ScoredModel(), **fit)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("wrap_async", [False, True], ids=["sync", "async"])
def test_rotating_linked_last_checkpoints_keeps_their_targets(storage: Storage, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              wrap_async: bool) -> None:
    """``save_last="link"`` with a templated last name: each new ``last-step=N`` link replaces the
    previous one, whose removal must not reach the top-k checkpoint it pointed to."""
    if "://" in storage.base:  # Lightning makes links in the local filesystem only: refused before step 1
        with pytest.raises(ValueError, match="save_last='link'"):
            _link_run(storage.make(), storage.base, tmp_path, max_steps=6)
        assert storage.listing() == [], "the run saved before it was refused"
    monkeypatch.chdir(tmp_path)  # SmartRedis keys local paths relative to the working directory
    plugin = storage.make()
    if type(plugin).__name__ == "DatafluxCheckpointIO":  # gs:// only
        return
    dirpath = storage.base if "://" not in storage.base else str(tmp_path / "links")
    _link_run(AsyncCheckpointIO(plugin) if wrap_async else plugin, dirpath, tmp_path, max_steps=6)

    names = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []
    assert [n for n in names if n.startswith("last")] == ["last-step=6.ckpt"]
    assert os.path.islink(os.path.join(dirpath, "last-step=6.ckpt"))
    reader = storage.make()
    for step in (4, 6):  # top-k keeps these two, whole
        state = reader.load_checkpoint(os.path.join(dirpath, f"epoch=0-step={step}.ckpt"))
        assert state["global_step"] == step
    with pytest.raises(FileNotFoundError):
        reader.load_checkpoint(os.path.join(dirpath, "epoch=0-step=2.ckpt"))
    assert reader.load_checkpoint(os.path.join(dirpath, "last-step=6.ckpt"))["global_step"] == 6

    resumed = _link_run(storage.make(), str(tmp_path / "resumed"), tmp_path, max_steps=8,
                        ckpt_path=os.path.join(dirpath, "last-step=6.ckpt"))
    assert resumed.global_step == 8
    reader.remove_checkpoint(os.path.join(dirpath, "last-step=6.ckpt"))
    assert not os.path.lexists(os.path.join(dirpath, "last-step=6.ckpt"))
    assert reader.load_checkpoint(os.path.join(dirpath, "epoch=0-step=6.ckpt"))["global_step"] == 6
