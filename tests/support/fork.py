"""Run a check in a forked child, as Lightning's ``ddp_fork`` and ``ddp_notebook`` launchers run ranks."""

from __future__ import annotations

import faulthandler
import gc
import os
from collections.abc import Callable

import torch


def exit_code_in_fork(check: Callable[[], bool]) -> int:
    """Fork; the child runs ``check`` and exits 0 when it returns true, 2 when false, 1 when it raises
    (120 s without an answer dumps the child's stacks and exits it, so a hang fails the test instead
    of stopping the suite). Returns the child's exit code.

    The parent's garbage is collected before the fork: what earlier tests left (DeepSpeed handles
    among it) is destroyed in the process whose threads it joins, not in the child."""
    gc.collect()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        faulthandler.dump_traceback_later(120, exit=True)
        code = 1
        try:
            torch.set_num_threads(1)  # torch's OpenMP threads did not survive the fork; as in DataLoader workers
            code = 0 if check() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
