"""The SmartSim-Scaling runner's model definitions import without its inference driver (no cycle)."""

from __future__ import annotations

import subprocess
import sys


def test_models_import_without_the_inference_driver() -> None:
    program = ("import sys, benchmarks.smartsim_scaling.models as models\n"
               "assert 'benchmarks.smartsim_scaling.inference' not in sys.modules\n"
               "import benchmarks.smartsim_scaling.inference as inference\n"
               "assert inference.NUM_CLASSES == models.NUM_CLASSES == 1000\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
