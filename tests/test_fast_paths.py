"""The fast save and load paths run on the installed torch, whichever release it is, and give what
torch gives: checked in every environment CI runs (the oldest supported torch, a middle one, the newest).

A 1,000-tensor save and load through each plugin make no call into torch's per-tensor functions and
produce torch's bytes and torch's tensors. A mirrored torch function made to behave otherwise turns
off only the fast path that mirrors it (in a process of its own: verdicts are reached once per
process), with one debug line naming it, and the results are still torch's.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dataflux_ckpt import DatafluxCheckpointIO, DatafluxStorageReader, DatafluxStorageWriter
from fastpersist import FastPersistStorageReader, FastPersistStorageWriter, fastpersist_load, fastpersist_save
from lightning_storage_plugins import _torch_compat
from tests.support.direct_io import o_direct_dir
from tests.support.fp_compare import assert_same
from tests.support.torch_calls import per_tensor_torch_calls

NUM_TENSORS = 1000
REPO = Path(__file__).resolve().parent.parent


def thousand_tensors() -> dict[str, Any]:
    """1,000 tensors of several dtypes (one of them a ``_rebuild_tensor_v3`` dtype), shapes and
    strides, some sharing a storage, in a module's state dict and an optimizer-like nest."""
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint16, torch.bool]
    weights: dict[str, Any] = {}
    for index in range(NUM_TENSORS - 200):
        base = (torch.arange(12) % 7).to(dtypes[index % len(dtypes)])
        weights[f"layer{index}.weight"] = base.view(3, 4).t() if index % 3 == 0 else base[index % 4 :]
    weights["tied"] = weights["layer1.weight"]
    state = {"state_dict": weights, "optimizer": {"state": {i: {"step": torch.tensor(float(i))} for i in range(199)}},
             "epoch": 3, "name": "run"}
    return state


def _pickle_of(archive: bytes | Path) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive) if isinstance(archive, bytes) else archive) as zipped:
        return zipped.read(next(name for name in zipped.namelist() if name.endswith("/data.pkl")))


def _warm_up(tmp_path: Path) -> None:
    """One small save and load: each mirror's check runs torch's own functions, once per process."""
    fastpersist_save({"w": torch.ones(2)}, tmp_path / "warm.pt", engine="python")
    fastpersist_load(tmp_path / "warm.pt")


def test_fastpersist_saves_and_loads_a_thousand_tensors_without_torchs_per_tensor_functions(tmp_path: Path) -> None:
    directory = o_direct_dir(tmp_path)
    _warm_up(directory)
    state = thousand_tensors()
    with per_tensor_torch_calls() as calls:
        fastpersist_save(state, directory / "ckpt.pt", engine="python")
        loaded = fastpersist_load(directory / "ckpt.pt")
    assert not calls, f"torch {torch.__version__}: per-tensor calls into torch {dict(calls)}"
    reference = io.BytesIO()
    torch.save(state, reference)
    assert _pickle_of(directory / "ckpt.pt") == _pickle_of(reference.getvalue())
    assert _torch_compat.load_difference(loaded, torch.load(io.BytesIO(reference.getvalue()), weights_only=True)) is None


def test_dcp_storages_save_and_load_a_thousand_tensors_without_torchs_per_tensor_functions(
    tmp_path: Path, gcs_bucket: str
) -> None:
    _warm_up(o_direct_dir(tmp_path))
    state = {f"w{index}": (torch.arange(6) + index).to(torch.float32) for index in range(NUM_TENSORS)}
    storages = {
        "nvme": (FastPersistStorageWriter(o_direct_dir(tmp_path) / "dcp", io_buffer_mb=1),
                 FastPersistStorageReader(o_direct_dir(tmp_path) / "dcp")),
        "gs": (DatafluxStorageWriter(f"gs://{gcs_bucket}/dcp", max_workers=3),
               DatafluxStorageReader(f"gs://{gcs_bucket}/dcp", max_workers=3)),
    }
    for name, (writer, reader) in storages.items():
        loaded = {key: torch.zeros_like(value) for key, value in state.items()}
        with per_tensor_torch_calls() as calls:
            dcp.save(state, storage_writer=writer)
            dcp.load(loaded, storage_reader=reader)
        assert not calls, f"{name}, torch {torch.__version__}: per-tensor calls into torch {dict(calls)}"
        assert_same(loaded, state)


