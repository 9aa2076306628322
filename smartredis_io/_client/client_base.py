"""What every command group of :class:`smartredis_io.Client` shares.

The client is composed, as redis-py composes its commands, of one mixin per data type
(:mod:`~smartredis_io._client.tensor_commands`, :mod:`~smartredis_io._client.dataset_commands`,
:mod:`~smartredis_io._client.model_commands`, :mod:`~smartredis_io._client.list_commands`,
:mod:`~smartredis_io._client.admin_commands`). Each mixin relies on the state defined here: the
connection (``_db``) and the key prefixing that SmartRedis applies for ensembles (``SSKEYIN`` /
``SSKEYOUT``, switched per data type with ``use_*_ensemble_prefix``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

from smartredis_io import dataset as ds_layout
from smartredis_io._client.connection import Database
from smartredis_io._client.helpers import names, typecheck
from smartredis_io.error import RedisConnectionError, RedisReplyError, RedisRuntimeError, RedisTimeoutError

__all__ = ["ClientBase", "command", "names", "poll"]

F = TypeVar("F", bound=Callable[..., Any])


def command(method: F | None = None, *, timeout: Callable[[Any], float] | None = None) -> Any:
    """Make a client method one operation with one deadline, and its errors SmartRedis' exceptions.

    The deadline is ``SR_CMD_TIMEOUT`` (``timeout(self)`` seconds when given); redis-py errors become
    ``RedisTimeoutError`` / ``RedisConnectionError`` / ``RedisReplyError`` naming the method, its
    first argument (the key, for most methods) and the database.
    """
    if method is None:
        return functools.partial(command, timeout=timeout)

    @functools.wraps(method)
    def wrapper(self: ClientBase, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._db.operation(None if timeout is None else timeout(self)):
                return method(self, *args, **kwargs)
        except redis.exceptions.TimeoutError as exc:
            raise RedisTimeoutError(f"{_target(self, args)}: {exc}", method.__name__) from exc
        except UnicodeEncodeError as exc:
            raise RedisRuntimeError(f"{_target(self, args)}: names must be valid Unicode text ({exc})",
                                    method.__name__) from None
        except redis.exceptions.ConnectionError as exc:
            raise RedisConnectionError(f"{method.__name__} {_target(self, args)}: {exc}") from exc
        except redis.exceptions.NoPermissionError as exc:
            user = self._db.settings.username or "default"
            raise RedisReplyError(f"{_target(self, args)}: permission denied to user {user!r} (ACL): {exc}",
                                  method.__name__) from exc
        except redis.exceptions.RedisError as exc:
            raise RedisReplyError(f"{_target(self, args)}: {exc}", method.__name__) from exc

    return wrapper  # type: ignore[return-value]


def _target(client: ClientBase, args: tuple[Any, ...]) -> str:
    """``'name' at host:port``: what a failed call was about, for its error message."""
    where = f"at {client._db.address}" if getattr(client, "_db", None) is not None else ""
    if args and isinstance(args[0], str):
        return f"{args[0]!r} {where}".strip()
    return where


def poll(check: Callable[[], bool], poll_frequency_ms: int, num_tries: int) -> bool:
    """True once ``check()`` is, trying ``num_tries`` times ``poll_frequency_ms`` apart."""
    typecheck(poll_frequency_ms, "poll_frequency_ms", int)
    typecheck(num_tries, "num_tries", int)
    for attempt in range(num_tries):
        if check():
            return True
        if attempt + 1 < num_tries:
            time.sleep(poll_frequency_ms / 1000)
    return False


class ClientBase:
    """The connection and key prefixing shared by the command mixins."""

    _db: Database
    #: prefixes readable with ``set_data_source`` (``SSKEYIN``), the one written with (``SSKEYOUT``)
    #: and the one read with now
    _get_prefixes: list[str]
    _put_prefix: str
    _get_prefix: str
    #: whether prefixing applies, per data type ("tensor", "dataset", "list", "model")
    _use: dict[str, bool]

    def _init_prefixes(self, keyin: str, keyout: str) -> None:
        self._get_prefixes = [p for p in keyin.split(",") if p]
        self._put_prefix = keyout
        self._get_prefix = self._get_prefixes[0] if self._get_prefixes else ""
        self._use = {"tensor": True, "dataset": True, "list": True, "model": False}

    def _put_key(self, kind: str, name: str) -> str:
        """The key ``name`` of data type ``kind`` is written to."""
        return f"{self._put_prefix}.{name}" if self._use[kind] and self._put_prefix else name

    def _get_key(self, kind: str, name: str) -> str:
        """The key ``name`` of data type ``kind`` is read from."""
        return f"{self._get_prefix}.{name}" if self._use[kind] and self._get_prefix else name

    def _dataset_put_key(self, name: str) -> str:
        """The base key the dataset ``name`` is written to (SmartRedis' ``<prefix>.{name}``)."""
        return ds_layout.dataset_key(f"{self._put_prefix}." if self._use["dataset"] and self._put_prefix else "", name)

    def _dataset_get_key(self, name: str) -> str:
        """The base key the dataset ``name`` is read from."""
        return ds_layout.dataset_key(f"{self._get_prefix}." if self._use["dataset"] and self._get_prefix else "", name)
