"""The Lightning adapter: every private Lightning name it reaches exists on the installed Lightning and
still means what the adapter takes it to mean. A Lightning release that renames, drops or changes one of
them fails here, by name, before any training run reaches it."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import lightning
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.strategies import fsdp as fabric_fsdp
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies.launchers import multiprocessing as mp_launcher
from lightning.pytorch.strategies.launchers import xla as xla_launcher
from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

from lightning_storage_plugins import _lightning_compat
from lightning_storage_plugins._lightning_compat import (
    LAUNCHER_HANDBACK_NAME,
    fsdp_state_dict_type,
    is_launcher_handback_path,
    saves_distributed_checkpoint,
    sharded_state_dict_context,
)


def test_the_sharded_state_dict_context_is_lightnings_one_argument_function() -> None:
    function = fabric_fsdp._get_sharded_state_dict_context
    assert list(inspect.signature(function).parameters) == ["module"]


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group for the test, gone afterwards (no other rank to wait for on the way out)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(os.fspath(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_the_sharded_state_dict_context_selects_fsdps_sharded_state_dict(single_rank_group: None) -> None:
    model = FullyShardedDataParallel(torch.nn.Linear(3, 2), device_id=torch.device("cpu"))
    before = FullyShardedDataParallel.get_state_dict_type(model).state_dict_type
    with sharded_state_dict_context(model):
        assert FullyShardedDataParallel.get_state_dict_type(model).state_dict_type == StateDictType.SHARDED_STATE_DICT
        assert set(model.state_dict()) == {"weight", "bias"}
    assert FullyShardedDataParallel.get_state_dict_type(model).state_dict_type == before


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_fsdp_state_dict_type_is_what_the_strategy_was_made_with(kind: str) -> None:
    assert fsdp_state_dict_type(FSDPStrategy(state_dict_type=kind)) == kind
    assert fsdp_state_dict_type(FSDPStrategy()) == "full"


@pytest.mark.parametrize("flag", [True, False])
def test_saves_distributed_checkpoint_is_what_the_strategy_was_made_with(flag: bool) -> None:
    assert saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=flag)) is flag
    assert saves_distributed_checkpoint(ModelParallelStrategy()) is True


@pytest.mark.parametrize("launcher", [mp_launcher, xla_launcher], ids=["ddp_spawn", "xla"])
def test_launchers_still_hand_weights_back_through_the_file_name_the_adapter_knows(launcher: object) -> None:
    source = inspect.getsource(launcher)  # type: ignore[arg-type]
    assert f'"{LAUNCHER_HANDBACK_NAME}"' in source, (
        f"Lightning {lightning.__version__}'s {launcher.__name__} no longer writes {LAUNCHER_HANDBACK_NAME}"  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize(("path", "expected"), [
    ("/tmp/x/.temp.ckpt", True),
    (Path("/tmp/x/.temp.ckpt"), True),
    ("gs://bucket/.temp.ckpt", False),
    ("/tmp/x/epoch=0.ckpt", False),
    ("/tmp/x/.temp.ckpt.bak", False),
])
def test_is_launcher_handback_path(path: str | Path, expected: bool) -> None:
    assert is_launcher_handback_path(path) is expected


def test_a_missing_private_name_is_an_error_naming_lightning_and_the_name() -> None:
    strategy = FSDPStrategy()
    with pytest.raises(RuntimeError, match=rf"Lightning {lightning.__version__} has no .*FSDPStrategy\._no_such"):
        _lightning_compat._private(strategy, "_no_such")
    with pytest.raises(RuntimeError, match=r"lightning\.fabric\.strategies\.fsdp\._no_such"):
        _lightning_compat._private(fabric_fsdp, "_no_such")


def test_model_checkpoint_finds_last_checkpoints_by_trainer() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert list(inspect.signature(ModelCheckpoint._find_last_checkpoints).parameters) == ["self", "trainer"]


@pytest.mark.parametrize("layout", ["dirpath", "logger", "default_root_dir"])
def test_checkpoint_directory_is_where_model_checkpoints_setup_puts_it(tmp_path: Path, layout: str) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers import CSVLogger

    from lightning_storage_plugins._lightning_compat import checkpoint_directory

    logger = CSVLogger(tmp_path, name="logs", version=2) if layout == "logger" else False
    trainer = Trainer(default_root_dir=tmp_path, logger=logger, enable_progress_bar=False)
    callback = ModelCheckpoint(dirpath=tmp_path / "given" if layout == "dirpath" else None)
    resolved = checkpoint_directory(callback, trainer)  # before setup, as for ckpt_path="last"
    callback.setup(trainer, BoringModel(), "fit")
    assert resolved == str(callback.dirpath)
    expected = {"dirpath": tmp_path / "given", "logger": tmp_path / "logs" / "version_2" / "checkpoints",
                "default_root_dir": tmp_path / "checkpoints"}[layout]
    assert resolved == str(expected)