def test_gcs_checkpoint_io_loads_a_thousand_tensors_without_torchs_per_tensor_functions(
    tmp_path: Path, gcs_bucket: str
) -> None:
    _warm_up(o_direct_dir(tmp_path))
    state = thousand_tensors()
    reference = io.BytesIO()
    torch.save(state, reference)
    plugin = DatafluxCheckpointIO(max_workers=3)
    try:
        path = f"gs://{gcs_bucket}/fast/thousand.ckpt"
        with plugin.writer(path) as stream:
            stream.write(reference.getvalue())
        with per_tensor_torch_calls() as calls:
            loaded = plugin.load_checkpoint(path, weights_only=True)
        assert not calls, f"torch {torch.__version__}: per-tensor calls into torch {dict(calls)}"
        assert _torch_compat.load_difference(loaded, torch.load(io.BytesIO(reference.getvalue()),
                                                                weights_only=True)) is None
    finally:
        plugin.teardown()


# Made to behave otherwise, in a process of its own ------------------------------------------------------
_CHANGED = {
    # Rebuilt tensors carry an attribute torch's own did not give them.
    "torch._utils._rebuild_tensor_v2": """
        original = torch._utils._rebuild_tensor_v2
        def changed(*args, **kwargs):
            tensor = original(*args, **kwargs)
            tensor.rebuilt_by = "changed"
            return tensor
        changed.__module__, changed.__name__, changed.__qualname__ = "torch._utils", original.__name__, original.__name__
        torch._utils._rebuild_tensor_v2 = changed  # pickled by that name, as torch's own
    """,
    # Tensors reduce with a plain dict of hooks instead of an OrderedDict.
    "torch.Tensor._reduce_ex_internal": """
        original = torch.Tensor._reduce_ex_internal
        def changed(self, proto):
            rebuild, args = original(self, proto)
            return rebuild, (*args[:5], {}, *args[6:])
        torch.Tensor._reduce_ex_internal = changed
    """,
}
_CHECK = """
import io, json, logging, sys, zipfile
import torch
{change}
from fastpersist import fastpersist_load, fastpersist_save
from lightning_storage_plugins import _torch_compat
from tests.test_fast_paths import _pickle_of, thousand_tensors

records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("lightning_storage_plugins").addHandler(handler)
logging.getLogger("lightning_storage_plugins").setLevel(logging.DEBUG)
state = thousand_tensors()
path = sys.argv[1] + "/ckpt.pt"
fastpersist_save(state, path, engine="python")
reference = io.BytesIO()
torch.save(state, reference)
ours = fastpersist_load(path)
theirs = torch.load(io.BytesIO(reference.getvalue()), weights_only=True)
print(json.dumps({{
    "verdicts": _torch_compat.mirror_verdicts(),
    "debug": records,
    "same_pickle": _pickle_of(open(path, "rb").read()) == _pickle_of(reference.getvalue()),
    "difference": _torch_compat.load_difference(ours, theirs),
}}))
"""


@pytest.mark.parametrize("function", sorted(_CHANGED))
def test_a_mirrored_function_that_behaves_otherwise_turns_off_only_its_fast_path(function: str, tmp_path: Path) -> None:
    script = _CHECK.format(change=textwrap.dedent(_CHANGED[function]))
    run = subprocess.run([sys.executable, "-c", script, str(o_direct_dir(tmp_path))], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert [name for name, holds in found["verdicts"].items() if not holds] == [function]
    assert len(found["debug"]) == 1 and function in found["debug"][0], found["debug"]
    assert found["same_pickle"], "the file's pickle differs from torch.save's"
    assert found["difference"] is None, found["difference"]
