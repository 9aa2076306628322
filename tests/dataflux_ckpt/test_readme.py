"""The Python snippets of the GCS section of the README run as written."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from tests.support import ROOT

SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "readme" / "gcs.md").read_text(), re.S)
ON_THE_EMULATOR = textwrap.dedent(
    """
    from dataflux_ckpt import FakeGcsServer

    with FakeGcsServer() as gcs, gcs.activated():
        gcs.create_bucket("ckpts")
        exec(compile(SNIPPET, "snippet", "exec"), {"__name__": "__main__"})
    """
)


def _run(script: str) -> str:
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_there_are_three_snippets():
    assert len(SNIPPETS) == 3


@pytest.mark.slow
def test_quick_start_trains_and_resumes_from_gcs():
    assert "resumed and trained to step 6" in _run(SNIPPETS[0])


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 2])
def test_other_snippets_run_against_the_emulator(index):
    _run(f"SNIPPET = {SNIPPETS[index]!r}\n{ON_THE_EMULATOR}")
