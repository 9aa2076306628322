"""Supervision of local service processes (fake-gcs-server, redis-server).

The plugins' embedded launchers (``dataflux_ckpt.emulator``, ``smartredis_io.server``) are built on
:class:`ManagedProcess`, so that every service started for a user, a test or a benchmark is waited
for, reports its log tail when it fails, and never outlives the Python process that started it.
"""

from localservices.process import (
    ManagedProcess,
    MissingBinaryError,
    ServiceStartError,
    find_binary,
    free_port,
)

__all__ = ["ManagedProcess", "MissingBinaryError", "ServiceStartError", "find_binary", "free_port"]
