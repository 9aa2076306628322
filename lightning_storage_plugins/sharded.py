"""Lightning's FSDP and ModelParallel strategies with their sharded checkpoints in a plugin's storage.

Lightning saves ``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy`` checkpoints
with torch.distributed.checkpoint into local directories only, without a ``CheckpointIO``. The mixins
here replace the three methods that touch storage (``save_checkpoint``, ``load_checkpoint``,
``remove_checkpoint``) and get their DCP writer and reader from the plugin (``storage_writer`` /
``storage_reader``); everything else is Lightning's. The rest of Lightning's checkpoint dict (epoch,
loops, callbacks...) is stored in the same DCP checkpoint, so one ``.metadata`` publishes all of it:
a checkpoint is visible only when complete, and a failed save removes what it wrote.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from typing_extensions import override

from lightning_storage_plugins._lightning_compat import (
    fsdp_state_dict_type,
    saves_distributed_checkpoint,
    sharded_state_dict_context,
)
from lightning_storage_plugins.dcp import ShardedStorageReader, ShardedStorageWriter

__all__ = ["ShardedFSDPMixin", "ShardedModelParallelMixin"]

# The key under which the rest of Lightning's checkpoint dict is stored, as torch.save bytes.
LIGHTNING_STATE_KEY = "lightning_checkpoint"


class _ShardedCheckpoints:
    """What the FSDP and ModelParallel mixins share; ``_model_key`` and ``_saves_sharded`` differ."""

    _model_key = "model"

    def __init__(self, *args: Any, writer_options: dict[str, Any] | None = None,
                 reader_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writer_options = dict(writer_options or {})
        self.reader_options = dict(reader_options or {})

    def storage_writer(self, path: str) -> ShardedStorageWriter:
        """The plugin's DCP writer for ``path`` (with ``writer_options``)."""
        raise NotImplementedError

    def storage_reader(self, path: str, weights_only: bool | None = None) -> ShardedStorageReader:
        """The plugin's DCP reader for ``path`` (with ``reader_options``)."""
        raise NotImplementedError

    def _saves_sharded(self) -> bool:
        raise NotImplementedError

    def _load_sharded(self, reader: ShardedStorageReader) -> None:
        raise NotImplementedError

    def _path(self, filepath: str | os.PathLike[str]) -> str:
        path = self.broadcast(os.fspath(filepath))  # type: ignore[attr-defined]
        # pathlib turns "gs://bucket/key" into "gs:/bucket/key"; the plugins parse both.
        return str(path)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Save a sharded checkpoint at ``filepath`` through the plugin (all ranks take part); a full
        one (``state_dict_type="full"``) as the strategy does.

        Raises:
            TypeError: ``storage_options`` was given.
        """
        if not self._saves_sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`")
        writer = self.storage_writer(self._path(filepath))
        state: dict[str, Any] = {self._model_key: checkpoint.pop("state_dict")}
        state.update({f"optimizer_{index}": optimizer_state
                      for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", []))})
        rest = io.BytesIO()
        torch.save(checkpoint, rest)
        state[LIGHTNING_STATE_KEY] = rest.getvalue()
        try:
            dcp.save(state, storage_writer=writer)
        except BaseException:
            writer.abort()
            raise

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint saved by :meth:`save_checkpoint` (model and optimizer states go
        straight into the sharded model and optimizers); anything else as the strategy does.

        ``weights_only`` applies to every pickled item (torch's default when ``None``).
        """
        path = self._path(checkpoint_path)
        reader = self.storage_reader(path, weights_only)
        if not reader.exists():
            if weights_only is None:
                return super().load_checkpoint(checkpoint_path)  # type: ignore[misc]
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        self._load_sharded(reader)
        rest = {LIGHTNING_STATE_KEY: b""}
        dcp.load(rest, storage_reader=reader)
        return torch.load(io.BytesIO(rest[LIGHTNING_STATE_KEY]), weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Delete the whole sharded checkpoint at ``filepath`` (rank 0), or a full one as the strategy does.

        A local ``filepath`` that is a symbolic link (``ModelCheckpoint(save_last="link")`` makes them)
        is removed as a link: the checkpoint it points to stays whole.
        """
        if not self.is_global_zero:  # type: ignore[attr-defined]
            return
        path = os.fspath(filepath)
        if "://" not in path and os.path.islink(path):
            os.unlink(path)
            return
        if self.storage_reader(path).exists():
            self.storage_writer(path).remove()
        else:
            super().remove_checkpoint(filepath)  # type: ignore[misc]


class ShardedFSDPMixin(_ShardedCheckpoints):
    """For a subclass of Lightning's ``FSDPStrategy``: sharded checkpoints (``state_dict_type="sharded"``)
    through the plugin's DCP storage."""

    def _saves_sharded(self) -> bool:
        return fsdp_state_dict_type(self) == "sharded"

    def _load_sharded(self, reader: ShardedStorageReader) -> None:
        from lightning.pytorch.trainer.states import TrainerFn
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model, module = self.model, self.lightning_module  # type: ignore[attr-defined]
        with sharded_state_dict_context(model):
            module_state = {self._model_key: model.state_dict()}
            dcp.load(module_state, storage_reader=reader)
            model.load_state_dict(module_state[self._model_key], strict=module.strict_loading)
            if module.trainer.state.fn != TrainerFn.FITTING:
                return
            for index, optimizer in enumerate(self.optimizers):  # type: ignore[attr-defined]
                key = f"optimizer_{index}"
                optimizer_state = load_sharded_optimizer_state_dict(
                    model_state_dict=module_state[self._model_key], optimizer_key=key, storage_reader=reader)
                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(
                    optim_state_dict=optimizer_state[key], model=model, optim=optimizer))


class ShardedModelParallelMixin(_ShardedCheckpoints):
    """For a subclass of Lightning's ``ModelParallelStrategy``: distributed checkpoints
    (``save_distributed_checkpoint=True``, the default) through the plugin's DCP storage."""

    _model_key = "state_dict"

    def _saves_sharded(self) -> bool:
        return saves_distributed_checkpoint(self)

    def _load_sharded(self, reader: ShardedStorageReader) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        model, module = self.model, self.lightning_module  # type: ignore[attr-defined]
        module_state = {self._model_key: get_model_state_dict(model)}
        dcp.load(module_state, storage_reader=reader)
        model.load_state_dict(module_state[self._model_key], strict=module.strict_loading)
        for index, optimizer in enumerate(self.optimizers):  # type: ignore[attr-defined]
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(model, optimizer)}
            dcp.load(optimizer_state, storage_reader=reader)
            set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state[key],
                                     options=StateDictOptions(cpu_offload=True))
