"""SmartRedis-compatible tensor, dataset and model client on a stock Redis server."""

from typing import Any

from smartredis_io import error
from smartredis_io.client import Client
from smartredis_io.configoptions import ConfigOptions
from smartredis_io.dataset import Dataset
from smartredis_io.server import AclUser, Orchestrator, RedisCluster, RedisServer, TlsFiles
from smartredis_io.wire import bfloat16

__all__ = [
    "AclUser",
    "Client",
    "ConfigOptions",
    "Dataset",
    "Orchestrator",
    "RedisCluster",
    "RedisServer",
    "SmartRedisCheckpointIO",
    "SmartRedisModelCheckpoint",
    "SmartRedisModelPublisher",
    "TlsFiles",
    "bfloat16",
    "error",
]

_LIGHTNING = ("SmartRedisCheckpointIO", "SmartRedisModelCheckpoint", "SmartRedisModelPublisher")


def __getattr__(name: str) -> Any:
    # Lightning is imported on first use only: clients and workers start without it.
    if name in _LIGHTNING:
        from smartredis_io import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module 'smartredis_io' has no attribute {name!r}")
