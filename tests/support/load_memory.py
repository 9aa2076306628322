"""How much memory a checkpoint load holds at its peak, measured in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Mapping

_SCRIPT = """
import json, sys
import torch
{make_plugin}

def rss_kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak resident size starts again from the current one
before = rss_kib("VmRSS")
loaded = plugin.load_checkpoint(sys.argv[1])
peak = rss_kib("VmHWM")
total = sum(t.numel() * t.element_size() for t in loaded.values())
plugin.teardown()
print(json.dumps({{"extra": (peak - before) * 1024, "bytes": total}}))
"""


def load_peak(make_plugin: str, path: str, env: Mapping[str, str] | None = None) -> dict[str, int]:
    """Load the checkpoint at ``path`` (a dict of tensors) in a new interpreter with the plugin that
    the code ``make_plugin`` assigns to ``plugin``; returns the peak resident memory the load added
    (``extra``) and the tensors' bytes (``bytes``)."""
    script = _SCRIPT.format(make_plugin=textwrap.dedent(make_plugin))
    done = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=300,
                          env=None if env is None else dict(env))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
