"""DeepSpeed integration: a checkpoint engine whose ``save`` writes through FastPersist.

DeepSpeed (0.16+) routes every checkpoint file of ``engine.save_checkpoint`` through
``engine.checkpoint_engine`` (a :class:`CheckpointEngine`), created from the config in
``_configure_checkpointing``. Its built-in FastPersist writer patches torch.save's internals; this
engine swaps in the no-patch writer instead: ``enable_fastpersist(engine)`` after ``deepspeed.initialize``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from fastpersist.handles import DEFAULT_BUFFER_MB, get_pinned_buffer
from fastpersist.reader import fastpersist_load
from fastpersist.writer import SaveStats, fastpersist_save

log = logging.getLogger(__name__)

ENGINE_NAME = "FastPersistCheckpointEngine"


class FastPersistCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` that saves with ``fastpersist_save`` and loads with ``fastpersist_load``.

    Args:
        config_params: the DeepSpeed config (unused; accepted like DeepSpeed's own engines).
        io_buffer_mb: pinned staging buffer size, allocated on first use.
        engine: FastPersist I/O engine name (``"aio"``, ``"python"``, ``"gds"``).
        aio_handle: DeepSpeed aio handle (default: the shared one).
    """

    def __init__(
        self,
        config_params: Any = None,
        io_buffer_mb: int = DEFAULT_BUFFER_MB,
        engine: str | None = None,
        aio_handle: Any = None,
    ) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.io_buffer_mb = io_buffer_mb
        self.engine = engine
        self.aio_handle = aio_handle
        self.stats: list[SaveStats] = []
        self._buffer: torch.Tensor | None = None

    def _staging(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = get_pinned_buffer(self.io_buffer_mb, self.aio_handle)
        return self._buffer

    def create(self, info: CheckpointCommitInfo) -> None:
        log.debug("%s: checkpoint %s about to be saved", ENGINE_NAME, info.tag)

    def save(self, state_dict: Any, path: str) -> None:
        self.stats.append(
            fastpersist_save(state_dict, path, self.aio_handle, self._staging(), engine=self.engine)
        )

    def load(self, path: str, map_location: Any = None) -> Any:
        # DeepSpeed checkpoints hold arbitrary objects (configs, enums); its own engine loads them unrestricted.
        return fastpersist_load(
            path, map_location, False, self.aio_handle, self._staging(), engine=self.engine
        )

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True


def enable_fastpersist(ds_engine: Any, **kwargs: Any) -> FastPersistCheckpointEngine:
    """Make ``ds_engine.save_checkpoint``/``load_checkpoint`` go through FastPersist; returns the new engine.

    Keyword arguments go to :class:`FastPersistCheckpointEngine`.
    """
    checkpoint_engine = FastPersistCheckpointEngine(getattr(ds_engine, "_config", None), **kwargs)
    ds_engine.checkpoint_engine = checkpoint_engine
    log.info("DeepSpeed engine checkpoints now written by %s", ENGINE_NAME)
    return checkpoint_engine
