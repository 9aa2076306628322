"""A save held in its middle, in a process of its own, for tests that kill it there (or keep it running).

    python -m tests.support.held_save gs URL gs://bucket/run/last.ckpt
    python -m tests.support.held_save dcp URL gs://bucket/run/step-4
    python -m tests.support.held_save nvme /mnt/run/last.ckpt

Each starts a real save through the plugin's public API, lets part of it reach the storage, prints
``holding`` once it has, and then waits, in the middle of the save, until it is killed:

* ``gs``: a ``DatafluxCheckpointIO`` writer in composite mode, three parts written (uploaded by its
  threads as they fill), the object not published;
* ``dcp``: ``dcp.save`` through ``DatafluxStorageWriter``, its save lock taken and the first item's
  parts written, the save held while the planner resolves the second item;
* ``nvme``: ``FastPersistCheckpointIO.save_checkpoint``, a 16 MiB tensor written into the save's
  temporary file, held while the next object of the checkpoint is pickled.

The caller waits for what the save has written (part objects, the temporary file) before it kills.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dataflux_ckpt.emulator import activated, configure_gcsfs_for_emulator

configure_gcsfs_for_emulator()  # before anything imports gcsfs

PART_BYTES = 256 * 1024


def _hold() -> None:
    print("holding", flush=True)
    threading.Event().wait()


class Hold:
    """Pickling it holds the save that pickles it."""

    def __reduce__(self) -> Any:
        _hold()
        raise AssertionError("unreachable")


def _gcs_save(url: str, path: str) -> None:
    from dataflux_ckpt import DatafluxCheckpointIO

    with activated(url):
        plugin = DatafluxCheckpointIO(chunk_size=PART_BYTES, max_workers=2, upload_mode="composite")
        writer = plugin.writer(path)
        writer.write(b"p" * (3 * PART_BYTES + 1))  # three whole parts go up; the fourth is still open
        _hold()


def _dcp_save(url: str, path: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dataflux_ckpt import DatafluxStorageWriter

    class HoldingPlanner(DefaultSavePlanner):
        """Resolves the first item, then holds the save at the second."""

        resolved = 0

        def resolve_data(self, write_item: Any) -> Any:
            self.resolved += 1
            if self.resolved > 1:
                _hold()
            return super().resolve_data(write_item)

    with activated(url):
        state = {"a": torch.ones(4 * PART_BYTES // 4), "b": torch.zeros(4)}
        dcp.save(state, storage_writer=DatafluxStorageWriter(path, chunk_size=PART_BYTES, max_workers=2,
                                                             upload_mode="composite"),
                 planner=HoldingPlanner())


def _nvme_save(path: str) -> None:
    import torch

    from fastpersist import FastPersistCheckpointIO

    plugin = FastPersistCheckpointIO(io_buffer_mb=4)
    plugin.save_checkpoint({"w": torch.ones(4 * 2**20), "hold": Hold()}, path)


@contextmanager
def held_save(kind: str, *args: str, prefix: Sequence[str] = (),
              env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A child process holding a save in its middle (``kind`` and ``args`` as for this module's
    command), killed with SIGKILL on exit if it still runs.

    ``prefix`` runs it under another command (``unshare ...``); ``env`` adds to its environment.
    """
    child = subprocess.Popen([*prefix, sys.executable, "-m", __name__, kind, *args], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, **(env or {})})
    try:
        assert child.stdout is not None
        while (line := child.stdout.readline()) and line.strip() != "holding":
            pass  # what the libraries print on import
        assert line, f"the child exited ({child.wait(30)}) before the middle of its save"
        yield child
    finally:
        child.kill()
        child.wait(30)


def main() -> None:
    kind, *args = sys.argv[1:]
    {"gs": _gcs_save, "dcp": _dcp_save, "nvme": _nvme_save}[kind](*args)
    raise SystemExit("the held save ended")


if __name__ == "__main__":
    main()
