"""Lightning integration: checkpoints in the database, and models published for inference as they train."""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import redis
import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from typing_extensions import override

from lightning_storage_plugins import _torch_compat
from lightning_storage_plugins.checkpoint_callback import RemoteModelCheckpoint
from lightning_storage_plugins.errors import InvalidCheckpointError
from lightning_storage_plugins.ordering import CheckpointDir, OrderedCheckpointIO, remove_local
from lightning_storage_plugins.owners import Owner
from lightning_storage_plugins.preflight import storage_plugin
from lightning_storage_plugins.ziparchive import torch_format_problem
from smartredis_io._client import wire
from smartredis_io._client.connection import ConnectionSettings, Database, detect_cluster
from smartredis_io.client import Client
from smartredis_io.configoptions import ConfigOptions
from smartredis_io.error import RedisConnectionError, RedisKeyError, RedisReplyError, RedisTimeoutError
from smartredis_io.lightning import filesystem

__all__ = ["SmartRedisCheckpointIO", "SmartRedisModelCheckpoint", "SmartRedisModelPublisher", "checkpoint_key"]

log = logging.getLogger(__name__)

CHECKPOINT_CHUNK_BYTES = 64 * wire.MiB  # one Redis value per chunk; also the save buffer's size
DEFAULT_TIMEOUT_S = 1800.0  # deadline of one save, load or removal as a whole


def checkpoint_key(path: str | os.PathLike[str], root_dir: str | os.PathLike[str] | None = None) -> str:
    """The database key of a checkpoint path.

    A ``redis://name/...`` URL is keyed ``name/...``. A local path is keyed relative to ``root_dir``
    (default: the working directory), so the same relative layout finds the same checkpoint from
    any directory or host; a path outside ``root_dir`` is keyed by its absolute path.

    Raises:
        ValueError: an empty path, or a URL without a key.
    """
    text = os.fspath(path)
    if not text:
        raise ValueError("Empty checkpoint path")
    if text.startswith(f"{filesystem.PROTOCOL}:"):
        return filesystem.url_key(text)
    if "://" in text:
        raise ValueError(f"SmartRedisCheckpointIO keeps checkpoints in Redis: {text!r} is neither a local path nor "
                         f"a {filesystem.PROTOCOL}:// URL")
    absolute = os.path.abspath(text)
    relative = os.path.relpath(absolute, os.path.abspath(root_dir or os.getcwd()))
    key = absolute if relative == ".." or relative.startswith(".." + os.sep) else relative
    return key.replace(os.sep, "/")


# How many links in a row a load follows (as the kernel's limit for path resolution).
_MAX_LINKS = 40


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint's database key, and the local path it was named by (``None`` for a ``redis://``
    URL): Lightning's ``ModelCheckpoint(save_last="link")`` makes its ``last`` links there."""

    key: str
    local: str | None = field(default=None, compare=False)

    def link(self) -> str | None:
        """The local path when it is a link, else ``None``."""
        return self.local if self.local is not None and os.path.islink(self.local) else None

    def __str__(self) -> str:
        return self.key


def _link_target(path: str) -> str:
    """Where the link at ``path`` leads, following links in a row (a relative link from its directory).

    Raises:
        OSError: more than ``_MAX_LINKS`` links in a row (a loop).
    """
    for _ in range(_MAX_LINKS):
        if not os.path.islink(path):
            return path
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    raise OSError(f"Too many levels of links from checkpoint path {path}")


def _settings(address: str, cluster: bool | None, options: ConfigOptions | None,
              address_source: str = "") -> ConnectionSettings:
    """Connection settings as a SmartRedis client reads them, the address (and cluster flag) given winning."""
    settings = ConnectionSettings.from_options(options, address=address or None, cluster=bool(cluster))
    settings = settings.with_(address_source=address_source)
    return settings if cluster is not None else settings.with_(cluster=detect_cluster(settings))


