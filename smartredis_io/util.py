"""SmartRedis' ``util`` module: type names of tensors and metadata, argument checks, error mapping."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import redis

from smartredis_io import error
from smartredis_io._client.helpers import typecheck

__all__ = ["Dtypes", "exception_handler", "init_default", "typecheck"]

F = TypeVar("F", bound=Callable[..., Any])

_TENSOR_TYPES = {
    "float64": "DOUBLE", "float32": "FLOAT", "uint8": "UINT8", "uint16": "UINT16", "int8": "INT8",
    "int16": "INT16", "int32": "INT32", "int64": "INT64",
}
_METADATA_TYPES = {
    "float64": "DOUBLE", "float32": "FLOAT", "uint32": "UINT32", "uint64": "UINT64", "int32": "INT32",
    "int64": "INT64",
}
_FROM_STRING: dict[str, type] = {
    "DOUBLE": np.double, "FLOAT": np.float32, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "STRING": str,
}


class Dtypes:
    """Names SmartRedis gives numpy types of tensors and metadata (``FLOAT``, ``INT64``, ...)."""

    @staticmethod
    def tensor_from_numpy(array: np.ndarray) -> str:
        """The SmartRedis tensor type name of an array's dtype

        :param array: the array
        :type array: np.ndarray
        :return: the type name, e.g. ``FLOAT``
        :rtype: str
        :raises TypeError: if SmartRedis has no tensor type for the dtype
        """
        dtype = str(array.dtype)
        if dtype in _TENSOR_TYPES:
            return _TENSOR_TYPES[dtype]
        raise TypeError(f"Incompatible tensor type provided {dtype}")

    @staticmethod
    def metadata_from_numpy(array: np.ndarray) -> str:
        """The SmartRedis metadata type name of an array's dtype

        :param array: the array (a scalar as a 0-d array)
        :type array: np.ndarray
        :return: the type name, e.g. ``UINT32``
        :rtype: str
        :raises TypeError: if SmartRedis has no metadata type for the dtype
        """
        dtype = str(array.dtype)
        if dtype in _METADATA_TYPES:
            return _METADATA_TYPES[dtype]
        raise TypeError(f"Incompatible metadata type provided {dtype}")

    @staticmethod
    def from_string(type_name: str) -> type:
        """The numpy type (or ``str``) of a SmartRedis type name

        ``FLOAT`` is ``np.float32`` (SmartRedis 0.6.1 answers ``np.float64``).

        :param type_name: the type name, e.g. ``INT32`` or ``STRING``
        :type type_name: str
        :return: the type
        :rtype: type
        :raises TypeError: if the name is not a SmartRedis type name
        """
        if type_name in _FROM_STRING:
            return _FROM_STRING[type_name]
        raise TypeError(f"Unrecognized type name {type_name}")


def init_default(default: Any, init_value: Any, expected_type: type | tuple[type, ...] | None = None) -> Any:
    """``init_value``, or ``default`` when it is None (a mutable default without the shared-default trap)

    :param default: the value to use when ``init_value`` is None
    :param init_value: the value given
    :param expected_type: the type ``init_value`` must have when given
    :return: ``init_value`` or ``default``
    :raises TypeError: if ``init_value`` is given and not of ``expected_type``
    """
    if init_value is None:
        return default
    if expected_type is not None and not isinstance(init_value, expected_type):
        raise TypeError(f"Argument was of type {type(init_value)}, not {expected_type}")
    return init_value


def exception_handler(func: F) -> F:
    """Raise SmartRedis' exception types for failures of the Redis layer below ``func``

    A redis-py timeout becomes ``RedisTimeoutError``, a lost connection ``RedisConnectionError`` and
    any other redis-py error ``RedisReplyError``, each naming ``Class.method``; ``TypeError``,
    ``ValueError`` and SmartRedis' own errors pass through unchanged.

    :param func: the API function (or method) to wrap
    :type func: callable
    :return: the wrapped function
    :rtype: callable
    """

    @functools.wraps(func)
    def smartredis_api_wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except redis.exceptions.RedisError as exc:
            name = func.__qualname__
            if isinstance(exc, redis.exceptions.TimeoutError):
                raise error.RedisTimeoutError(str(exc), name) from exc
            if isinstance(exc, redis.exceptions.ConnectionError):
                raise error.RedisConnectionError(f"{name}: {exc}") from exc
            raise error.RedisReplyError(str(exc), name) from exc

    return smartredis_api_wrapper  # type: ignore[return-value]
