"""The snippets of the README's smartredis_io section run as written, each in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import ROOT

SECTION = ROOT / "docs" / "readme" / "redis.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", SECTION.read_text(), re.S)
EXPECTED = [["[0. 2. 4. 6.]"], ["trained to step 4", "trained to step 8"]]


def test_the_section_has_the_snippets_this_test_expects() -> None:
    assert len(SNIPPETS) == len(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_snippet_runs_as_written(index: int, tmp_path) -> None:
    result = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert [line for line in lines if line in EXPECTED[index]] == EXPECTED[index], result.stdout
