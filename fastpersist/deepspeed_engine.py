"""DeepSpeed integration: a checkpoint engine whose ``save`` writes through FastPersist.

DeepSpeed routes every checkpoint file of ``engine.save_checkpoint`` through
``engine.checkpoint_engine``. Two ways to put FastPersist there:

- ``fastpersist.deepspeed_initialize(...)`` instead of ``deepspeed.initialize(...)``: when the
  ds_config asks for a checkpoint writer (``"checkpoint": {"writer": {"type": "fast"}}``), the engine
  saves through FastPersist, tuned by the writer block (``io_buffer_size``) and the ``"aio"`` block
  (``block_size``, ``queue_depth``, ``intra_op_parallelism``, ``single_submit``, ``overlap_events``,
  ``use_gds``);
- ``enable_fastpersist(engine, ...)`` after ``deepspeed.initialize``: the same settings from the
  engine's ds_config, with keyword arguments taking precedence.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from fastpersist import _deepspeed_compat
from fastpersist.aio import AioConfig
from fastpersist.context import DEFAULT_BUFFER_MB, FastPersistContext, check_engine_name
from fastpersist.memory import MiB
from fastpersist.reader import fastpersist_load
from fastpersist.writer import SaveStats, fastpersist_save

log = logging.getLogger(__name__)

ENGINE_NAME = "FastPersistCheckpointEngine"
_WRITER_ENGINES = {"FAST": "aio", "PYTHON": "python"}  # ds_config writer "type" -> fastpersist engine


@dataclass(frozen=True)
class WriterSettings:
    """FastPersist settings read from a ds_config (see :func:`writer_settings`)."""

    requested: bool
    engine: str | None
    io_buffer_mb: float
    aio: AioConfig


def writer_settings(ds_config: dict[str, Any]) -> WriterSettings:
    """What a ds_config says about checkpoint writing, in FastPersist's terms.

    ``"checkpoint": {"writer": {"type": "fast" | "python", "io_buffer_size": BYTES}}`` requests
    FastPersist with the aio engine (the gds engine when ``"aio": {"use_gds": true}``) or the python
    engine; ``"mock"`` or no writer block leaves DeepSpeed's own engine in place.

    Raises:
        ValueError: a writer or aio value of the wrong type or range.
    """
    writer = (ds_config.get("checkpoint") or {}).get("writer")
    aio_block = ds_config.get("aio") or {}
    aio = AioConfig.from_ds_config(aio_block)
    if not writer:
        return WriterSettings(False, None, DEFAULT_BUFFER_MB, aio)
    kind = str(writer.get("type", "fast")).upper()
    engine = _WRITER_ENGINES.get(kind)
    if engine == "aio" and aio_block.get("use_gds"):
        engine = "gds"
    size = writer.get("io_buffer_size", DEFAULT_BUFFER_MB * MiB)
    if not isinstance(size, (int, float)) or size <= 0:
        raise ValueError(
            f'ds_config "checkpoint.writer.io_buffer_size" must be a positive byte count, got {size!r}'
        )
    if writer.get("io_buffer_double") is False:
        log.info("FastPersist always double-buffers; checkpoint.writer.io_buffer_double=false is ignored")
    return WriterSettings(engine is not None, engine, size / MiB, aio)


class FastPersistCheckpointEngine(_deepspeed_compat.checkpoint_engine_base()):  # type: ignore[misc]
    """A DeepSpeed ``CheckpointEngine`` that saves with ``fastpersist_save`` and loads with ``fastpersist_load``.

    Settings come from the ds_config (``config_params``), keyword arguments taking precedence.

    Args:
        config_params: the DeepSpeed config object (or a ds_config dict).
        io_buffer_mb: staging buffer size (default: the writer block's ``io_buffer_size``, else 256).
        engine: FastPersist engine (default: from the writer/aio blocks, else ``"aio"``).
        context: a context to use instead of creating one (other settings are then ignored).

    Raises:
        ValueError: unknown engine, or invalid writer/aio settings in the ds_config.
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        io_buffer_mb: float | None = None,
        engine: str | None = None,
        context: FastPersistContext | None = None,
    ) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        settings = writer_settings(_deepspeed_compat.config_params_dict(config_params) or {})
        self.context = context or FastPersistContext(
            engine=check_engine_name(engine) or settings.engine,
            io_buffer_mb=io_buffer_mb or settings.io_buffer_mb,
            aio=settings.aio,
        )
        self.stats: list[SaveStats] = []

    def create(self, info: Any) -> None:
        """Called before a checkpoint's files are saved (``info``: a tag, or DeepSpeed's commit info)."""
        log.debug("%s: checkpoint %s about to be saved", ENGINE_NAME, _deepspeed_compat.commit_tag(info))

    def save(self, state_dict: Any, path: str) -> None:
        """Save one checkpoint file atomically (the previous file at ``path`` survives a failure).

        Raises:
            ContextInUseError: asked for on a thread that is saving or loading with this engine's
                context (from a signal handler that interrupted it); nothing was written.
        """
        self.stats.append(fastpersist_save(state_dict, path, context=self.context))

    def load(self, path: str, map_location: Any = None) -> Any:
        """Load one checkpoint file.

        DeepSpeed checkpoints hold arbitrary objects (configs, enums), so, as DeepSpeed's own engine
        does, this loads without ``weights_only``: load only checkpoints you trust.

        Raises:
            ContextInUseError: asked for on a thread that is saving or loading with this engine's
                context (from a signal handler that interrupted it).
        """
        return fastpersist_load(path, map_location, weights_only=False, context=self.context)

    def commit(self, info: Any) -> bool:
        """Every file is durable once ``save`` returns, so there is nothing left to commit."""
        return True

    def cleanup(self) -> None:
        """Free the staging buffer and handle."""
        self.context.close()


