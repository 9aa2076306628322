"""Concurrent saves to one checkpoint, in every way users call DCP, on every storage.

Two jobs, real processes released together by one barrier, save to one path round after round (see
:mod:`tests.support.dcp_race`): as plain scripts (no process group), through ``dcp.async_save``, and
as two-rank gloo groups; on NVMe, on gs:// through the emulator as users start it (JSON API), and
through the XML multipart server. Every round must end in one whole checkpoint of a save that
reported success; the other save fails with ``ConcurrentWriteError`` and leaves nothing behind.

Each race runs 30 rounds; the nine races take about a minute on 2 cores (processes fork from one
server that imported torch once). ``python -m tests.support.dcp_race`` runs them from a shell.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.dcp_race import MODES, STORAGES, Stack, race

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that this process has no group

ROUNDS = 30
# Parts of 1 KiB: each shard (a few KiB) goes up in several parts (part objects and a compose on the
# JSON API, XML multipart parts behind the XML server), whose clean-up is checked every round.
CHUNK_SIZE = 1024


@pytest.fixture
def stack(request: pytest.FixtureRequest, gs_root: str, gcs_bucket: str, nvme_root: Path, gcs_emulator: Any,
          gcs_xml_server: Any) -> Stack:
    storage = request.param
    if storage == "nvme":
        return Stack("nvme", str(nvme_root))
    front = gcs_xml_server if storage == "gs-xml" else gcs_emulator
    return Stack(storage, gs_root, front.url, gcs_bucket)


@pytest.mark.parametrize("stack", STORAGES, indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_two_saves_to_one_checkpoint_leave_one_whole_checkpoint(mode: str, stack: Stack) -> None:
    tally = race(mode, stack, ROUNDS, chunk_size=CHUNK_SIZE)
    assert tally.problems == [], f"{len(tally.problems)} problems in {ROUNDS} rounds:\n" + "\n".join(tally.problems)
    assert tally.whole == ROUNDS
    assert tally.lost > 0, "the saves never overlapped: the test raced nothing"
