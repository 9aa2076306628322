"""SmartRedis' exception names and hierarchy: code that catches ``RedisReplyError`` catches them all."""

from __future__ import annotations

import os

__all__ = [
    "RedisBadAllocError",
    "RedisConnectionError",
    "RedisDatabaseError",
    "RedisInternalError",
    "RedisKeyError",
    "RedisReplyError",
    "RedisRuntimeError",
    "RedisTimeoutError",
]


class RedisConnectionError(RuntimeError):
    """The database could not be reached; the message names the address tried."""

    def __init__(self, cpp_error: str = "") -> None:
        msg = f"{cpp_error}\n" if cpp_error else ""
        if "SSDB" in os.environ:
            msg += f"Could not connect to Orchestrator at {os.environ['SSDB']}"
        super().__init__(msg)


class RedisReplyError(RuntimeError):
    """The database (or an execution worker) answered a command with an error."""

    def __init__(self, cpp_error: str, method: str = "") -> None:
        super().__init__(f"{method} execution failed\n{cpp_error}" if method else cpp_error)


class RedisRuntimeError(RedisReplyError):
    """A command could not be carried out (bad argument combination, mismatched buffer, ...)."""


class RedisBadAllocError(RedisReplyError):
    """Memory for a value could not be allocated."""


class RedisDatabaseError(RedisReplyError):
    """The database itself failed."""


class RedisInternalError(RedisReplyError):
    """An internal invariant broke (e.g. a checksum of a chunked value does not match)."""


class RedisTimeoutError(RedisReplyError):
    """A command (e.g. ``run_model``) did not finish before its deadline."""


class RedisKeyError(RedisReplyError):
    """A key (tensor, dataset, model, script, configuration option) does not exist."""


class MissingKeyRuntimeError(RedisKeyError, RedisRuntimeError):
    """A key that does not exist, where SmartRedis reports a runtime error (``delete_dataset``,
    ``copy_list``, ...): code catching either ``RedisKeyError`` or ``RedisRuntimeError`` catches it."""
