"""torch.export programs as models: run and batched like TorchScript, and loaded without running their code.

The attacks are archives edited the way anyone who can write to Redis could: each one is first shown
to run its code when torch loads it on its own (so the test would fail if the policy did nothing),
then shown to be refused by ``set_model`` and, stored behind the client's back, by the workers.
"""

from __future__ import annotations

import io
import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from smartredis_io import Client, Orchestrator
from smartredis_io._client import export_policy, protocol
from smartredis_io._client.connection import Database
from smartredis_io._client.torchscript_policy import RefusedGraph
from smartredis_io.error import RedisReplyError
from smartredis_io.worker import _torch_export
from tests.support.srio_export import (
    BatchRows,
    edit,
    edit_program,
    export_bytes,
    first_expression,
    legacy_export_bytes,
    nodes,
    payload,
)
from tests.support.srio_models import linear

X = np.random.default_rng(3).random((3, 4), dtype=np.float32)
CPU = torch.device("cpu")


def _expected(module: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def program() -> bytes:
    return export_bytes(linear(0), torch.from_numpy(X))


PT2_ONLY = {"pickled weight", "guards code", "pickled sample inputs"}


def _needs_pt2(program: bytes, name: str = "") -> None:
    if (not name or name in PT2_ONLY) and export_policy.ExportArchive(program, "m").layout != "pt2":
        pytest.skip(f"torch {torch.__version__} writes the older archive layout (no {name or 'pt2 archive'})")


def _store_raw(orchestrator: Orchestrator, name: str, blob: bytes) -> None:
    """Store as any writer to Redis could, without the client's check."""
    db = Database(orchestrator.settings())
    try:
        protocol.store(db, name, blob, protocol.Manifest("model", protocol.new_version()))
    finally:
        db.close()


def test_run_model_with_an_exported_program(orch_client: Client, uid: str, program: bytes) -> None:
    orch_client.set_model(uid, program, "TORCH", "CPU", tag="export")
    assert orch_client.get_model(uid) == program
    for rows in (1, 3):
        orch_client.put_tensor(uid + "x", X[:rows])
        orch_client.run_model(uid, [uid + "x"], [uid + "y"])
        np.testing.assert_allclose(orch_client.get_tensor(uid + "y"), _expected(linear(0), X[:rows]), rtol=1e-6)


def test_the_legacy_archive_layout_runs_too(orch_client: Client, uid: str) -> None:
    blob = legacy_export_bytes(linear(1), torch.from_numpy(X))
    assert export_policy.check_archive(blob, "m").layout == "legacy"
    orch_client.set_model(uid, blob)
    orch_client.put_tensor(uid + "x", X)
    orch_client.run_model(uid, [uid + "x"], [uid + "y"])
    np.testing.assert_allclose(orch_client.get_tensor(uid + "y"), _expected(linear(1), X), rtol=1e-6)


def test_exported_programs_are_batched(orch_client: Client, orchestrator: Orchestrator, uid: str) -> None:
    orch_client.set_model(uid, export_bytes(BatchRows(), torch.zeros(2, 4)), "TORCH", batch_size=8,
                          min_batch_size=4, min_batch_timeout=5000)
    clients = [Client(False, orchestrator.address) for _ in range(4)]
    errors: list[BaseException] = []

    def call(i: int, client: Client) -> None:
        try:
            client.put_tensor(f"{uid}x{i}", np.ones((1, 4), np.float32))
            client.run_model(uid, [f"{uid}x{i}"], [f"{uid}y{i}"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i, c)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for client in clients:
        client.close()
    assert not errors
    # every request ran in one batch of the 4 (min_batch_size) requests
    assert [float(orch_client.get_tensor(f"{uid}y{i}")[0, 0]) for i in range(4)] == [4.0] * 4


def test_static_sizes_are_checked_before_the_graph_runs(orch_client: Client, uid: str) -> None:
    orch_client.set_model(uid, export_bytes(linear(0), torch.from_numpy(X[:1]), dynamic_batch=False))
    orch_client.put_tensor(uid + "x", X)
    with pytest.raises(RedisReplyError, match=r"size 1 in dimension 0"):
        orch_client.run_model(uid, [uid + "x"], [uid + "y"])
    orch_client.put_tensor(uid + "x", X.astype(np.float64))
    with pytest.raises(RedisReplyError, match="torch.float32"):
        orch_client.run_model(uid, [uid + "x"], [uid + "y"])


def test_run_model_overhead_path_runs_the_graph_without_module_wrappers(program: bytes) -> None:
    model = _torch_export.load(program, CPU, "model 'm'")
    x = torch.from_numpy(X)
    with torch.inference_mode():
        (y,) = model(x)
    np.testing.assert_allclose(y.numpy(), _expected(linear(0), X), rtol=1e-6)
    with pytest.raises(ValueError, match=r"inputs of the exported program|takes 1 inputs"):
        model(x, x)


# ---- attacks ---------------------------------------------------------------------------------


def _pickled_weight(marker: Path):
    def change(members: dict[str, bytes]) -> None:
        config = json.loads(members[export_policy.PT2_WEIGHTS_CONFIG])
        meta = next(iter(config["config"].values()))
        meta["use_pickle"] = True
        members["data/weights/" + meta["path_name"]] = payload(str(marker))
        members[export_policy.PT2_WEIGHTS_CONFIG] = json.dumps(config).encode()
    return change


def _pickled_sample_inputs(marker: Path):
    def change(members: dict[str, bytes]) -> None:
        members[export_policy.PT2_SAMPLE_INPUTS] = payload(str(marker))
    return change


def _sympy_eval(marker: Path):
    def change(program: dict) -> None:
        first_expression(program)["expr_str"] = f"__import__('builtins').open({str(marker)!r}, 'w').write('x')"
    return change


def _guards_code(marker: Path):
    def change(program: dict) -> None:
        program["guards_code"] = [f"__import__('builtins').open({str(marker)!r}, 'w').write('x') or True"]
    return change


def _target(target: str):
    def change(program: dict) -> None:
        nodes(program)[0]["target"] = target
    return change


ATTACKS = {
    # name: (edit of the archive, edit of the program JSON, what the refusal says, runs code under torch alone)
    "pickled weight": (_pickled_weight, None, "stored as a pickle", True),
    "sympy eval": (None, _sympy_eval, "symbolic shape expression", True),
    "guards code": (None, _guards_code, "guards are Python code", True),
    "torch.load target": (None, lambda marker: _target("torch.load"), "torch.load", False),
    "denied op": (None, lambda marker: _target("torch.ops.aten.from_file.default"), "aten::from_file", False),
    "foreign namespace": (None, lambda marker: _target("torch.ops.c10d.barrier.default"), "c10d::barrier", False),
    "subgraph": (None, lambda marker: nodes_arg(marker), "as_graph", False),
}


def nodes_arg(marker: Path):
    def change(program: dict) -> None:
        nodes(program)[0]["inputs"][0]["arg"] = {"as_graph": {"name": "g", "graph": {}}}
    return change


def _attack(program: bytes, name: str, marker: Path) -> bytes:
    archive_edit, program_edit, _, _ = ATTACKS[name]
    blob = program
    if archive_edit:
        blob = edit(blob, archive_edit(marker))
    if program_edit:
        blob = edit_program(blob, program_edit(marker))
    return blob


def _loads_under_torch(blob: bytes) -> None:
    program = torch.export.load(io.BytesIO(blob))
    program.module()(torch.from_numpy(X))


@pytest.mark.parametrize("name", [n for n, a in ATTACKS.items() if a[3]])
def test_each_code_running_attack_runs_under_torch_alone(program: bytes, name: str, tmp_path: Path) -> None:
    """The attacks are real: torch's own loader runs their code."""
    _needs_pt2(program, name)
    marker = tmp_path / "marker"
    try:
        _loads_under_torch(_attack(program, name, marker))
    except Exception:  # noqa: BLE001 - the graph may fail after the code ran; the marker tells
        pass
    assert marker.exists(), f"the {name} attack did not run under torch.export.load"


@pytest.mark.parametrize("name", list(ATTACKS))
def test_set_model_refuses_the_attack(orch_client: Client, program: bytes, uid: str, name: str,
                                      tmp_path: Path) -> None:
    _needs_pt2(program, name)
    marker = tmp_path / "marker"
    with pytest.raises(RedisReplyError, match=re.escape(ATTACKS[name][2])):
        orch_client.set_model(uid, _attack(program, name, marker))
    assert not orch_client.model_exists(uid)
    assert not marker.exists()


@pytest.mark.parametrize("name", [*ATTACKS, "pickled sample inputs"])
def test_workers_refuse_the_attack_stored_behind_the_clients_back(
        orchestrator: Orchestrator, orch_client: Client, program: bytes, uid: str, name: str,
        tmp_path: Path) -> None:
    _needs_pt2(program, name)
    marker = tmp_path / "marker"
    if name == "pickled sample inputs":  # not visible without torch: only the worker can refuse it
        blob, why = edit(program, _pickled_sample_inputs(marker)), "sample inputs are not plain tensors"
    else:
        blob, why = _attack(program, name, marker), ATTACKS[name][2]
    _store_raw(orchestrator, uid, blob)
    orch_client.put_tensor(uid + "x", X)
    with pytest.raises(RedisReplyError, match=re.escape(why)):
        orch_client.run_model(uid, [uid + "x"], [uid + "y"])
    assert not marker.exists()
    assert not orch_client.tensor_exists(uid + "y")


def test_legacy_archives_with_pickled_tensors_are_refused_by_workers(
        orchestrator: Orchestrator, orch_client: Client, uid: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    blob = legacy_export_bytes(linear(0), torch.from_numpy(X))
    blob = edit(blob, lambda members: members.__setitem__("serialized_state_dict.pt", payload(str(marker))))
    _store_raw(orchestrator, uid, blob)
    orch_client.put_tensor(uid + "x", X)
    with pytest.raises(RedisReplyError, match="state_dict are not plain tensors"):
        orch_client.run_model(uid, [uid + "x"], [uid + "y"])
    assert not marker.exists()


def test_aotinductor_code_is_refused(program: bytes) -> None:
    _needs_pt2(program)
    blob = edit(program, lambda members: members.__setitem__("data/aotinductor/model/model.so", b"\x7fELF"))
    with pytest.raises(RedisReplyError, match="AOTInductor"):
        export_policy.check_archive(blob, "model 'm'", "set_model")


@pytest.mark.parametrize("expression", [
    "Symbol('s0', positive=True, integer=True)",
    "Mul(Integer(2), Symbol('s3', integer=True))",
    "FloorDiv(s0, 2) + Max(1, s1) - 3",
    "s0*s1 <= 4096",
])
def test_expressions_of_real_programs_pass(expression: str) -> None:
    export_policy.check_expression(expression, "model 'm'")


@pytest.mark.parametrize("expression", [
    "__import__('os')",
    "Symbol('s0').__class__",
    "lambdify('x', 'x')",
    "Symbol('a; import os')",
    "s0[0]",
    "(lambda: 1)()",
    "Integer(1" + ")" * 3,
])
def test_expressions_that_are_not_arithmetic_are_refused(expression: str) -> None:
    with pytest.raises(RedisReplyError, match="symbolic shape expression"):
        export_policy.check_expression(expression, "model 'm'")


def test_refusals_name_the_op(program: bytes) -> None:
    blob = edit_program(program, _target("torch.ops.aten.save.default"))
    with pytest.raises(RefusedGraph, match="aten::save") as info:
        export_policy.check_archive(blob, "model 'm'", "set_model")
    assert "set_model execution failed" in str(info.value)


# ---- what the policy and the adapter rely on in torch ---------------------------------------------


CHANGED = "torch.export changed under smartredis_io: "


def test_the_program_json_still_has_the_fields_the_policy_checks(program: bytes) -> None:
    """If torch renamed these fields the static check would silently check nothing."""
    archive = export_policy.ExportArchive(program, "m")
    assert archive.layout in ("pt2", "legacy"), CHANGED + "torch.export.save writes neither known layout"
    document = json.loads(archive.read(export_policy.PT2_MODEL if archive.layout == "pt2"
                                       else export_policy.LEGACY_PROGRAM))
    keys = {key for key, _ in export_policy._walk(document)}
    assert {"target", "expr_str", "custom_obj_values"} <= keys, CHANGED + f"keys are {sorted(keys)}"
    assert all(export_policy.target_kind(n["target"]) for n in nodes(document)), CHANGED + "node targets"
    if archive.layout == "legacy":
        return
    assert "guards_code" in keys, CHANGED + "guards_code moved"
    config = json.loads(archive.read(export_policy.PT2_WEIGHTS_CONFIG))["config"]
    assert config and all(meta["use_pickle"] is False and meta["path_name"].startswith("weight_")
                          for meta in config.values()), CHANGED + "weights config"


def test_the_loaded_program_has_what_the_fast_path_binds(program: bytes) -> None:
    loaded = torch.export.load(io.BytesIO(program))
    kinds = [spec.kind.name for spec in loaded.graph_signature.input_specs]
    assert kinds == ["PARAMETER", "PARAMETER", "USER_INPUT"], CHANGED + f"input specs {kinds}"
    assert [spec.kind.name for spec in loaded.graph_signature.output_specs] == ["USER_OUTPUT"]
    user = [n for n in loaded.graph_module.graph.nodes if n.op == "placeholder"][-1]
    batch = user.meta["val"].shape[0]
    ranges = loaded.range_constraints[batch.node.expr]
    assert (int(ranges.lower), int(ranges.upper)) == (1, 4096), CHANGED + "range constraints"
    assert _torch_export.op_kinds(loaded, "m") == {"aten::linear"}