class SmartRedisCheckpointIO(OrderedCheckpointIO[_Checkpoint]):
    """A Lightning ``CheckpointIO`` that keeps checkpoints in Redis (standalone or cluster).

    A checkpoint is keyed by its path (see :func:`checkpoint_key`): ``redis://run1/last.ckpt`` at
    ``run1/last.ckpt``, a local path relative to ``root_dir``. ``torch.save`` streams into chunks of
    ``chunk_bytes`` under a fresh version, and a small header (the manifest: size, chunk count,
    CRC-32) written last publishes them; a failed save removes its chunks and leaves the previous
    checkpoint. Loading checks the stored size before allocating, reads every chunk straight into
    one buffer and checks the CRC.

    With local paths, ``ModelCheckpoint(save_last="link")`` works as with local files: Lightning
    makes its ``last`` links in the local directory (created when training starts), a load through a
    link loads the checkpoint it points to, and removing a link removes the link only.

    Args:
        address: ``host:port`` (or a comma list for a cluster, or a ``redis://user:password@...``
            URL); default ``SSDB``.
        cluster: whether the database is a Redis Cluster; default: asked from the server.
        chunk_bytes: size of one stored chunk (and of the one save buffer).
        root_dir: local paths are keyed relative to it; default: the working directory when the
            plugin is made (which is also the Trainer's default ``default_root_dir``).
        weights_only: what ``load_checkpoint`` passes to ``torch.load`` when its caller passes
            ``None`` (Lightning 2.5 always does): ``None`` is torch's default, ``True``.
        config_options: where credentials, TLS and deadlines come from, as for a SmartRedis
            ``Client`` (``SR_USERNAME``, ``SR_PASSWORD``, ``SR_TLS``..., ``SR_CONN_TIMEOUT``,
            ``SR_CMD_TIMEOUT``); default: the environment.
        timeout_s: deadline of one save, load or removal as a whole (each wait for the server is
            bounded by ``SR_CMD_TIMEOUT`` as well).

    Raises:
        ValueError: no address given and none configured, or a bad ``chunk_bytes`` / ``timeout_s``;
            at save or load, a URL of another storage (``gs://...``).
        TypeError: ``weights_only`` is not a bool or ``None``; at save, ``storage_options`` given.
        FileNotFoundError: at load, no checkpoint at that key (the message names key and address).
        RedisInternalError: at load, the stored value is corrupt (its header claims more than is
            stored, or a checksum fails).
        WeightsOnlyError: at load, the checkpoint holds objects that only ``weights_only=False``
            loads (the message names key, address and the object).
        InvalidCheckpointError: at load, the stored bytes are not a torch checkpoint, or one torch
            refuses as damaged (the message names key and address).
        RedisConnectionError: the database cannot be reached within ``SR_CONN_TIMEOUT`` or went away.
        RedisTimeoutError: an operation did not finish within ``timeout_s``, or the server stopped
            answering for ``SR_CMD_TIMEOUT``.
    """

    _process_local = ("_db",)

    def __init__(self, address: str | None = None, cluster: bool | None = None,
                 chunk_bytes: int = CHECKPOINT_CHUNK_BYTES, *, root_dir: str | os.PathLike[str] | None = None,
                 weights_only: bool | None = None, config_options: ConfigOptions | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(weights_only=weights_only)
        self.config_options = config_options
        options = config_options or ConfigOptions.create_from_environment("")
        self.address = address or options.string_or("SSDB", "")
        self.address_source = "" if address else "SSDB"
        if not self.address:
            raise ValueError("SmartRedisCheckpointIO needs an address (or $SSDB)")
        if chunk_bytes <= 0 or chunk_bytes + wire.HEADER_MAX_BYTES > wire.BULK_LIMIT_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {wire.BULK_LIMIT_BYTES - wire.HEADER_MAX_BYTES}]")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.cluster = cluster
        self.chunk_bytes = chunk_bytes
        self.root_dir = os.path.abspath(root_dir or os.getcwd())
        self.timeout_s = timeout_s
        self._db: Database | None = None
        self._pid = 0

    @property
    def db(self) -> Database:
        """One connection per process (re-made after a fork)."""
        if self._db is None or self._pid != os.getpid():
            settings = _settings(self.address, self.cluster, self.config_options, self.address_source)
            self.cluster = settings.cluster
            self._db = Database(settings)
            self._pid = os.getpid()
        return self._db

    def key(self, path: str | os.PathLike[str]) -> str:
        """The database key of the checkpoint at ``path`` (see :func:`checkpoint_key`)."""
        return checkpoint_key(path, self.root_dir)

    @contextmanager
    def _operation(self, name: str, key: str) -> Iterator[None]:
        """One public operation: one deadline (``timeout_s``), errors typed and naming it and the key."""
        try:
            with self.db.operation(self.timeout_s):
                yield
        except redis.exceptions.TimeoutError as exc:
            raise RedisTimeoutError(f"checkpoint {key!r} at {self.address}: {exc}", name) from None
        except redis.exceptions.ConnectionError as exc:
            where = f"{self.address} ({self.address_source})" if self.address_source else self.address
            raise RedisConnectionError(f"{name} of checkpoint {key!r} at {where}: {exc}") from None
        except redis.exceptions.RedisError as exc:
            raise RedisReplyError(f"checkpoint {key!r} at {self.address}: {exc}", name) from None

    @override
    def _target(self, path: str | os.PathLike[str]) -> _Checkpoint:
        key = self.key(path)
        text = os.fspath(path)
        return _Checkpoint(key, None if text.startswith(f"{filesystem.PROTOCOL}:") else os.path.abspath(text))

    @override
    def _describe(self, target: _Checkpoint) -> str:
        return f"{target.key!r} in the database at {self.address}"

    @override
    def _write(self, checkpoint: dict[str, Any], target: _Checkpoint) -> None:
        link = target.link()
        if link is not None:
            remove_local(link)  # a link left by save_last="link" would lead loads of this path elsewhere
        key = target.key
        with (self._operation("save_checkpoint", key),
              wire.ChunkedWriter(self.db, key, self.chunk_bytes, owner=Owner.current().token()) as writer):
            try:
                torch.save(checkpoint, writer)
            except Exception:
                if writer.error is not None:  # the database error, not torch's follow-up complaint
                    raise writer.error from None
                raise
        log.info("saved checkpoint %s to %s", key, self.address)

    @override
    def _read(self, target: _Checkpoint, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        link = target.link()
        key = target.key if link is None else self.key(_link_target(link))
        with self._operation("load_checkpoint", key):
            try:
                buffer = wire.get_array(self.db, key)  # sizes are checked before the buffer exists
            except RedisKeyError:
                raise FileNotFoundError(f"Checkpoint {key!r} not found in the database at {self.address}") from None
        data = buffer.reshape(-1).view(np.uint8)
        where = f"checkpoint {key!r} in the database at {self.address}"
        stored = memoryview(data)
        problem = torch_format_problem(lambda count, offset: stored[offset:offset + count].tobytes(), len(stored),
                                       where, "value")
        if problem is not None:
            raise InvalidCheckpointError(problem)
        try:
            # The tensors are views of the fetched buffer: a copy of every byte saved, as Dataflux loads do.
            return _torch_compat.load_archive(stored, torch.frombuffer(data, dtype=torch.uint8).untyped_storage(),
                                              map_location, weights_only, f"redis key {key!r}")
        except pickle.UnpicklingError as exc:
            if repr(key) in str(exc):
                raise
            # torch's own refusal (a legacy or TorchScript archive): it does not say which checkpoint
            raise pickle.UnpicklingError(f"{where}: {exc}") from exc
        except _torch_compat.LOAD_FAILURES as exc:
            raise InvalidCheckpointError(f"{where} could not be loaded as a torch checkpoint: {exc}") from exc

    @override
    def _delete(self, target: _Checkpoint) -> None:
        link = target.link()
        if link is not None:
            if remove_local(link):  # the link only; the checkpoint it points to stays
                log.debug("removed link %s", link)
            return
        with self._operation("remove_checkpoint", target.key):
            if wire.delete_value(self.db, target.key):
                log.debug("removed checkpoint %s", target.key)

    @override
    def _stored(self, target: _Checkpoint) -> bool:
        if target.link() is not None:
            return True
        with self._operation("checkpoint_exists", target.key):
            return wire.read_header(self.db, target.key) is not None

    @override
    def preflight(self, checkpoint_dirs: Sequence[CheckpointDir]) -> None:
        """Before the first step: connect (a missing database is reported now, not at the first save),
        refuse directories of another storage, create the local directories in which
        ``save_last="link"`` makes its links, and remove the chunks that saves killed in the middle
        left under those directories' keys: those of saves whose owner is certainly gone (its
        process on this machine has exited, or it ran in an earlier attempt of this Slurm job; see
        :class:`~lightning_storage_plugins.owners.Owner`), never a live save's. Chunks expire by
        themselves one minute after their save's deadline, too. A clean-up that fails is logged,
        and training goes on.

        Raises:
            ValueError: a directory of another storage, or ``save_last="link"`` with a ``redis://``
                directory (Lightning makes links only in local filesystems).
            RedisConnectionError: the database cannot be reached within ``SR_CONN_TIMEOUT``.
        """
        for checkpoint_dir in checkpoint_dirs:
            target = self._target(os.path.join(checkpoint_dir.dirpath, "x"))
            if checkpoint_dir.links:
                if target.local is None:
                    raise ValueError(
                        f"ModelCheckpoint(save_last='link') makes its links in the local filesystem, which "
                        f"cannot hold links to {checkpoint_dir.dirpath}; use save_last=True, or a local "
                        f"directory, with {type(self).__name__}")
                os.makedirs(checkpoint_dir.dirpath, exist_ok=True)
        with self._operation("connect", self.address):
            pass
        self._remove_dead_saves(sorted({self.key(os.path.join(d.dirpath, "x"))[:-1] for d in checkpoint_dirs}))

    def _remove_dead_saves(self, prefixes: Sequence[str]) -> None:
        """Delete the unpublished chunks of saves under ``prefixes`` (key prefixes) whose owner is gone."""
        if not prefixes:
            return
        observer = Owner.current()
        try:
            with self._operation("removal of chunks left by killed saves", ", ".join(prefixes)):
                for name in filesystem.keys_matching(self.db, wire.OWNER_KEY_PATTERN):
                    record = wire.read_owner_key(self.db, name)
                    if record is None or not record[0].startswith(tuple(prefixes)):
                        continue
                    key, version, token = record
                    owner = Owner.from_token(token)
                    reason = owner.gone(observer) if owner is not None else None
                    if reason is not None:
                        chunks = wire.delete_unpublished(self.db, key, version)
                        log.warning("removed %d chunks of a save of %r that is over: %s", chunks, key, reason)
        except Exception as exc:
            log.warning("could not remove the chunks killed saves left under %s: %s", ", ".join(prefixes), exc)

    def stored_checkpoint_urls(self, dirpath: str | os.PathLike[str], wanted: Callable[[str], bool]) -> set[str]:
        """``redis://`` URLs of the checkpoints stored under the local directory ``dirpath`` whose file
        names ``wanted`` accepts, and of those its links by such names lead to (``save_last="link"``).

        Lightning finds and checks checkpoints through fsspec, and keys of local paths are no local
        files: their URLs are what it can find. A key outside ``root_dir`` (an absolute path) has no
        URL and is left out, with a warning.
        """
        directory = self._target(os.path.join(dirpath, "x"))
        if directory.local is None:
            raise ValueError(f"{dirpath} is not a local directory")
        prefix = self.key(dirpath).rstrip("/") + "/"
        keys: set[str] = set()
        with self._operation("list_checkpoints", prefix):
            for key in filesystem.keys_under(self.db, prefix):
                name = key[len(prefix):]
                if "/" not in name and wanted(name) and wire.read_header(self.db, key) is not None:
                    keys.add(key)
        local = os.path.dirname(directory.local)
        names = os.listdir(local) if os.path.isdir(local) else []
        for name in names:
            path = os.path.join(local, name)
            if wanted(name) and os.path.islink(path):
                target = self._target(_link_target(path))
                if target.link() is None and self._stored(target):
                    keys.add(target.key)
        outside = sorted(key for key in keys if key.startswith("/"))
        if outside:
            log.warning("ckpt_path='last' cannot name %s: keys outside root_dir %s have no redis:// URL; "
                        "pass the checkpoint's path as ckpt_path", ", ".join(outside), self.root_dir)
        return {f"{filesystem.PROTOCOL}://{key}" for key in keys if not key.startswith("/")}

    def checkpoint_size(self, path: str | os.PathLike[str]) -> int:
        """Bytes of the stored checkpoint at ``path``.

        Raises:
            FileNotFoundError: no checkpoint there.
        """
        key = self.key(path)
        with self._operation("checkpoint_size", key):
            header = wire.read_header(self.db, key)
        if header is None:
            raise FileNotFoundError(f"Checkpoint {key!r} not found in the database at {self.address}")
        return header.payload_bytes if header.chunks else header.nbytes

    @override
    def _close(self) -> None:
        """Close this process' connection."""
        if self._db is not None:
            self._db.close()
            self._db = None


class SmartRedisModelCheckpoint(RemoteModelCheckpoint):
    """``ModelCheckpoint`` that also finds the last checkpoint that ``SmartRedisCheckpointIO`` keeps,
    in a ``redis://`` directory or keyed by a local one.

    For ``ckpt_path="last"``, stock ``ModelCheckpoint`` lists its directory through fsspec. A
    ``redis://`` listing goes through :mod:`smartredis_io.lightning.filesystem`, but Lightning passes the URLs
    through ``os.path.normpath``, which turns ``redis://run1/last.ckpt`` into a local path
    (``redis:/run1/last.ckpt``). A local directory whose checkpoints are keyed in the database holds
    no files (with ``save_last="link"``, only links to checkpoints that are not local files). Either
    way Lightning finds nothing and trains from scratch. This keeps the URLs whole, and for a local
    directory lists the keys the trainer's ``SmartRedisCheckpointIO`` stored there, as ``redis://``
    URLs (Lightning checks them through the ``redis`` filesystem, which connects with ``SSDB``, as
    for ``redis://`` directories). It takes ``ModelCheckpoint``'s arguments.
    """

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        found = super()._find_last_checkpoints(trainer)
        # Lightning asks before this callback's setup: the directory may come from default_root_dir.
        directory = self.checkpoint_directory(trainer)
        plugin = storage_plugin(trainer.strategy.checkpoint_io)
        if not isinstance(url_to_fs(directory)[0], LocalFileSystem) or not isinstance(plugin, SmartRedisCheckpointIO):
            return found
        last = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?{re.escape(self.FILE_EXTENSION)}$")
        return found | plugin.stored_checkpoint_urls(directory, lambda name: bool(last.match(name)))


EXPORT_MAX_BATCH = 1 << 16  # the largest batch a published torch.export program takes


def _export_program(module: torch.nn.Module, example: Any) -> torch.export.ExportedProgram:
    """``module`` exported on ``example`` (a tensor or a tuple of them), first dimensions as one dynamic batch."""
    args = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    batch = torch.export.Dim("batch", min=1, max=EXPORT_MAX_BATCH)
    shapes = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() else None for a in args)
    if all(isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 1 for a in args):
        # a batch of one would be specialized to 1: export on two rows
        args = tuple(torch.cat([a, a]) for a in args)
    return torch.export.export(module, args, dynamic_shapes=shapes)


