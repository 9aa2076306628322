"""The one place that touches Lightning's private names.

Lightning keeps these private, so a release may rename or drop them. Each is reached through a
function here, and ``tests/lightning_storage_plugins/test_lightning_compat.py`` checks every one
against the installed Lightning, so that a dependency change fails there, loudly and by name,
rather than deep inside a training run.
"""

from __future__ import annotations

import os
import types
from contextlib import AbstractContextManager
from typing import Any

__all__ = [
    "LAUNCHER_HANDBACK_NAME",
    "checkpoint_directory",
    "fsdp_state_dict_type",
    "is_launcher_handback_path",
    "saves_distributed_checkpoint",
    "sharded_state_dict_context",
]

# The file name through which Lightning's launchers hand rank 0's weights back to the main process:
# ``_MultiProcessingLauncher`` (``ddp_spawn``) saves ``<tempfile.mkdtemp()>/.temp.ckpt`` with the
# strategy's CheckpointIO and loads it in the main process; ``_XLALauncher`` saves
# ``<default_root_dir>/.temp.ckpt``.
LAUNCHER_HANDBACK_NAME = ".temp.ckpt"


def _private(obj: Any, name: str) -> Any:
    """``obj.name``, or an error naming the Lightning release that lacks it."""
    try:
        return getattr(obj, name)
    except AttributeError:
        import lightning

        if isinstance(obj, types.ModuleType):
            owner = obj.__name__
        else:
            cls = obj if isinstance(obj, type) else type(obj)
            owner = f"{cls.__module__}.{cls.__qualname__}"
        raise RuntimeError(
            f"Lightning {lightning.__version__} has no {owner}.{name}, which "
            "lightning_storage_plugins relies on; install a Lightning release this package supports"
        ) from None


def is_launcher_handback_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a local file through which a Lightning launcher hands weights back."""
    text = os.fspath(path)
    return isinstance(text, str) and "://" not in text and os.path.basename(text) == LAUNCHER_HANDBACK_NAME


def sharded_state_dict_context(module: Any) -> AbstractContextManager[Any]:
    """The FSDP context in which ``module.state_dict()`` gives sharded tensors (Lightning's own)."""
    from lightning.fabric.strategies import fsdp

    return _private(fsdp, "_get_sharded_state_dict_context")(module)


def fsdp_state_dict_type(strategy: Any) -> str:
    """The ``state_dict_type`` an ``FSDPStrategy`` was made with (``"full"`` or ``"sharded"``)."""
    return _private(strategy, "_state_dict_type")


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a ``ModelParallelStrategy`` was made with ``save_distributed_checkpoint=True``."""
    return bool(_private(strategy, "_save_distributed_checkpoint"))


def checkpoint_directory(callback: Any, trainer: Any) -> str:
    """The directory a ``ModelCheckpoint`` saves in for ``trainer``, as Lightning resolves it in the
    callback's ``setup``: its ``dirpath``, else ``<save_dir>/<name>/<version>/checkpoints`` of the
    first logger (``default_root_dir`` for a logger without a ``save_dir``), else
    ``<default_root_dir>/checkpoints``. Known before ``setup`` too (Lightning finds the checkpoint of
    ``ckpt_path="last"`` before it)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return str(_private(callback, f"_{ModelCheckpoint.__name__}__resolve_ckpt_dir")(trainer))
