"""What the plugins tell users: warnings once per process on rank zero, plain text in every error."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_storage_plugins.messages import plain_text, warn_once
from tests.support import ROOT

FALLBACK = "fastpersist engine 'gds' unavailable"


def test_plain_text_removes_escape_sequences_and_keeps_the_words() -> None:
    coloured = "do \x1b[1mthose steps\x1b[0m only\x1b]0;title\x07 \x1b[38;5;196mred\x1b[m.\n\tnext\x00"
    assert plain_text(coloured) == "do those steps only red.\n\tnext"


def test_a_warning_is_logged_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.warn_once")
    with caplog.at_level(logging.DEBUG, logger="tests.warn_once"):
        for _ in range(3):
            warn_once(logger, "disk %s is slow", "sda")
        warn_once(logger, "disk %s is slow", "sdb")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "disk sda is slow"), (logging.WARNING, "disk sdb is slow")]


@pytest.mark.slow
def test_under_two_process_ddp_a_warning_shows_once_and_only_on_rank_zero(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "ddp_warnings.py"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()
    logs = {rank: (tmp_path / f"rank{rank}.log").read_text().splitlines() for rank in (0, 1)}
    assert [line for line in logs[0] if line.startswith("WARNING")] == [
        line for line in logs[0] if line.startswith(f"WARNING {FALLBACK}")]
    assert len([line for line in logs[0] if line.startswith(f"WARNING {FALLBACK}")]) == 1, logs[0]
    assert not [line for line in logs[1] if line.startswith("WARNING")], logs[1]
    assert len([line for line in logs[1] if line.startswith(f"DEBUG {FALLBACK}")]) == 1, logs[1]
    assert run.stderr.count(FALLBACK) <= 1
