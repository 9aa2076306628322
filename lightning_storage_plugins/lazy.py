"""Lazy exports for the plugin packages: ``import smartredis_io`` does not import Lightning,
``import fastpersist`` does not import DeepSpeed, until a name that needs them is used."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], eager: list[str], moved: Mapping[str, str] | None = None
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: a name in ``exports`` is imported
    from the module it maps to on first use and kept in the package's namespace after.

    Args:
        package: the package's ``__name__``.
        exports: each lazily exported name, and the module that defines it.
        eager: the package's ``__all__`` (listed by ``dir()`` with the lazy names).
        moved: names that moved out of the package, and their new module: still importable from the
            package, with a ``DeprecationWarning`` on every use, and not listed by ``dir()``.
    """
    namespace = importlib.import_module(package).__dict__
    moved = dict(moved or {})

    def __getattr__(name: str) -> Any:
        if name in moved:
            warnings.warn(f"{package}.{name} moved to {moved[name]}; import it from there (the old name "
                          f"goes away in the next release)", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(moved[name]), name)
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(eager) | set(exports))

    return __getattr__, __dir__
