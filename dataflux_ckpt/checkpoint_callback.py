"""``DatafluxModelCheckpoint``: Lightning's ``ModelCheckpoint`` for ``gs://`` directories."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from dataflux_ckpt.checkpoint_io import DatafluxCheckpointIO
from lightning_storage_plugins.checkpoint_callback import RemoteModelCheckpoint
from lightning_storage_plugins.preflight import storage_plugin

__all__ = ["DatafluxModelCheckpoint"]


class DatafluxModelCheckpoint(RemoteModelCheckpoint):
    """``ModelCheckpoint`` with which ``trainer.fit(model, ckpt_path="last")`` resumes from a
    ``gs://`` directory.

    Stock ``ModelCheckpoint`` saves, lists and removes ``gs://`` checkpoints through gcsfs, but the
    last checkpoints it finds for ``ckpt_path="last"`` lose their ``gs://`` (Lightning reads
    ``bucket/run1/last.ckpt`` as a local path), so the run trains from scratch with only a warning.
    This keeps the URLs. It takes ``ModelCheckpoint``'s arguments.

    With :class:`~dataflux_ckpt.TieredCheckpointIO`, the local tier's ``last`` checkpoints of the
    directory are candidates too (as local files), so that a ``last.ckpt`` saved after its newest
    upload, or never uploaded, is found; Lightning resumes from the candidate modified last.
    """

    @override
    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        # The sharded strategies import torch.distributed.checkpoint: a run under one has imported
        # them already, and any other run is spared them.
        from dataflux_ckpt.strategies import DatafluxFSDPStrategy, DatafluxModelParallelStrategy

        found = super()._find_last_checkpoints(trainer)
        if isinstance(trainer.strategy, (DatafluxFSDPStrategy, DatafluxModelParallelStrategy)):
            # Sharded checkpoints are prefixes, which Lightning cannot date: the strategy names them.
            found = trainer.strategy.last_checkpoints(found, self.checkpoint_directory(trainer))
        plugin = storage_plugin(trainer.strategy.checkpoint_io)
        if isinstance(plugin, DatafluxCheckpointIO):
            found |= set(plugin.last_checkpoints(self.checkpoint_directory(trainer)).values())
        return found
