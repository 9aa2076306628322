"""The plugin packages import their heavy dependencies (Lightning, DeepSpeed) only when a name that
needs them is used, list every exported name in ``dir()``, and refuse unknown names by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROGRAM = """
import sys, {package}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "deepspeed"))
assert not heavy, heavy
assert "{name}" in dir({package}), dir({package})
assert {package}.{name}.__name__ == "{name}"
assert "{name}" in vars({package})
try:
    {package}.no_such_name
except AttributeError as exc:
    assert "'no_such_name'" in str(exc) and "{package}" in str(exc), exc
else:
    raise AssertionError("no AttributeError")
"""


@pytest.mark.parametrize(("package", "name"), [
    ("smartredis_io", "SmartRedisCheckpointIO"),
    ("fastpersist", "FastPersistCheckpointIO"),
    ("dataflux_ckpt", "DatafluxCheckpointIO"),
])
def test_a_lazy_export_is_imported_on_first_use_and_listed(package: str, name: str) -> None:
    done = subprocess.run([sys.executable, "-c", _PROGRAM.format(package=package, name=name)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_helper_makes_one_getattr_and_dir_pair() -> None:
    from lightning_storage_plugins.lazy import lazy_exports

    getattr_, dir_ = lazy_exports("json", {"JSONDecoder": "json.decoder"}, ["dumps"])
    assert getattr_("JSONDecoder").__module__ == "json.decoder"
    assert {"JSONDecoder", "dumps"} <= set(dir_())
    with pytest.raises(AttributeError, match="'json' has no attribute 'nope'"):
        getattr_("nope")
