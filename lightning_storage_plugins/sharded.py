"""Lightning's FSDP and ModelParallel strategies with their sharded checkpoints in a plugin's storage.

Lightning saves ``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy`` checkpoints
with torch.distributed.checkpoint into local directories only, without a ``CheckpointIO``. The mixins
here replace the three methods that touch storage (``save_checkpoint``, ``load_checkpoint``,
``remove_checkpoint``) and get their DCP writer and reader from the plugin (``storage_writer`` /
``storage_reader``); everything else is Lightning's. The rest of Lightning's checkpoint dict (epoch,
loops, callbacks...) is stored in the same DCP checkpoint, so one ``.metadata`` publishes all of it:
a checkpoint is visible only when complete, and a failed save removes what it wrote.

A save asked for on a thread that is inside a save or load of the same strategy (from a signal
handler, as Lightning's Slurm requeue handler saves ``hpc_ckpt_N.ckpt``, or from a callback) is made
when that operation ends, before it returns
(:class:`~lightning_storage_plugins.ordering.DeferringOperations`, as the single-file plugins do): it
never starts DCP's collectives in the middle of the interrupted save's, nor reuses its buffers, and
never fails it. A DCP save is collective over the ranks, and Lightning's handler runs on every rank
the signal reaches, so each rank defers the handler's save to the end of its own current save: ranks
interrupted during the same collective save each make the deferred saves right after it, in the
order asked for, and their collectives line up. The handler's own collectives (gathering the state to
save, and the barrier after the save) run inside the handler; where the signal reaches the ranks at
different collective points, or not every rank, they meet other collectives, which fail within the
process group's timeout (see ``docs/sharded.md``).
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from typing_extensions import override

from lightning_storage_plugins._lightning_compat import (
    fsdp_state_dict_type,
    saves_distributed_checkpoint,
    sharded_state_dict_context,
)
from lightning_storage_plugins.dcp import LEFTOVERS_TIMEOUT_S, ShardedStorageReader, ShardedStorageWriter
from lightning_storage_plugins.ordering import CheckpointDir, DeferringOperations

__all__ = ["ShardedFSDPMixin", "ShardedModelParallelMixin"]

log = logging.getLogger(__name__)

# The key under which the rest of Lightning's checkpoint dict is stored, as torch.save bytes.
LIGHTNING_STATE_KEY = "lightning_checkpoint"


class _Save(NamedTuple):
    """What a save writes: Lightning's checkpoint dict, and the ``storage_options`` of a full save."""

    checkpoint: dict[str, Any]
    storage_options: Any


