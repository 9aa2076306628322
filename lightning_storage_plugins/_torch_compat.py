"""The one place lightning_storage_plugins touches torch's private names.

torch.distributed.checkpoint keeps the per-item storage record of its file-system format private
(``filesystem._StorageInfo``), yet every DCP storage that torch's readers and planners can read back
stores exactly that record. Each private name reached here is listed in ``PRIVATE_APIS``, and
``tests/lightning_storage_plugins/test_torch_compat.py`` checks every one against the installed torch,
so that a torch release that renames or reshapes one fails there, loudly and by name.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import filesystem as _dcp_filesystem

__all__ = ["PRIVATE_APIS", "StorageInfo"]

# (object, attribute) pairs this module touches; the test suite asserts each exists.
PRIVATE_APIS: tuple[tuple[Any, str], ...] = (
    (_dcp_filesystem, "_StorageInfo"),
)

# The storage record torch's FileSystemReader expects for every item: ``(relative_path, offset, length)``,
# the first three fields, in that order (newer torch adds optional fields after them).
StorageInfo = _dcp_filesystem._StorageInfo
