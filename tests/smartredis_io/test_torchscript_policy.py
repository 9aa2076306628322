"""Stored models and scripts cannot reach files, processes or the network through the workers.

The malicious models map a file with ``torch.from_file`` and overwrite it, in ``forward`` or while
``torch.jit.load`` runs their ``__setstate__``. The victim file is world-writable, so that only the
policy (not the workers' unprivileged user) stands between the model and the file.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile

import numpy as np
import pytest
import torch

from smartredis_io import Client, Orchestrator
from smartredis_io._client import protocol, torchscript_policy
from smartredis_io._client.connection import Database
from smartredis_io._client.torchscript_policy import RefusedGraph
from smartredis_io.error import RedisReplyError
from smartredis_io.worker import _torchscript
from tests.support.srio_models import (
    MAPS_A_FILE_SCRIPT,
    MapsAFile,
    WritesWhileLoading,
    linear,
    torchscript_bytes,
)

X = np.ones((2, 4), dtype=np.float32)


@pytest.fixture
def victim():
    """A world-writable file in a world-accessible directory; its four bytes must stay b"safe"."""
    directory = tempfile.mkdtemp(prefix="srio-victim-", dir="/tmp")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "victim")
    with open(path, "wb") as f:
        f.write(b"safe")
    os.chmod(path, 0o666)
    yield path
    shutil.rmtree(directory)


def _unchanged(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read() == b"safe"


def _store_raw(orchestrator: Orchestrator, name: str, blob: bytes, kind: str) -> None:
    """Store as any writer to Redis could, without the client's check."""
    db = Database(orchestrator.settings())
    try:
        protocol.store(db, name, blob, protocol.Manifest(kind, protocol.new_version()))
    finally:
        db.close()


def test_set_model_refuses_a_model_that_maps_a_file(orch_client: Client, uid: str, victim: str) -> None:
    with pytest.raises(RedisReplyError, match="aten::from_file"):
        orch_client.set_model(uid, torchscript_bytes(MapsAFile(victim)))
    assert not orch_client.model_exists(uid)


@pytest.mark.parametrize("model", [MapsAFile, WritesWhileLoading])
def test_workers_refuse_a_malicious_model_stored_behind_the_clients_back(
        orchestrator: Orchestrator, orch_client: Client, uid: str, victim: str, model) -> None:
    _store_raw(orchestrator, uid, torchscript_bytes(model(victim)), "model")
    orch_client.put_tensor(uid + "x", X)
    with pytest.raises(RedisReplyError, match=re.escape(f"model '{uid}' was refused: it uses aten::from_file")):
        orch_client.run_model(uid, [uid + "x"], [uid + "y"])
    assert _unchanged(victim)
    assert not orch_client.tensor_exists(uid + "y")


def test_scripts_that_map_a_file_are_refused(orchestrator: Orchestrator, orch_client: Client, uid: str,
                                              victim: str) -> None:
    script = MAPS_A_FILE_SCRIPT.format(path=victim)
    with pytest.raises(RedisReplyError, match="aten::from_file"):
        orch_client.set_script(uid, script)
    _store_raw(orchestrator, uid, script.encode(), "script")
    orch_client.put_tensor(uid + "x", X)
    with pytest.raises(RedisReplyError, match="aten::from_file"):
        orch_client.run_script(uid, "touch", [uid + "x"], [uid + "y"])
    assert _unchanged(victim)


def test_scripts_see_only_torch_and_math(orchestrator: Orchestrator, orch_client: Client, uid: str) -> None:
    """A script compiled with the worker's frame could reach the worker module's globals (os, sys...)."""
    _store_raw(orchestrator, uid, b"def f(x):\n    return os.getpid() + x\n", "script")
    orch_client.put_tensor(uid + "x", X)
    with pytest.raises(RedisReplyError, match="undefined value os"):
        orch_client.run_script(uid, "f", [uid + "x"], [uid + "y"])


@pytest.mark.parametrize(("source", "op"), [
    ("def f(x):\n    return torch.from_file('/etc/passwd', False, 4)\n", "aten::from_file"),
    ("def f(x):\n    return math.from_file('/etc/passwd', False, 4)\n", "aten::from_file"),
    ("def f(x):\n    return torch.ops.aten.from_file('/etc/passwd', False, 4)\n", "aten::from_file"),
    ("def f(x):\n    x.save('/tmp/out')\n    return x\n", "aten::save"),
    ("def f(x):\n    return getattr(torch, 'from_file')('/etc/passwd')\n", "aten::from_file"),
    ("def f(x):\n    ops.c10d.barrier(x)\n    return x\n", "c10d::barrier"),
    ("def f(x):\n    return rpc_sync('w', torch.add, (x, x))\n", "prim::rpc_sync"),
    ("def f(x: __torch__.torch.classes.c10d.Store):\n    return x\n", "the custom class namespace c10d"),
])
def test_the_static_check_names_the_op(source: str, op: str) -> None:
    with pytest.raises(RefusedGraph, match=re.escape(op)) as info:
        torchscript_policy.check_source(source, "script 's'", "set_script")
    assert "set_script execution failed" in str(info.value)


def test_ordinary_models_pass_every_check() -> None:
    blob = torchscript_bytes(linear(0), torch.from_numpy(X))
    torchscript_policy.check_archive(blob, "model 'm'")
    loaded = torch.jit.load(io.BytesIO(blob))
    torchscript_policy.check_ops(_torchscript.op_kinds(loaded), "model 'm'")


def test_set_model_refuses_bytes_that_are_not_a_torchscript_archive(orch_client: Client, uid: str) -> None:
    with pytest.raises(RedisReplyError, match="not a TorchScript archive"):
        orch_client.set_model(uid, b"\x80\x04garbage")


def test_graph_walk_sees_ops_in_nested_blocks_and_called_submodules() -> None:
    unit = _torchscript.compile_script(
        "def inner(x):\n    return torch.relu(x)\n\n"
        "def outer(x):\n    for i in range(2):\n        if i > 0:\n            x = inner(x)\n    return x\n"
    )
    assert {"aten::relu", "prim::Loop", "prim::If"} <= _torchscript.op_kinds(unit)


def test_every_file_touching_op_of_this_torch_is_refused() -> None:
    """Fails when a torch release adds an op that takes a file name in an allowed namespace."""
    pathlike = re.compile(r"file|path|dir")
    missed = [
        schema.name for schema in _torchscript.all_schemas()
        if any(pathlike.search(arg.name) and "str" in str(arg.type) for arg in schema.arguments)
        and schema.name.split("::")[0] in torchscript_policy.ALLOWED_NAMESPACES
        and schema.name not in torchscript_policy.DENIED_OPS
    ]
    assert not missed, f"ops that take a file name but are allowed: {missed}"
