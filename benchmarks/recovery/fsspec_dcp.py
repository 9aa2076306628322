"""The baseline for sharded checkpoints in GCS: torch DCP's own fsspec writer and reader, over gcsfs.

Lightning's FSDP and ModelParallel strategies save sharded checkpoints into local directories only. A
user who keeps them in GCS without our plugins writes them with DCP's ``FsspecWriter`` through gcsfs, as
the published Dataflux package's multinode Lightning demo does (its ``FSSpecFSDPStrategy``). The
recovery job's ``torch-dcp-gcsfs`` rows run that writer and reader through the same Lightning glue as
the plugins' sharded rows (:mod:`lightning_storage_plugins.sharded`), so that the sharded rows in GCS
differ in their storage only.

DCP's writer is taken as it is: a save it does not finish leaves what it wrote, and a save over an
existing checkpoint replaces its objects one by one (``.metadata`` last).
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import FsspecReader, FsspecWriter

# The object that makes a DCP checkpoint directory a checkpoint (DCP writes it last).
METADATA_NAME = ".metadata"


class FsspecCheckpointWriter(FsspecWriter):
    """DCP's ``FsspecWriter``, with what the Lightning glue asks of a writer besides DCP's protocol."""

    def abort(self) -> None:
        """Nothing: DCP's writer leaves what a failed save wrote."""

    def remove(self) -> None:
        """Delete the whole checkpoint (every object under its path)."""
        self.fs.fs.rm(os.fspath(self.path), recursive=True)


class FsspecCheckpointReader(FsspecReader):
    """DCP's ``FsspecReader``, with what the Lightning glue asks of a reader besides DCP's protocol."""

    def exists(self) -> bool:
        """Whether a whole DCP checkpoint is at the path (its ``.metadata`` is there)."""
        filesystem = self.fs.fs
        filesystem.invalidate_cache(os.fspath(self.path))  # gcsfs caches listings across instances
        return bool(self.fs.exists(self.fs.concat_path(self.path, METADATA_NAME)))


class FsspecShardedStorage:
    """For a strategy with :class:`~lightning_storage_plugins.sharded.ShardedFSDPMixin` or
    :class:`~lightning_storage_plugins.sharded.ShardedModelParallelMixin`: DCP's fsspec writer and reader
    (``writer_options`` go to ``FsspecWriter``; ``sync_files=False`` unless given, as gcsfs files cannot
    be synced)."""

    writer_options: dict[str, Any]

    def storage_writer(self, path: str) -> FsspecCheckpointWriter:
        """DCP's fsspec writer for ``path``."""
        return FsspecCheckpointWriter(path, **{"sync_files": False, **self.writer_options})

    def storage_reader(self, path: str, weights_only: bool | None = None) -> FsspecCheckpointReader:
        """DCP's fsspec reader for ``path`` (``weights_only`` applies to the Lightning state the glue
        unpickles itself; DCP reads its own items as it does)."""
        return FsspecCheckpointReader(path)


def newest_checkpoint(directory: str, names: list[str]) -> str | None:
    """The newest of the DCP checkpoints ``names`` in ``directory`` whose ``.metadata`` is there, dated
    by that object; ``None`` when there is none.

    Lightning's ``ckpt_path="last"`` dates its candidates by their own modification time, and gcsfs gives
    an object prefix none (``KeyError: 'mtime'``): a user of DCP's writer in GCS resumes from the path
    this finds.
    """
    from fsspec.core import url_to_fs

    filesystem, root = url_to_fs(directory)
    filesystem.invalidate_cache(root)
    dated = {}
    for name in names:
        metadata = f"{root}/{name}/{METADATA_NAME}"
        if filesystem.exists(metadata):
            dated[name] = filesystem.modified(metadata)
    if not dated:
        return None
    return f"{directory}/{max(dated, key=dated.__getitem__)}"
