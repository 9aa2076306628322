"""The recovery job: a Lightning training run that checkpoints through one storage plugin and comes back.

    python -m benchmarks.recovery.job --plugin fastpersist-aio --root /mnt/nvme0/run --event-log events.jsonl

Each start resumes from the run's newest checkpoint, as users resume: ``fit(ckpt_path="last")``, and
under Slurm with ``SLURMEnvironment(auto_requeue=True)`` Lightning's own choice (``ckpt_path=None``:
the newest ``hpc_ckpt_N`` in ``--root``, else ``"last"``). It checkpoints every ``--every-n-steps``
through the plugin's ``ModelCheckpoint`` (``save_last=True``), optionally behind Lightning's
``AsyncCheckpointIO``, and on an exception (Lightning's ``SIGTERMException`` after a SIGTERM among them)
through ``OnExceptionCheckpoint``.

What happens goes to the event log given by ``--event-log``, one JSON object a line, each written with one
``write`` to a file opened for appending (so that lines of several processes never mix, and a killed
process leaves every line it wrote): see :class:`EventLog`. :mod:`benchmarks.recovery.events` reads it.

The model is a stack of ``--width``-wide linear layers, as many as make a checkpoint (weights and AdamW's
two moments) of about ``--size-mb``; data are random, from a fixed seed. A step waits ``--step-time-s``
besides its own compute, standing for a real model's step (which, on an accelerator, leaves the CPU to
the storage plugin).

Plugins (``--plugin``), each with the storage its ``--root`` names:

* single-file, on ``--strategy single``: ``dataflux`` (gs://), ``fastpersist`` (its defaults: aio
  saves, loads read straight into the tensors), ``fastpersist-aio`` and ``fastpersist-python`` (that
  engine for saves and loads; a local directory), ``smartredis`` (redis://), and the baselines
  ``torch-local`` (``TorchCheckpointIO``, a local directory), ``torch-gcsfs`` (``TorchCheckpointIO``
  through gcsfs, gs://) and ``torch-redis`` (``TorchCheckpointIO`` through fsspec's ``redis://``
  filesystem, the one ``smartredis_io`` registers);
* sharded (DCP), on ``--strategy fsdp`` or ``model_parallel``: ``dataflux-dcp`` (gs://),
  ``fastpersist-dcp`` (a local directory), and the baselines ``torch-dcp`` (Lightning's own strategies,
  DCP's ``FileSystemWriter``, a local directory) and ``torch-dcp-gcsfs`` (DCP's ``FsspecWriter``
  through gcsfs, gs://: see :mod:`benchmarks.recovery.fsspec_dcp`). Under ``torchrun`` each rank runs
  this job.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

SINGLE_FILE_PLUGINS = ("dataflux", "fastpersist", "fastpersist-aio", "fastpersist-python", "smartredis",
                       "torch-local", "torch-gcsfs", "torch-redis")
SHARDED_PLUGINS = ("dataflux-dcp", "fastpersist-dcp", "torch-dcp", "torch-dcp-gcsfs")
PLUGINS = SINGLE_FILE_PLUGINS + SHARDED_PLUGINS
STRATEGIES = ("single", "fsdp", "model_parallel")
# Where each plugin keeps checkpoints: the scheme its --root must have ("" for a local directory).
SCHEMES = {"dataflux": "gs", "torch-gcsfs": "gs", "dataflux-dcp": "gs", "torch-dcp-gcsfs": "gs", "smartredis": "redis",
           "torch-redis": "redis"}
CHECKPOINT_SUBDIR = "checkpoints"
# The event of one timing of a sharded load's own cost, its bytes in memory (JobConfig.dcp_loads).
DCP_LOAD_EVENT = "dcp_load"
ON_EXCEPTION_NAME = "on_exception"
# AdamW keeps two moments per weight: a checkpoint holds about three times the weights' bytes.
_CHECKPOINT_BYTES_PER_WEIGHT = 3 * 4
_DATA_ROWS = 64
_BATCH_SIZE = 4
# Elements read from each end of each tensor for a state's digest (see state_digest).
_DIGEST_ELEMENTS = 8
_MIB = 1 << 20


@dataclass(frozen=True)
class JobConfig:
    """One run of the recovery job (every start of it, after each event, takes the same config).

    Args:
        plugin: one of :data:`PLUGINS`.
        root: the Trainer's ``default_root_dir``; checkpoints go to ``<root>/checkpoints``, Lightning's
            Slurm handler saves ``<root>/hpc_ckpt_N.ckpt``. A local directory, ``gs://bucket/prefix`` or
            ``redis://name``, as the plugin needs.
        event_log: the event log (JSON lines), appended to by every start of the run.
        strategy: ``single`` for the single-file plugins, ``fsdp`` or ``model_parallel`` for the sharded ones.
        every_n_steps: checkpoint every N optimizer steps (``ModelCheckpoint(every_n_train_steps=N)``).
        save_top_k: step checkpoints kept besides ``last.ckpt`` (0: only ``last.ckpt`` is saved).
        max_steps: the run ends after this many steps in all.
        size_mb: the checkpoint's size in MiB, about (weights and optimizer state).
        width: the model's layer width.
        step_time_s: how long each step waits besides its compute.
        async_save: save behind Lightning's ``AsyncCheckpointIO`` (single-file plugins).
        slurm_requeue: ``SLURMEnvironment(auto_requeue=True)`` and Lightning's resume (``ckpt_path=None``);
            ``None``: when Lightning detects a Slurm job.
        gcs_url: the GCS emulator (``STORAGE_EMULATOR_HOST``) for gs:// roots; None: real GCS.
        redis_address: the database of a redis:// root (``host:port``); None: ``$SSDB``.
        io_buffer_mb: FastPersist's staging buffer (None: its default).
        transfer_chunk_kib: Dataflux's part size (None: its default).
        transfer_workers: Dataflux's parallel parts (None: its default).
        devices: ranks on this node (under torchrun: its ``--nproc-per-node``).
        threads: torch's intra-op threads per process, under every strategy (None: torch's default, or
            under the distributed strategies Lightning's: the CPUs per process).
        seed: the seed of the first weights and of the data.
        plain_saves: once training has ended (the ``train_end`` event), save its checkpoint this many times
            more with ``trainer.save_checkpoint`` to ``<checkpoint_dir>/last.ckpt``, outside the training
            loop (as ``benchmarks.lightning_ckpt`` times a plugin's save): what a save stall in training
            compares with.
        dcp_loads: (sharded plugins, with ``plain_saves``) after the plain saves, time Lightning's own
            strategy loading the last plain save's state from memory this many times
            (:func:`benchmarks.recovery.ceilings.sharded_load_seconds`, a ``dcp_load`` event each): what
            the restarts' ceiling adds to the raw read.
    """

    plugin: str
    root: str
    event_log: str
    strategy: str = "single"
    every_n_steps: int = 2
    save_top_k: int = 1
    max_steps: int = 40
    size_mb: float = 4.0
    width: int = 256
    step_time_s: float = 0.0
    async_save: bool = False
    slurm_requeue: bool | None = None
    gcs_url: str | None = None
    redis_address: str | None = None
    io_buffer_mb: int | None = None
    transfer_chunk_kib: int | None = None
    transfer_workers: int | None = None
    devices: int = 1
    threads: int | None = 1
    seed: int = 0
    plain_saves: int = 0
    dcp_loads: int = 0

    def __post_init__(self) -> None:
        if self.plugin not in PLUGINS:
            raise ValueError(f"unknown plugin {self.plugin!r}; choose from {', '.join(PLUGINS)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose from {', '.join(STRATEGIES)}")
        if (self.plugin in SHARDED_PLUGINS) != (self.strategy != "single"):
            raise ValueError(f"plugin {self.plugin} runs on strategy "
                             f"{'fsdp or model_parallel' if self.plugin in SHARDED_PLUGINS else 'single'}, "
                             f"not {self.strategy}")
        if self.async_save and self.plugin in SHARDED_PLUGINS:
            raise ValueError(f"async_save is for the single-file plugins, not {self.plugin}")
        scheme = SCHEMES.get(self.plugin, "")
        given = self.root.split("://", 1)[0] if "://" in self.root else ""
        if given != scheme:
            where = f"a {scheme}:// URL" if scheme else "a local directory"
            raise ValueError(f"plugin {self.plugin} keeps checkpoints in {where}, got root {self.root!r}")
        for name in ("every_n_steps", "max_steps", "width", "devices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.dcp_loads and self.plugin not in SHARDED_PLUGINS:
            raise ValueError(f"dcp_loads is for the sharded plugins, not {self.plugin}")
        if self.dcp_loads and not self.plain_saves:
            raise ValueError("dcp_loads times loads of the last plain save's state: give plain_saves too")
        if self.save_top_k < 0 or self.plain_saves < 0 or self.dcp_loads < 0 or self.size_mb <= 0 or self.step_time_s < 0:
            raise ValueError(f"save_top_k ({self.save_top_k}), plain_saves ({self.plain_saves}), dcp_loads "
                             f"({self.dcp_loads}) and step_time_s "
                             f"({self.step_time_s}) must not be "
                             f"negative, size_mb ({self.size_mb}) must be positive")

    @property
    def checkpoint_dir(self) -> str:
        """Where ``ModelCheckpoint`` and ``OnExceptionCheckpoint`` save."""
        return f"{self.root.rstrip('/')}/{CHECKPOINT_SUBDIR}"

    @property
    def layers(self) -> int:
        """Linear layers that make a checkpoint of about ``size_mb``."""
        return max(1, round(self.size_mb * _MIB / (_CHECKPOINT_BYTES_PER_WEIGHT * self.width * (self.width + 1))))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobConfig:
        return cls(**json.loads(text))


def attempt_of(environ: Mapping[str, str] = os.environ) -> int:
    """Which start of the job this process is: Slurm's ``SLURM_RESTART_COUNT`` or torchrun's
    ``TORCHELASTIC_RESTART_COUNT``, else 0."""
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


class EventLog:
    """Appends events to a JSON-lines file, each line with one ``write`` (``O_APPEND``): never two
    processes' lines mixed, nothing buffered that a SIGKILL would lose, and no lock, so a signal
    handler may write while the interrupted code was writing.

    Every line has ``event``, ``time`` (``time.time()``, comparable across processes), ``mono``
    (``time.monotonic()``, within one process), ``pid`` and ``rank`` (``$RANK``, 0 without it).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        """Write one event with ``fields`` (JSON-able values; others as their ``str``)."""
        record = {"event": event, "time": time.time(), "mono": time.monotonic(), "pid": os.getpid(),
                  "rank": int(os.environ.get("RANK", "0")), **fields}
        os.write(self._fd, (json.dumps(record, default=str) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _local_tensors(value: Any) -> Iterator[Any]:
    """The tensors this rank holds of ``value``: a tensor, a DTensor's local part, a ShardedTensor's shards."""
    if hasattr(value, "to_local"):  # DTensor
        yield value.to_local()
    elif hasattr(value, "local_shards"):  # ShardedTensor
        for shard in value.local_shards():
            yield shard.tensor
    elif hasattr(value, "detach"):
        yield value


def state_digest(state_dict: Mapping[str, Any]) -> str:
    """A digest of a model state as this rank holds it: each tensor's name, shape and the elements at
    both of its ends. Every optimizer step changes every weight, so states of two steps differ, and a
    checkpoint mixed of two saves differs from both; it costs nothing like reading every byte."""
    digest = hashlib.blake2b(digest_size=12)
    for name in sorted(state_dict):
        for tensor in _local_tensors(state_dict[name]):
            flat = tensor.detach().reshape(-1)
            ends = flat if flat.numel() <= 2 * _DIGEST_ELEMENTS else (
                flat[:_DIGEST_ELEMENTS], flat[-_DIGEST_ELEMENTS:])
            digest.update(f"{name}:{tuple(tensor.shape)}:".encode())
            for part in ends if isinstance(ends, tuple) else (ends,):
                digest.update(part.float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _checkpoint_step(checkpoint: Mapping[str, Any]) -> int | None:
    step = checkpoint.get("global_step")
    return int(step) if step is not None else None


def _logged_checkpoint_io_class() -> type:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from typing_extensions import override

    class LoggedCheckpointIO(CheckpointIO):
        """Logs the saves, loads and removals of the CheckpointIO it wraps.

        ``layer="storage"`` (next to the plugin) logs ``save_start`` / ``save_end`` (or ``save_error``)
        with the path, the step and the saved state's digest, ``load_start`` / ``load_end`` and
        ``remove``; ``blocking`` says whether the training thread waits for the save (not behind
        ``AsyncCheckpointIO``). ``layer="trainer"`` (in front of ``AsyncCheckpointIO``) logs only how
        long the training thread waits for each save to be handed over: ``stall_start`` / ``stall_end``.
        """

        def __init__(self, checkpoint_io: Any, log: EventLog, *, layer: str = "storage",
                     blocking: bool = True) -> None:
            self.checkpoint_io = checkpoint_io
            self._log = log
            self._layer = layer
            self._blocking = blocking

        @override
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
            path, step = str(path), _checkpoint_step(checkpoint)
            if self._layer == "trainer":
                self._log.emit("stall_start", path=path, step=step)
                self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
                self._log.emit("stall_end", path=path, step=step)
                return
            digest = state_digest(checkpoint.get("state_dict", {}))
            self._log.emit("save_start", path=path, step=step, digest=digest, blocking=self._blocking,
                           thread=threading.current_thread().name)
            started = time.monotonic()
            try:
                self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
            except BaseException as exc:
                self._log.emit("save_error", path=path, step=step, error=f"{type(exc).__name__}: {exc}")
                raise
            self._log.emit("save_end", path=path, step=step, digest=digest, seconds=time.monotonic() - started)

        @override
        def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            if self._layer == "trainer":
                return self.checkpoint_io.load_checkpoint(path, *args, **kwargs)
            self._log.emit("load_start", path=str(path))
            started = time.monotonic()
            loaded = self.checkpoint_io.load_checkpoint(path, *args, **kwargs)
            self._log.emit("load_end", path=str(path), step=_checkpoint_step(loaded),
                           digest=state_digest(loaded.get("state_dict", {})), seconds=time.monotonic() - started)
            return loaded

        @override
        def remove_checkpoint(self, path: Any) -> None:
            if self._layer == "storage":
                self._log.emit("remove", path=str(path))
            self.checkpoint_io.remove_checkpoint(path)

        @override
        def teardown(self) -> None:
            self.checkpoint_io.teardown()

    return LoggedCheckpointIO


class _LoggedStrategy:
    """Logs a sharded strategy's saves, loads and removals (every rank its own), as
    ``LoggedCheckpointIO`` does for a single-file plugin: DCP checkpoints go through the strategy."""

    recovery_log: EventLog
    # Keep the checkpoint dict each save is given (as it is given: the strategy takes the states out
    # of it), for the restarts' ceiling (JobConfig.dcp_loads).
    recovery_keep_last = False
    recovery_last_checkpoint: dict[str, Any] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.recovery_keep_last:
            self.recovery_last_checkpoint = dict(checkpoint)
        path, step = str(filepath), _checkpoint_step(checkpoint)
        digest = state_digest(checkpoint.get("state_dict", {}))
        self.recovery_log.emit("save_start", path=path, step=step, digest=digest, blocking=True,
                               thread=threading.current_thread().name)
        started = time.monotonic()
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        except BaseException as exc:
            self.recovery_log.emit("save_error", path=path, step=step, error=f"{type(exc).__name__}: {exc}")
            raise
        self.recovery_log.emit("save_end", path=path, step=step, digest=digest, seconds=time.monotonic() - started)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.recovery_log.emit("load_start", path=str(checkpoint_path))
        started = time.monotonic()
        loaded = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        self.recovery_log.emit("load_end", path=str(checkpoint_path), step=_checkpoint_step(loaded),
                               seconds=time.monotonic() - started)
        return loaded

    def remove_checkpoint(self, filepath: Any) -> None:
        self.recovery_log.emit("remove", path=str(filepath))
        super().remove_checkpoint(filepath)  # type: ignore[misc]


def _recovery_model(config: JobConfig) -> Any:
    import lightning.pytorch as pl
    import torch

    class RecoveryModel(pl.LightningModule):
        """``config.layers`` linear layers trained to shrink their output, with AdamW."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(config.seed)
            self.layers = torch.nn.Sequential(*(torch.nn.Linear(config.width, config.width)
                                                for _ in range(config.layers)))

        def configure_model(self) -> None:
            if config.strategy == "fsdp":
                from torch.distributed.fsdp import FullyShardedDataParallel

                if not isinstance(self.layers, FullyShardedDataParallel):  # on the CPU: Lightning wraps on GPUs only
                    self.layers = FullyShardedDataParallel(self.layers, device_id=torch.device("cpu"),
                                                           use_orig_params=True)
            elif config.strategy == "model_parallel":
                from torch.distributed.fsdp import fully_shard

                for layer in self.layers:
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if config.step_time_s:
                time.sleep(config.step_time_s)
            (inputs,) = batch
            return self.layers(inputs).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return RecoveryModel()


def _data(config: JobConfig) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(config.seed)
    return DataLoader(TensorDataset(torch.randn(_DATA_ROWS, config.width, generator=generator)),
                      batch_size=_BATCH_SIZE)


def _recovery_events_class() -> type:
    from lightning.pytorch import Callback
    from typing_extensions import override

    class RecoveryEvents(Callback):
        """Logs where training starts (``train_start``: the step and checkpoint it resumed from, and the
        digest of the state it starts with), each step's end (``step``), each exception, and each signal
        received while training (chained in front of the handlers Lightning installs)."""

        def __init__(self, log: EventLog) -> None:
            self._log = log
            self._first_step = True

        @override
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            import torch

            state = trainer.strategy.lightning_module_state_dict()
            self._log.emit("train_start", step=trainer.global_step, ckpt_path=trainer.ckpt_path,
                           digest=state_digest(state), threads=torch.get_num_threads())
            for signum in (signal.SIGTERM, signal.SIGUSR1):
                previous = signal.getsignal(signum)
                if callable(previous):  # Lightning restores its predecessors at teardown
                    signal.signal(signum, self._logging_handler(previous))

        def _logging_handler(self, previous: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
            def handler(signum: int, frame: Any) -> None:
                self._log.emit("signal", signum=signum, name=signal.Signals(signum).name)
                previous(signum, frame)

            return handler

        @override
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._log.emit("step", step=trainer.global_step, first=self._first_step)
            self._first_step = False

        @override
        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._log.emit("exception", step=trainer.global_step, error=type(exception).__name__)

    return RecoveryEvents


def _transfer_options(config: JobConfig) -> dict[str, Any]:
    """Dataflux's transfer options the config sets (the plugin's defaults for the others)."""
    options: dict[str, Any] = {}
    if config.transfer_chunk_kib:
        options["chunk_size"] = config.transfer_chunk_kib * 1024
    if config.transfer_workers:
        options["max_workers"] = config.transfer_workers
    return options


def _checkpoint_io(config: JobConfig) -> Any:
    if config.plugin == "dataflux":
        from dataflux_ckpt import DatafluxCheckpointIO

        return DatafluxCheckpointIO(**_transfer_options(config))
    if config.plugin in ("fastpersist", "fastpersist-aio", "fastpersist-python"):
        from fastpersist import FastPersistCheckpointIO

        engine = config.plugin.partition("-")[2] or None
        if config.io_buffer_mb:
            return FastPersistCheckpointIO(io_buffer_mb=config.io_buffer_mb, engine=engine)
        return FastPersistCheckpointIO(engine=engine)
    if config.plugin == "smartredis":
        from smartredis_io import SmartRedisCheckpointIO

        return SmartRedisCheckpointIO(address=config.redis_address)
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    return TorchCheckpointIO()


def _checkpoint_callback_class(config: JobConfig) -> type:
    if config.plugin in ("dataflux", "dataflux-dcp"):
        from dataflux_ckpt import DatafluxModelCheckpoint

        return DatafluxModelCheckpoint
    if config.plugin == "smartredis":
        from smartredis_io import SmartRedisModelCheckpoint

        return SmartRedisModelCheckpoint
    if config.plugin in ("torch-gcsfs", "torch-redis", "torch-dcp-gcsfs"):
        # stock ModelCheckpoint drops the scheme from the last checkpoints it finds, and would train from scratch
        from lightning_storage_plugins.checkpoint_callback import RemoteModelCheckpoint

        return RemoteModelCheckpoint
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint


def _sharded_strategy(config: JobConfig, log: EventLog) -> Any:
    if config.plugin == "dataflux-dcp":
        from dataflux_ckpt import DatafluxFSDPStrategy as FSDP
        from dataflux_ckpt import DatafluxModelParallelStrategy as ModelParallel

        options: dict[str, Any] = {"writer_options": _transfer_options(config)}
    elif config.plugin == "fastpersist-dcp":
        from fastpersist import FastPersistFSDPStrategy as FSDP
        from fastpersist import FastPersistModelParallelStrategy as ModelParallel

        options = {"writer_options": {"io_buffer_mb": config.io_buffer_mb} if config.io_buffer_mb else {}}
    elif config.plugin == "torch-dcp-gcsfs":
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        from benchmarks.recovery.fsspec_dcp import FsspecShardedStorage
        from lightning_storage_plugins.sharded import ShardedFSDPMixin, ShardedModelParallelMixin

        FSDP = type("FsspecFSDPStrategy", (FsspecShardedStorage, ShardedFSDPMixin, FSDPStrategy), {})
        ModelParallel = type("FsspecModelParallelStrategy",
                             (FsspecShardedStorage, ShardedModelParallelMixin, ModelParallelStrategy), {})
        options = {}
    else:
        from lightning.pytorch.strategies import FSDPStrategy as FSDP
        from lightning.pytorch.strategies import ModelParallelStrategy as ModelParallel

        options = {}
    base = FSDP if config.strategy == "fsdp" else ModelParallel
    # A subclass of Lightning's class: on the CPU Lightning refuses FSDPStrategy itself by its type.
    cls = type(f"Logged{base.__name__}", (_LoggedStrategy, base), {"recovery_log": log})
    if config.strategy == "fsdp":
        return cls(state_dict_type="sharded", **options)
    return cls(data_parallel_size=config.devices, tensor_parallel_size=1, **options)


def quiet_lightning() -> None:
    """Keep Lightning's informational lines and its DataLoader and Slurm hints off the job's output."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*srun.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def build_trainer(config: JobConfig, log: EventLog) -> tuple[Any, Any]:
    """The Trainer of ``config`` and the ``ckpt_path`` its ``fit`` resumes with."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from lightning.pytorch.plugins.environments import SLURMEnvironment
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    plugins: list[Any] = []
    strategy: Any = "auto"
    if config.plugin in SHARDED_PLUGINS:
        strategy = _sharded_strategy(config, log)
    else:
        logged = _logged_checkpoint_io_class()
        storage = logged(_checkpoint_io(config), log, blocking=not config.async_save)
        plugins.append(logged(AsyncCheckpointIO(storage), log, layer="trainer") if config.async_save else storage)
    slurm = SLURMEnvironment.detect() if config.slurm_requeue is None else config.slurm_requeue
    if slurm:
        plugins.append(SLURMEnvironment(auto_requeue=True))
    callbacks = [
        _recovery_events_class()(log),
        _checkpoint_callback_class(config)(dirpath=config.checkpoint_dir, every_n_train_steps=config.every_n_steps,
                                           save_top_k=config.save_top_k, save_last=True),
        OnExceptionCheckpoint(config.checkpoint_dir, filename=ON_EXCEPTION_NAME),
    ]
    trainer = Trainer(accelerator="cpu", devices=config.devices, num_nodes=1, strategy=strategy, plugins=plugins,
                      callbacks=callbacks, max_steps=config.max_steps, limit_val_batches=0, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=config.root)
    # Under Slurm, Lightning's own choice: the newest hpc_ckpt_N, else "last" (OnExceptionCheckpoint is there).
    if slurm:
        return trainer, None
    if config.plugin == "torch-dcp-gcsfs":
        from benchmarks.recovery.fsspec_dcp import newest_checkpoint

        # Lightning cannot date a checkpoint that is an object prefix ("last" fails): the user's own choice.
        return trainer, newest_checkpoint(config.checkpoint_dir, ["last.ckpt", f"{ON_EXCEPTION_NAME}.ckpt"])
    return trainer, "last"


def init_elastic_process_group(backend: str = "gloo") -> bool:
    """Under torchrun, join this restart's process group through a store of its own; True if it did.

    torchrun's ranks share the elastic agent's store (``TORCHELASTIC_USE_AGENT_STORE``), and torch 2.11 to
    2.15 keep it across restarts without a prefix per restart: the restarted ranks read the addresses the
    ranks before them published, and gloo connects to a dead rank's port (``Connection refused``, or a
    hang in ``new_group``). Joining with ``TORCHELASTIC_RESTART_COUNT`` as the store's prefix, before
    Lightning would join without one (it keeps a process group that exists), gives each restart its own
    keys. Elsewhere (no torchrun, or a store of the ranks' own) it does nothing.
    """
    import torch.distributed as dist

    environ = os.environ
    if (environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in environ
            or dist.is_initialized()):
        return False
    world_size, rank = int(environ["WORLD_SIZE"]), int(environ["RANK"])
    store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=False)
    prefixed = dist.PrefixStore(f"restart-{environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size)
    return True


def run(config: JobConfig) -> None:
    """Train as ``config`` says, resuming from the run's newest checkpoint, logging every event.

    Raises:
        Whatever training raises, after the ``exit`` event: Lightning's ``SIGTERMException`` (a
        ``SystemExit``) after a SIGTERM, among others.
    """
    log = EventLog(config.event_log)
    log.emit("start", plugin=config.plugin, strategy=config.strategy, attempt=attempt_of(), ppid=os.getppid(),
             slurm_job=os.environ.get("SLURM_JOB_ID"), config=dataclasses.asdict(config))
    step = None
    try:
        with ExitStack() as stack:
            import torch

            if config.threads:
                torch.set_num_threads(config.threads)
                # Lightning's launcher of the distributed strategies sets torch's threads to the CPUs per
                # process unless OMP_NUM_THREADS is set: every row keeps the same threads.
                stack.enter_context(_environ("OMP_NUM_THREADS", str(config.threads)))
            if config.gcs_url:
                from dataflux_ckpt.emulator import activated

                stack.enter_context(activated(config.gcs_url))
            if config.redis_address:
                # Lightning checks redis:// checkpoints through fsspec's redis filesystem, which reads $SSDB
                # (set for this run only: a caller's process keeps its own).
                stack.enter_context(_environ("SSDB", config.redis_address))
            quiet_lightning()
            if config.strategy != "single":
                init_elastic_process_group()
            trainer, ckpt_path = build_trainer(config, log)
            trainer.fit(_recovery_model(config), train_dataloaders=_data(config), ckpt_path=ckpt_path)
            log.emit("train_end", step=trainer.global_step)
            trainer.strategy.recovery_keep_last = bool(config.dcp_loads)
            for _ in range(config.plain_saves):
                trainer.save_checkpoint(f"{config.checkpoint_dir}/last.ckpt")
            if config.dcp_loads:
                from benchmarks.recovery.ceilings import sharded_load_seconds

                for _ in range(config.dcp_loads):
                    log.emit(DCP_LOAD_EVENT, seconds=sharded_load_seconds(trainer.strategy,
                                                                          trainer.strategy.recovery_last_checkpoint))
            step = trainer.global_step
    except BaseException as exc:
        log.emit("exit", reason=type(exc).__name__, error=str(exc)[:500])
        raise
    finally:
        if step is not None:
            log.emit("exit", reason="completed", step=step)
        log.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recovery.job",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field in dataclasses.fields(JobConfig):
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if default is dataclasses.MISSING:
            parser.add_argument(flag, required=True, dest=field.name,
                                choices=PLUGINS if field.name == "plugin" else None)
        elif isinstance(default, bool) or field.name == "slurm_requeue":
            parser.add_argument(flag, dest=field.name, default=default, action=argparse.BooleanOptionalAction)
        else:
            kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
            parser.add_argument(flag, dest=field.name, default=default, type=kind,
                                choices=STRATEGIES if field.name == "strategy" else None)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.recovery.job``: one start of the job (exit status 0 after a SIGTERM too,
    as Lightning's ``SIGTERMException`` gives)."""
    args = _parser().parse_args(argv)
    config = JobConfig(**vars(args))
    if config.gcs_url:
        from dataflux_ckpt.emulator import configure_gcsfs_for_emulator

        configure_gcsfs_for_emulator()  # before anything imports gcsfs
    run(config)
    return 0


@contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` set to ``value`` inside the block, and as it was after it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


if __name__ == "__main__":
    sys.exit(main())
