"""SmartRedis' ``ConfigOptions``: configuration read from environment variables, with overrides."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

from smartredis_io._client.helpers import typecheck
from smartredis_io.error import RedisKeyError, RedisRuntimeError

__all__ = ["ConfigOptions", "create_managed_instance", "managed", "typecheck"]

_NOT_FACTORY = "Method called on a ConfigOptions object not created from a factory method"


_T = TypeVar("_T")


def create_managed_instance(base: type[_T]) -> _T:
    """An instance of ``base`` (``ConfigOptions``) marked as made by a factory method

    :param base: the class
    :return: the new instance
    """
    instance = base()
    instance._is_created_via_factory = True  # type: ignore[attr-defined]
    return instance


def managed(func: Callable[..., _T]) -> Callable[..., _T]:
    """Decorate a method that only objects made by a factory method may call

    :param func: the method
    :return: the method, raising ``RedisRuntimeError`` when called on an object not made by a factory
    """

    @functools.wraps(func)
    def _wrapper(*args: Any, **kwargs: Any) -> _T:
        instance = args[0]
        if not getattr(instance, "_is_created_via_factory", False):
            raise RedisRuntimeError(f"Attempting to call managed method on {type(instance).__name__} object not "
                                    "created from a factory method")
        return func(*args, **kwargs)

    return _wrapper


class ConfigOptions:
    """Options such as ``SSDB``, ``SR_DB_TYPE``, ``SSKEYIN``; ``_<suffix>`` appended when given."""

    def __init__(self) -> None:
        self._is_created_via_factory = False
        self._suffix = ""
        self._overrides: dict[str, str | int] = {}

    @staticmethod
    def from_pybind(configoptions: ConfigOptions) -> ConfigOptions:
        """A new ConfigOptions with the source and overrides of another

        SmartRedis takes its pybind object here; smartredis_io has none, so this takes what
        ``get_data()`` returns.

        :param configoptions: the options to copy
        :type configoptions: ConfigOptions
        :return: the new ConfigOptions
        :rtype: ConfigOptions
        :raises TypeError: if the argument is not a ConfigOptions
        """
        typecheck(configoptions, "configoptions", ConfigOptions)
        result = ConfigOptions()
        result.set_configoptions(configoptions)
        return result

    def get_data(self) -> ConfigOptions:
        """The object holding these options (this ConfigOptions itself)

        :return: the options
        :rtype: ConfigOptions
        :raises RedisRuntimeError: if this object was not made by a factory method
        """
        self._check_factory()
        return self

    def set_configoptions(self, configoptions: ConfigOptions) -> None:
        """Take the source (environment suffix) and overrides of another ConfigOptions

        :param configoptions: the options to take
        :type configoptions: ConfigOptions
        :raises TypeError: if the argument is not a ConfigOptions
        """
        typecheck(configoptions, "configoptions", ConfigOptions)
        self._suffix = configoptions._suffix
        self._overrides = dict(configoptions._overrides)
        self._is_created_via_factory = configoptions._is_created_via_factory

    @classmethod
    def create_from_environment(cls, db_suffix: str) -> ConfigOptions:
        """Instantiate ConfigOptions, getting selections from environment variables

        If ``db_suffix`` is non-empty, ``_{db_suffix}`` is appended to the name of each
        environment variable that is read.

        :param db_suffix: suffix to append to environment variables, or an empty string
        :type db_suffix: str
        :return: the options
        :rtype: ConfigOptions
        :raises TypeError: if ``db_suffix`` is not a string
        """
        typecheck(db_suffix, "db_suffix", str)
        result = cls()
        result._suffix = db_suffix
        result._is_created_via_factory = True
        return result

    @property
    def is_factory_object(self) -> bool:
        """Whether this object was made by a factory method (``create_from_environment``)"""
        return self._is_created_via_factory

    def _check_factory(self) -> None:
        if not self._is_created_via_factory:
            raise RedisRuntimeError(_NOT_FACTORY)

    def _env_name(self, option_name: str) -> str:
        return f"{option_name}_{self._suffix}" if self._suffix else option_name

    def _lookup(self, option_name: str) -> str | int | None:
        typecheck(option_name, "option_name", str)
        self._check_factory()
        if option_name in self._overrides:
            return self._overrides[option_name]
        return os.environ.get(self._env_name(option_name))

    def _required(self, option_name: str) -> str | int:
        value = self._lookup(option_name)
        if value is None:
            raise RedisKeyError(f"Configuration option {self._env_name(option_name)} is not set")
        return value

    def _override(self, option_name: str, value: str | int, kind: type) -> None:
        typecheck(option_name, "option_name", str)
        typecheck(value, "value", kind)
        self._check_factory()
        self._overrides[option_name] = value

    def get_integer_option(self, option_name: str) -> int:
        """Retrieve the value of a numeric configuration option from the selected source

        :param option_name: The name of the configuration option to retrieve
        :type option_name: str
        :return: the value of the option
        :rtype: int
        :raises TypeError: if ``option_name`` is not a string
        :raises RedisKeyError: if the option is not set
        :raises RedisRuntimeError: if the value is not an integer, or this object was not made by a
            factory method
        """
        value = self._required(option_name)
        try:
            return int(value)
        except ValueError:
            raise RedisRuntimeError(f"The value {value!r} of {option_name} is not an integer") from None

    def get_string_option(self, option_name: str) -> str:
        """Retrieve the value of a string configuration option from the selected source

        :param option_name: The name of the configuration option to retrieve
        :type option_name: str
        :return: the value of the option
        :rtype: str
        :raises TypeError: if ``option_name`` is not a string
        :raises RedisKeyError: if the option is not set
        :raises RedisRuntimeError: if this object was not made by a factory method
        """
        return str(self._required(option_name))

    def is_configured(self, option_name: str) -> bool:
        """Check whether a configuration option is set in the selected source or overridden

        :param option_name: The name of the configuration option to check
        :type option_name: str
        :return: whether the option is set
        :rtype: bool
        :raises TypeError: if ``option_name`` is not a string
        :raises RedisRuntimeError: if this object was not made by a factory method
        """
        return self._lookup(option_name) is not None

    def override_integer_option(self, option_name: str, value: int) -> None:
        """Override the value of a numeric configuration option, for this object only

        :param option_name: The name of the configuration option to override
        :type option_name: str
        :param value: The value to store for the configuration option
        :type value: int
        :raises TypeError: if an argument has the wrong type
        :raises RedisRuntimeError: if this object was not made by a factory method
        """
        self._override(option_name, value, int)

    def override_string_option(self, option_name: str, value: str) -> None:
        """Override the value of a string configuration option, for this object only

        :param option_name: The name of the configuration option to override
        :type option_name: str
        :param value: The value to store for the configuration option
        :type value: str
        :raises TypeError: if an argument has the wrong type
        :raises RedisRuntimeError: if this object was not made by a factory method
        """
        self._override(option_name, value, str)

    def derived(self, **strings: str) -> ConfigOptions:
        """A new factory-made object with these options and string overrides (private helper)."""
        result = ConfigOptions.create_from_environment(self._suffix) if self._is_created_via_factory else \
            ConfigOptions.create_from_environment("")
        result._overrides = {**self._overrides, **strings}
        return result

    def integer_or(self, option_name: str, default: int) -> int:
        """The option as an integer, or ``default`` when unset (private helper of the client)."""
        return self.get_integer_option(option_name) if self.is_configured(option_name) else default

    def string_or(self, option_name: str, default: str) -> str:
        """The option as a string, or ``default`` when unset (private helper of the client)."""
        return self.get_string_option(option_name) if self.is_configured(option_name) else default
