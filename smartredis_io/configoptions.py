"""SmartRedis' ``ConfigOptions``: configuration read from environment variables, with overrides."""

from __future__ import annotations

import os

from smartredis_io.error import RedisKeyError, RedisRuntimeError

__all__ = ["ConfigOptions"]

_NOT_FACTORY = "Method called on a ConfigOptions object not created from a factory method"


def typecheck(arg: object, name: str, _type: type | tuple[type, ...]) -> None:
    """Raise SmartRedis' ``TypeError`` when ``arg`` is not an instance of ``_type``."""
    if not isinstance(arg, _type):
        raise TypeError(f"Argument {name} is of type {type(arg)}, not {_type}")


class ConfigOptions:
    """Options such as ``SSDB``, ``SR_DB_TYPE``, ``SSKEYIN``; ``_<suffix>`` appended when given."""

    def __init__(self) -> None:
        self._is_created_via_factory = False
        self._suffix = ""
        self._overrides: dict[str, str | int] = {}

    @classmethod
    def create_from_environment(cls, db_suffix: str) -> ConfigOptions:
        """Options read from environment variables, ``NAME_<db_suffix>`` when the suffix is non-empty."""
        typecheck(db_suffix, "db_suffix", str)
        result = cls()
        result._suffix = db_suffix
        result._is_created_via_factory = True
        return result

    @property
    def is_factory_object(self) -> bool:
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

    def get_integer_option(self, option_name: str) -> int:
        """The option as an integer; ``RedisKeyError`` when unset, ``RedisRuntimeError`` when not a number."""
        value = self._lookup(option_name)
        if value is None:
            raise RedisKeyError(f"Configuration option {self._env_name(option_name)} is not set")
        try:
            return int(value)
        except ValueError:
            raise RedisRuntimeError(f"The value {value!r} of {option_name} is not an integer") from None

    def get_string_option(self, option_name: str) -> str:
        """The option as a string; ``RedisKeyError`` when unset."""
        value = self._lookup(option_name)
        if value is None:
            raise RedisKeyError(f"Configuration option {self._env_name(option_name)} is not set")
        return str(value)

    def is_configured(self, option_name: str) -> bool:
        return self._lookup(option_name) is not None

    def override_integer_option(self, option_name: str, value: int) -> None:
        typecheck(option_name, "option_name", str)
        typecheck(value, "value", int)
        self._check_factory()
        self._overrides[option_name] = value

    def override_string_option(self, option_name: str, value: str) -> None:
        typecheck(option_name, "option_name", str)
        typecheck(value, "value", str)
        self._check_factory()
        self._overrides[option_name] = value

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
