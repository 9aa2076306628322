"""The package's public surface: importable without Lightning, documented, Lightning's contract."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import dataflux_ckpt
from dataflux_ckpt import emulator, testing, xml_server


def test_the_package_and_its_building_blocks_import_without_lightning_or_torch():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["lightning"] = None  # as if not installed
        sys.modules["torch"] = None
        import dataflux_ckpt
        from dataflux_ckpt import Gcs, ObjectReader, ObjectWriter, StreamingWriter, parse_gcs_path
        from dataflux_ckpt.testing import FakeGcsServer, XmlMultipartServer
        try:
            dataflux_ckpt.DatafluxCheckpointIO
        except ImportError as exc:
            print("needs", exc.name)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() in (["needs", "torch"], ["needs", "lightning"])


def test_test_fakes_live_in_the_testing_module_and_old_names_warn():
    from dataflux_ckpt import testing

    assert not {"FakeGcsServer", "XmlMultipartServer"} & set(dataflux_ckpt.__all__)
    for name in ("FakeGcsServer", "XmlMultipartServer"):
        assert name in testing.__all__
        with pytest.warns(DeprecationWarning, match=f"dataflux_ckpt.{name} moved to dataflux_ckpt.testing"):
            old = getattr(dataflux_ckpt, name)
        assert old is getattr(testing, name)
    with pytest.warns(DeprecationWarning, match="moved to dataflux_ckpt.testing"):
        from dataflux_ckpt import FakeGcsServer  # noqa: F401


def test_every_exported_name_resolves():
    for name in dataflux_ckpt.__all__:
        assert getattr(dataflux_ckpt, name) is not None


def _public_callables(module: object) -> list[tuple[str, object]]:
    found = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            found.append((name, obj))
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                    found.append((f"{name}.{attr}", member))
        elif callable(obj):
            found.append((name, obj))
    return found


def test_every_public_function_class_and_method_has_a_docstring():
    undocumented = [
        name for module in (dataflux_ckpt, emulator, testing, xml_server) for name, obj in _public_callables(module)
        if not (inspect.getdoc(obj) or "").strip()
    ]
    assert undocumented == []


def test_checkpoint_io_signatures_are_lightnings():
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

    ours = dataflux_ckpt.DatafluxCheckpointIO
    for method in ("save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown"):
        base = list(inspect.signature(getattr(CheckpointIO, method)).parameters.values())
        mine = list(inspect.signature(getattr(ours, method)).parameters.values())
        assert [(p.name, p.default, p.kind) for p in mine[: len(base)]] == \
            [(p.name, p.default, p.kind) for p in base], method
    load = inspect.signature(ours.load_checkpoint).parameters
    assert list(load) == ["self", "path", "map_location", "weights_only"]
    assert load["weights_only"].default is None
