"""Every plugin package exports the errors of an operation asked for inside another
(``ReentrantOperationError``, ``DeferredOperationError``): the same classes, from
``lightning_storage_plugins.reentry``, so that one ``except`` catches them whichever plugin raised."""

from __future__ import annotations

import importlib

import pytest

from lightning_storage_plugins import reentry


@pytest.mark.parametrize("package", ["dataflux_ckpt", "fastpersist", "smartredis_io"])
def test_each_plugin_package_exports_the_reentry_errors(package: str) -> None:
    module = importlib.import_module(package)
    for name in reentry.__all__:
        assert name in module.__all__, f"{package}.__all__ lacks {name}"
        assert getattr(module, name) is getattr(reentry, name)
