"""Argument checks shared by the client's command modules, the dataset and the SmartRedis module names.

SmartRedis raises ``TypeError`` naming the argument for a value of the wrong type, and its own
errors for values it refuses; every module checks arguments through these functions so that the
messages read the same wherever a user meets them. ``configoptions``, ``util`` and
``dataset_utils`` re-export ``typecheck`` and ``typecheck_stringlist`` under SmartRedis' names.
"""

from __future__ import annotations

import inspect
import os
import textwrap
from collections.abc import Callable

from smartredis_io.error import RedisRuntimeError

__all__ = ["check_file", "function_source", "names", "typecheck", "typecheck_list", "typecheck_stringlist"]


def typecheck(arg: object, name: str, _type: type | tuple[type, ...]) -> None:
    """Raise SmartRedis' ``TypeError`` when ``arg`` is not an instance of ``_type``

    :param arg: the value to check
    :param name: the argument's name, for the error
    :param _type: the type (or types) ``arg`` must have
    :raises TypeError: if ``arg`` is not of ``_type``
    """
    if not isinstance(arg, _type):
        raise TypeError(f"Argument {name} is of type {type(arg)}, not {_type}")


def typecheck_list(values: object, name: str, item_name: str | None = None) -> list[str]:
    """``values``, once it is known to be a list of strings

    :param values: the value to check
    :param name: the list's name, for errors
    :param item_name: an element's name, for errors (default: ``name``)
    :return: ``values``
    :raises TypeError: if ``values`` is not a list, or one of its elements not a string
    """
    typecheck(values, name, list)
    for value in values:  # type: ignore[attr-defined]
        typecheck(value, item_name or name, str)
    return values  # type: ignore[return-value]


def typecheck_stringlist(names: list[str], strings_name: str, string_name: str) -> None:
    """Check that ``names`` is a list of non-empty strings

    :param names: the list to check
    :param strings_name: the list's name, for errors
    :param string_name: an element's name, for errors
    :raises TypeError: if ``names`` is not a list of strings
    :raises RedisRuntimeError: if an element is an empty string
    """
    typecheck(names, strings_name, list)
    for name in names:
        typecheck(name, string_name, str)
        if not name:
            raise RedisRuntimeError(f"Empty string in {strings_name}")


def names(arg: str | list[str] | None, what: str) -> list[str]:
    """A name or a list of names as a list; ``TypeError`` (as SmartRedis) for anything else."""
    if arg is None:
        return []
    if isinstance(arg, str):
        return [arg]
    return typecheck_list(arg, what)


def function_source(function: Callable) -> str:
    """The source of a function to store as a script (``TypeError`` as SmartRedis when not callable)."""
    if not callable(function):
        raise TypeError(f"Argument provided for function, {type(function)}, is not callable")
    return textwrap.dedent(inspect.getsource(function))


def check_file(path: str) -> str:
    """The absolute path of a model or script file; ``FileNotFoundError`` (as SmartRedis) when it is none."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return path
