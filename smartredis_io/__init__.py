"""SmartRedis-compatible tensor, dataset and model client on a stock Redis server."""

from smartredis_io.server import RedisCluster, RedisServer

__all__ = ["RedisCluster", "RedisServer"]
