"""One rank of a real Lightning Trainer run with a sharded-checkpoint strategy (FSDP or ModelParallel)
saving through a plugin's DCP storage, started by :mod:`tests.support.dcp_ranks` with torchrun's
environment (so Lightning does not launch processes itself).

The run trains 4 steps with ``ModelCheckpoint(save_top_k=2)`` after every step, then resumes a new
Trainer from the last checkpoint and records whether the model and optimizer states it starts from
are those the first run ended with.
"""

from __future__ import annotations

import os
from typing import Any


def torchrun_environ(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "dcp-test"}


def _strategy(kind: str, storage: str) -> Any:
    if storage == "gs":
        from dataflux_ckpt import DatafluxFSDPStrategy as FSDP
        from dataflux_ckpt import DatafluxModelParallelStrategy as ModelParallel

        options: dict[str, Any] = {"writer_options": {"chunk_size": 64 * 1024, "max_workers": 2}}
    else:
        from fastpersist import FastPersistFSDPStrategy as FSDP
        from fastpersist import FastPersistModelParallelStrategy as ModelParallel

        options = {"writer_options": {"io_buffer_mb": 1}}
    if kind == "fsdp":
        return FSDP(state_dict_type="sharded", **options)
    return ModelParallel(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1, **options)


def model_class(kind: str, widths: tuple[int, ...] = (64,)) -> type:
    """A BoringModel whose ``layer`` is a stack of linear layers of ``widths`` (32 inputs, 2 outputs)
    sharded for ``kind``, with AdamW, that logs its step (for ``ModelCheckpoint(monitor=...)``) and
    records the full model and optimizer states it starts training from (``started_from``)."""
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            sizes = (32, *widths)
            layers: list[torch.nn.Module] = []
            for inputs, outputs in zip(sizes[:-1], sizes[1:], strict=True):
                layers += [torch.nn.Linear(inputs, outputs), torch.nn.ReLU()]
            self.layer = torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], 2))
            self.started_from: dict[str, Any] | None = None

        def configure_model(self) -> None:
            if kind == "fsdp":  # wrapped here: Lightning wraps with the GPU's device id only
                from torch.distributed.fsdp import FullyShardedDataParallel

                if not isinstance(self.layer, FullyShardedDataParallel):
                    self.layer = FullyShardedDataParallel(self.layer, device_id=torch.device("cpu"),
                                                          use_orig_params=True)
            else:
                from torch.distributed.fsdp import fully_shard

                for layer in self.layer:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("global_step", float(self.global_step))
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05)

        def on_train_start(self) -> None:
            self.started_from = _full_states(self.trainer.strategy.model, self.trainer.optimizers[0])
            self.started_from["step"] = self.trainer.global_step

    return Model


def _full_states(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": {k: v.clone() for k, v in model_state.items()},
            "exp_avg": [s["exp_avg"].clone() for s in optimizer_state["state"].values()]}


def run_trainer(kind: str, storage: str, root: str) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    Model = model_class(kind)

    def trainer(max_steps: int, checkpoint: ModelCheckpoint | None) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=_strategy(kind, storage),
                         max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[checkpoint] if checkpoint else None, enable_checkpointing=checkpoint is not None)

    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=f"{root}/checkpoints", every_n_train_steps=1, save_top_k=2,
                                 monitor="global_step", mode="max", filename="{global_step:.0f}")
    first = trainer(4, checkpoint)
    model = Model()
    first.fit(model)
    ended_with = _full_states(first.strategy.model, first.optimizers[0])
    kept = sorted(os.path.basename(path) for path in checkpoint.best_k_models)
    resumed_model = Model()
    second = trainer(6, None)
    second.fit(resumed_model, ckpt_path=checkpoint.best_model_path)
    start = resumed_model.started_from
    assert start is not None
    same_model = all(torch.equal(start["model"][k], v) for k, v in ended_with["model"].items())
    same_optimizer = all(torch.equal(a, b) for a, b in zip(start["exp_avg"], ended_with["exp_avg"], strict=True))
    return {"kept": kept, "best": os.path.basename(checkpoint.best_model_path), "resumed_at": start["step"], "ended_at": second.global_step,
            "same_model": same_model, "same_optimizer": same_optimizer}


def _checkpoints(folder: str) -> dict[str, Any]:
    """What ``folder`` holds: each link with its target, each checkpoint directory with whether every
    file its DCP metadata names is there, whole."""
    import pickle

    found: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path):
            found[name] = {"link": os.readlink(path)}
            continue
        whole = False
        try:
            with open(os.path.join(path, ".metadata"), "rb") as stream:
                metadata = pickle.load(stream)
            whole = bool(metadata.storage_data) and all(
                os.path.getsize(os.path.join(path, info.relative_path)) >= info.offset + info.length
                for info in metadata.storage_data.values())
        except OSError:
            pass
        found[name] = {"whole": whole}
    return found


def run_link_rotation(kind: str, storage: str, root: str) -> dict[str, Any]:
    """Train 4 steps keeping the top 2 checkpoints, with ``save_last="link"`` and a last name that
    changes every step (so every step removes the previous ``last`` link); with Lightning's own
    strategy (``storage="stock"``) or the NVMe plugin's. What the checkpoint folder holds afterwards."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    class Model(BoringModel):
        def configure_model(self) -> None:
            if kind == "fsdp":
                from torch.distributed.fsdp import FullyShardedDataParallel

                if not isinstance(self.layer, FullyShardedDataParallel):
                    self.layer = FullyShardedDataParallel(self.layer, device_id=torch.device("cpu"),
                                                          use_orig_params=True)
            else:
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("global_step", float(self.global_step))
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    class StockFSDP(FSDPStrategy):
        """Lightning's FSDPStrategy as it is (Lightning refuses the plain class on the CPU by its type)."""

    if storage == "stock":
        strategy: Any = (StockFSDP(state_dict_type="sharded") if kind == "fsdp"
                         else ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    else:
        strategy = _strategy(kind, storage)
    folder = f"{root}/{storage}/checkpoints"
    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=2, monitor="global_step",
                                 mode="max", filename="{global_step:.0f}", save_last="link")
    checkpoint.CHECKPOINT_NAME_LAST = "last-{step}"
    torch.manual_seed(0)
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=4, limit_val_batches=0, logger=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=f"{root}/{storage}",
              callbacks=[checkpoint]).fit(Model())
    return {"storage": storage, "checkpoints": _checkpoints(folder)}
