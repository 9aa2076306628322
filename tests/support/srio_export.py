"""torch.export programs for the worker tests: honest ones, and archives edited to attack the loader."""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from collections.abc import Callable

import torch

from smartredis_io._client import export_policy


class BatchRows(torch.nn.Module):
    """For every row, the number of rows in the batch the program saw (exportable with a dynamic batch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x[:, :1]) * x.shape[0]


def export_bytes(module: torch.nn.Module, example: torch.Tensor, dynamic_batch: bool = True) -> bytes:
    """``torch.export.save`` of ``module`` exported on ``example``, with a dynamic first dimension."""
    shapes = ({0: torch.export.Dim("batch", min=1, max=4096)},) if dynamic_batch else None
    program = torch.export.export(module.eval(), (example,), dynamic_shapes=shapes)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def legacy_export_bytes(module: torch.nn.Module, example: torch.Tensor) -> bytes:
    """The archive layout torch 2.6 writes (``serialized_exported_program.json`` and tensor pickles)."""
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch._export.serde.serialize import serialize

    shapes = ({0: torch.export.Dim("batch", min=1, max=4096)},)
    artifact = serialize(torch.export.export(module.eval(), (example,), dynamic_shapes=shapes))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("serialized_exported_program.json", artifact.exported_program)
        archive.writestr("serialized_state_dict.pt", artifact.state_dict)
        archive.writestr("serialized_constants.pt", artifact.constants)
        archive.writestr("serialized_example_inputs.pt", artifact.example_inputs)
        archive.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
    return buffer.getvalue()


def edit(blob: bytes, change: Callable[[dict[str, bytes]], None]) -> bytes:
    """``blob`` with its members (name -> bytes, names relative to the archive's root) changed in place."""
    source = zipfile.ZipFile(io.BytesIO(blob))
    root = export_policy.ExportArchive(blob, "m").root
    members = {name[len(root):]: source.read(name) for name in source.namelist()}
    change(members)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in members.items():
            archive.writestr(root + name, data)
    return out.getvalue()


def edit_program(blob: bytes, change: Callable[[dict], None]) -> bytes:
    """``blob`` with its program JSON changed in place (either layout)."""
    name = export_policy.PT2_MODEL if export_policy.ExportArchive(blob, "m").layout == "pt2" \
        else export_policy.LEGACY_PROGRAM

    def rewrite(members: dict[str, bytes]) -> None:
        program = json.loads(members[name])
        change(program)
        members[name] = json.dumps(program).encode()

    return edit(blob, rewrite)


class WritesAFile:
    """Pickled, it writes ``path`` when unpickled by a full unpickler (``weights_only=False``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('pwned')",)


def payload(path: str) -> bytes:
    """``torch.save`` of an object that writes ``path`` when loaded with ``weights_only=False``."""
    buffer = io.BytesIO()
    torch.save({"weight": WritesAFile(path)}, buffer, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    return buffer.getvalue()


def nodes(program: dict) -> list[dict]:
    return program["graph_module"]["graph"]["nodes"]


def first_expression(program: dict) -> dict:
    """The first ``as_expr`` value of the program's tensor sizes (a dynamic dimension)."""
    for value in program["graph_module"]["graph"]["tensor_values"].values():
        for size in value["sizes"]:
            if "as_expr" in size:
                return size["as_expr"]
    raise AssertionError("the program has no dynamic dimension")