def enable_fastpersist(
    ds_engine: Any,
    *,
    io_buffer_mb: float | None = None,
    engine: str | None = None,
    context: FastPersistContext | None = None,
) -> FastPersistCheckpointEngine:
    """Make ``ds_engine.save_checkpoint``/``load_checkpoint`` go through FastPersist.

    Settings come from the engine's ds_config (writer and ``"aio"`` blocks); arguments override them.

    Args:
        ds_engine: the engine ``deepspeed.initialize`` returned.
        io_buffer_mb: staging buffer size.
        engine: FastPersist engine (``"aio"``, ``"python"``, ``"gds"``).
        context: a context to use instead of creating one.

    Returns:
        The new checkpoint engine (its ``stats`` list one :class:`SaveStats` per file saved).
    """
    config = _deepspeed_compat.ds_config_dict(ds_engine)
    checkpoint_engine = FastPersistCheckpointEngine(
        config, io_buffer_mb=io_buffer_mb, engine=engine, context=context
    )
    ds_engine.checkpoint_engine = checkpoint_engine
    log.info("DeepSpeed engine checkpoints now written by %s (%r)", ENGINE_NAME, checkpoint_engine.context)
    return checkpoint_engine


def deepspeed_initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize`` that honours the ds_config's checkpoint writer with FastPersist.

    Takes and returns exactly what ``deepspeed.initialize`` does. When the ds_config (``config=``, a dict
    or a JSON file path) has ``"checkpoint": {"writer": {"type": "fast" | "python", ...}}``, the returned
    engine's checkpoints are written by :class:`FastPersistCheckpointEngine`, tuned by that block and the
    ``"aio"`` block. The writer block is taken out of what DeepSpeed sees, so DeepSpeed does not also
    set up its own writer (which needs its launcher's environment).

    Raises:
        ValueError: invalid writer or aio settings in the ds_config.
    """
    import deepspeed

    config = kwargs.get("config")
    if isinstance(config, (str, os.PathLike)):
        with open(config) as stream:
            config = json.load(stream)
    settings = writer_settings(config) if isinstance(config, dict) else None
    if settings is None or not settings.requested:
        return deepspeed.initialize(*args, **kwargs)
    checkpoint_block = {key: value for key, value in config["checkpoint"].items() if key != "writer"}
    kwargs["config"] = {**config, "checkpoint": checkpoint_block}
    result = deepspeed.initialize(*args, **kwargs)
    checkpoint_engine = FastPersistCheckpointEngine(config)
    result[0].checkpoint_engine = checkpoint_engine
    log.info("DeepSpeed engine checkpoints written by %s (%r)", ENGINE_NAME, checkpoint_engine.context)
    return result