class SmartRedisModelPublisher(pl.Callback):
    """Publish the LightningModule for ``run_model`` while it trains.

    Every ``every_n_steps`` training steps and/or at each validation end, the module is exported
    with ``torch.export`` (or traced / scripted to TorchScript) with ``example_input`` (default: its
    ``example_input_array``; its first dimension exported as a dynamic batch), stored with
    ``set_model`` under ``<name>.v<step>``, and the alias ``name`` is moved to it with one write:
    clients calling ``run_model(name, ...)`` get the new weights without a restart, and a request
    in flight uses either the old model or the new one. The newest ``keep`` versions are kept.

    Args:
        address: database address (default ``$SSDB``); cluster auto-detected unless ``cluster`` given.
        config_options: credentials, TLS and deadlines as for ``SmartRedisCheckpointIO``.
        name: the alias clients run.
        every_n_steps: publish every N optimizer steps (None: not by steps).
        on_validation_end: publish at each validation end.
        example_input: input for exporting or tracing; default ``pl_module.example_input_array``.
        method: ``"export"`` (``torch.export``), ``"trace"`` or ``"script"`` (TorchScript).
        keep: versions kept besides the alias (>= 2, so a request in flight keeps its model).
    """

    def __init__(self, name: str, address: str | None = None, *, cluster: bool | None = None,
                 every_n_steps: int | None = None, on_validation_end: bool = True,
                 example_input: torch.Tensor | None = None, method: str = "export", keep: int = 2,
                 device: str = "CPU", batch_size: int = 0, min_batch_size: int = 0,
                 min_batch_timeout: int = 0, config_options: ConfigOptions | None = None) -> None:
        if method not in ("export", "trace", "script"):
            raise ValueError(f"method must be 'export', 'trace' or 'script', got {method!r}")
        if keep < 2:
            raise ValueError("keep must be >= 2 so that a request in flight keeps its model")
        self.name = name
        self.config_options = config_options
        options = config_options or ConfigOptions.create_from_environment("")
        self.address = address or options.string_or("SSDB", "")
        self.address_source = "" if address else "SSDB"
        if not self.address:
            raise ValueError("SmartRedisModelPublisher needs an address (or $SSDB)")
        self.cluster = cluster
        self.every_n_steps = every_n_steps
        self.publish_on_validation_end = on_validation_end
        self.example_input = example_input
        self.method = method
        self.keep = keep
        self._model_args = {"device": device, "batch_size": batch_size, "min_batch_size": min_batch_size,
                            "min_batch_timeout": min_batch_timeout}
        self._client: Client | None = None
        self.published: list[str] = []

    @property
    def client(self) -> Client:
        """The client the models are published with (connected on first use)."""
        if self._client is None:
            settings = _settings(self.address, self.cluster, self.config_options, self.address_source)
            options = (self.config_options or ConfigOptions.create_from_environment("")).derived(
                SSDB=self.address, SR_DB_TYPE="Clustered" if settings.cluster else "Standalone")
            self._client = Client(options)
        return self._client

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Publish every ``every_n_steps`` optimizer steps (on global rank 0)."""
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0 and trainer.is_global_zero:
            self.publish(pl_module, trainer.global_step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Publish at each validation end, sanity checking aside (on global rank 0)."""
        if self.publish_on_validation_end and not trainer.sanity_checking and trainer.is_global_zero:
            self.publish(pl_module, trainer.global_step)

    def publish(self, pl_module: pl.LightningModule, step: int) -> str:
        """Export ``pl_module`` now, store it as ``<name>.v<step>`` and point the alias at it."""
        example = self.example_input if self.example_input is not None else pl_module.example_input_array
        if self.method in ("export", "trace") and example is None:
            raise ValueError(f"method {self.method!r} needs example_input or the module's example_input_array")
        buffer = io.BytesIO()
        exported = self._export(pl_module, example)
        if self.method == "export":
            torch.export.save(exported, buffer)
        else:
            torch.jit.save(exported, buffer)
        version_name = f"{self.name}.v{step}"
        self.client.set_model(version_name, buffer.getvalue(), "TORCH", **self._model_args)
        self.client._alias_model(self.name, version_name)
        if version_name not in self.published:
            self.published.append(version_name)
        for old in self.published[:-self.keep]:
            self.client.delete_model(old)
        self.published = self.published[-self.keep:]
        log.info("published %s as %s (alias %s)", type(pl_module).__name__, version_name, self.name)
        return version_name

    def _export(self, pl_module: pl.LightningModule, example: Any) -> Any:
        """The module in eval mode as a torch.export program or TorchScript (its training mode restored after)."""
        was_training = pl_module.training
        pl_module.eval()
        try:
            if self.method == "export":
                return _export_program(pl_module, example)
            with torch.no_grad():
                if self.method == "script":
                    return torch.jit.script(pl_module)
                example = example.to(pl_module.device) if isinstance(example, torch.Tensor) else example
                return torch.jit.trace(pl_module, example)
        finally:
            pl_module.train(was_training)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the publishing client."""
        if self._client is not None:
            self._client.close()
            self._client = None
