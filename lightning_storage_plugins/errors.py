"""Errors the storage plugins share, so that code catching one catches it from every plugin.

Each is picklable with its arguments (torch.distributed.checkpoint sends a rank's error to the others).
"""

from __future__ import annotations

__all__ = ["CheckpointExistsError", "CheckpointMetadataError", "ConcurrentWriteError", "InvalidCheckpointError"]


class ConcurrentWriteError(OSError):
    """Another writer saved (or is saving) to the same checkpoint; this save published nothing.

    ``dataflux_ckpt.ConcurrentWriteError`` is a subclass.

    Attributes:
        target: the checkpoint (path or ``gs://`` prefix) both wrote to, when known.
    """

    def __init__(self, *args: object, target: str | None = None) -> None:
        super().__init__(*args)
        self.target = target


class CheckpointExistsError(FileExistsError, RuntimeError):
    """A save with ``overwrite=False`` found a checkpoint at its path.

    A ``FileExistsError`` and, as torch's ``FileSystemWriter`` raises in this case, a ``RuntimeError``.
    """


class CheckpointMetadataError(ValueError):
    """A checkpoint's metadata names something a reader must not read, or holds an impossible value:
    a file outside the checkpoint (an absolute path, ``..``), a file that is not a regular file (a
    FIFO, a device, a link), or a crc32c block size that is not positive."""


class InvalidCheckpointError(ValueError):
    """Stored bytes are not a checkpoint that loads: empty, truncated, not torch's format, or refused by
    torch as damaged. The message names the checkpoint (object, key or path) and what is wrong.

    ``dataflux_ckpt.InvalidCheckpointError`` is a subclass; ``smartredis_io`` raises this class itself.
    """