class _ShardedCheckpoints(DeferringOperations[str]):
    """What the FSDP and ModelParallel mixins share; ``_model_key`` and ``_saves_sharded`` differ.

    Saves, removals and loads run through :class:`DeferringOperations` (see the module), keyed by
    the path as each rank was given it.
    """

    _model_key = "model"
    # DCP reports a failed save as CheckpointException, a BaseException.
    _failures = (Exception, CheckpointException)

    def __init__(self, *args: Any, writer_options: dict[str, Any] | None = None,
                 reader_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writer_options = dict(writer_options or {})
        self.reader_options = dict(reader_options or {})
        self._start_deferrals()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[misc]
        state.pop("_order", None)  # a pickled copy starts with no saves in flight
        state.pop("_threads", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self._start_deferrals()

    def storage_writer(self, path: str) -> ShardedStorageWriter:
        """The plugin's DCP writer for ``path`` (with ``writer_options``)."""
        raise NotImplementedError

    def storage_reader(self, path: str, weights_only: bool | None = None) -> ShardedStorageReader:
        """The plugin's DCP reader for ``path`` (with ``reader_options``)."""
        raise NotImplementedError

    def _saves_sharded(self) -> bool:
        raise NotImplementedError

    @override
    def preflight(self, checkpoint_dirs: Sequence[CheckpointDir]) -> None:
        """When training starts (on global rank zero, called by :mod:`lightning_storage_plugins.preflight`):
        remove what killed sharded saves left in each checkpoint of the ``ModelCheckpoint``
        directories, never what a live save writes (see ``ShardedStorageWriter.remove_leftovers``),
        within ``LEFTOVERS_TIMEOUT_S`` in all. It raises nothing: what cannot be removed is logged
        and left for the next save of its checkpoint; a directory of another storage (a full
        checkpoint's) is passed over.
        """
        until = time.monotonic() + LEFTOVERS_TIMEOUT_S
        for checkpoint_dir in checkpoint_dirs:
            try:
                checkpoints = self.storage_writer(checkpoint_dir.dirpath).leftover_checkpoints(LEFTOVERS_TIMEOUT_S)
            except ValueError:  # not a directory of this storage: nothing of ours is there
                continue
            except Exception as exc:
                log.warning("could not look for what killed saves left under %s: %s", checkpoint_dir.dirpath, exc)
                continue
            for path in checkpoints:
                left = until - time.monotonic()
                if left <= 0:
                    log.warning("stopped removing what killed saves left after %.0f s; the next save of each "
                                "checkpoint removes the rest", LEFTOVERS_TIMEOUT_S)
                    return
                try:
                    self.storage_writer(path).remove_leftovers(left)
                except Exception as exc:
                    log.warning("could not remove what killed saves left in %s: %s", path, exc)

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

        Asked for on a thread that is inside a save or load of this strategy (from a signal
        handler, or a callback of that operation), the save is made when that operation ends,
        before it returns to its caller, and this call returns at once (see the module).

        Raises:
            TypeError: ``storage_options`` was given for a sharded save.
            DeferredOperationError: a save or removal asked for during this one failed; this
                checkpoint was saved.
        """
        if storage_options is not None and self._saves_sharded():
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take `storage_options`")
        self._saving(_Save(checkpoint, storage_options), os.fspath(filepath))

    @override
    def _write(self, checkpoint: _Save, target: str) -> None:
        if not self._saves_sharded():
            super().save_checkpoint(checkpoint.checkpoint, target, checkpoint.storage_options)  # type: ignore[misc]
            return
        writer = self.storage_writer(self._path(target))
        lightning_state = dict(checkpoint.checkpoint)  # the caller's dict stays as it was given
        state: dict[str, Any] = {self._model_key: lightning_state.pop("state_dict")}
        state.update({f"optimizer_{index}": optimizer_state
                      for index, optimizer_state in enumerate(lightning_state.pop("optimizer_states", []))})
        rest = io.BytesIO()
        torch.save(lightning_state, rest)
        state[LIGHTNING_STATE_KEY] = rest.getvalue()
        try:
            dcp.save(state, storage_writer=writer)
        except BaseException:
            writer.abort()
            raise

    @override
    def _why_deferred_cannot_follow(self, failure: BaseException) -> str | None:
        # DCP reports a failure of any rank's part to every rank (CheckpointException), so every
        # rank then goes on to the deferred saves together. Any other failure may be this rank's
        # alone, or a collective's: a collective save behind it could not meet the other ranks'.
        if isinstance(failure, CheckpointException) or not self._saves_sharded():
            return None
        return (f"{type(failure).__name__}: {failure}; a failure DCP did not report to every rank may be this "
                "rank's alone, and a collective save behind it could not meet the other ranks' collectives")

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint saved by :meth:`save_checkpoint` (model and optimizer states go
        straight into the sharded model and optimizers); anything else as the strategy does.

        ``weights_only`` applies to every pickled item (torch's default when ``None``).

        Raises:
            ReentrantOperationError: asked for on a thread that is inside a save or load of this
                strategy (from a signal handler or a callback); that operation goes on.
            DeferredOperationError: a save or removal asked for during this load failed.
        """
        return self._loading(os.fspath(checkpoint_path), lambda: self._load(checkpoint_path, weights_only))

    def _load(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None) -> dict[str, Any]:
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
        is removed as a link: the checkpoint it points to stays whole. Asked for on a thread that is
        inside a save or load of this strategy, the removal is made when that operation ends (a save
        of ``filepath`` asked for before it, and not yet begun, is then skipped on every rank).

        Raises:
            DeferredOperationError: a save or removal asked for during this one failed.
        """
        self._removing(os.fspath(filepath))

    @override
    def _delete(self, target: str) -> None:
        if not self.is_global_zero:  # type: ignore[attr-defined]
            return
        if "://" not in target and os.path.islink(target):
            os.unlink(target)
            return
        if self.storage_reader(target).exists():
            self.storage_writer(target).remove()
        else:
            self._remove_unsharded(target)

    def _remove_unsharded(self, target: str) -> None:
        """Remove what is at ``target`` that is not a whole sharded checkpoint: a full checkpoint, as
        the strategy does (on rank zero; nothing there: nothing to do)."""
        super().remove_checkpoint(target)  # type: ignore[misc]

    @override
    def _stored(self, target: str) -> bool:
        if "://" not in target and os.path.lexists(target):
            return True
        try:
            return self.storage_reader(target).exists()
        except ValueError:  # not a path of this plugin's storage: a full checkpoint elsewhere
            return False


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
