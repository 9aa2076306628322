"""SmartRedis-compatible tensor, dataset and model client on a stock Redis server.

``import smartredis_io as smartredis`` gives SmartRedis 0.6.1's Python API: the names below, and the
modules ``error``, ``util``, ``dataset_utils``, ``srobject``, ``logger``, ``logcontext`` and
``configoptions``.

Behind them each role has its subpackage: ``_client``, the client's internals (connection, wire
format, stored-model protocol, command mixins); ``worker``, the execution workers (``python -m
smartredis_io.worker``); ``launchers``, the servers, the Redis module's locator and SmartSim's set-up;
``lightning``, the CheckpointIO, its callbacks and the ``redis://`` file system. ``redisai`` holds the
Redis module's C sources. The client imports none of the others.
"""


from lightning_storage_plugins.errors import InvalidCheckpointError
from lightning_storage_plugins.lazy import lazy_exports
from lightning_storage_plugins.reentry import DeferredOperationError, ReentrantOperationError
from smartredis_io import error
from smartredis_io._client.wire import bfloat16
from smartredis_io.client import Client
from smartredis_io.configoptions import ConfigOptions
from smartredis_io.dataset import Dataset
from smartredis_io.dataset_utils import DatasetConverter
from smartredis_io.launchers.server import AclUser, Orchestrator, RedisCluster, RedisServer, TlsFiles
from smartredis_io.logcontext import LogContext
from smartredis_io.logger import LLDebug, LLDeveloper, LLInfo, LLQuiet, log_data, log_error, log_warning
from smartredis_io.srobject import SRObject

__all__ = [
    "AclUser",
    "Client",
    "ConfigOptions",
    "Dataset",
    "DatasetConverter",
    "DeferredOperationError",
    "InvalidCheckpointError",
    "LLDebug",
    "LLDeveloper",
    "LLInfo",
    "LLQuiet",
    "LogContext",
    "Orchestrator",
    "RedisCluster",
    "RedisServer",
    "ReentrantOperationError",
    "SRObject",
    "SmartRedisCheckpointIO",
    "SmartRedisModelCheckpoint",
    "SmartRedisModelPublisher",
    "TlsFiles",
    "bfloat16",
    "error",
    "log_data",
    "log_error",
    "log_warning",
]

# Lightning is imported on first use only: clients and workers start without it.
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(
    ("SmartRedisCheckpointIO", "SmartRedisModelCheckpoint", "SmartRedisModelPublisher"), "smartredis_io.lightning.checkpoint_io"),
    __all__)
