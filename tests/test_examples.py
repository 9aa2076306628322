"""The Trainer examples in examples/lightning run as a user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("gcs_checkpoints.py", "resumed from gs://example-ckpts/run1/last.ckpt, now at step 10"),
        ("nvme_checkpoints.py", "last.ckpt read by stock torch.load at step 6"),
        ("redis_online_inference.py", "model served from Redis"),
    ],
)
def test_example_runs(script: str, expected: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning" / script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert expected in result.stdout
    assert not list(tmp_path.iterdir()), "the example left files behind"
