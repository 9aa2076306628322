"""The smartredis_io Redis module's AddressSanitizer + UndefinedBehaviorSanitizer build, as the tests load it.

``make setup`` builds it (``python smartredis_io/redisai/build.py --sanitize``) into
``.tools/sanitize``. redis-server is not built with the sanitizers, so their runtimes are preloaded
into it; each server writes its reports into a directory of its own, which a test asserts empty.
Leak checks are off: redis-server exits without freeing what it holds.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import ROOT

SANITIZED_MODULE = ROOT / ".tools" / "sanitize" / "srio_redisai.so"
BUILD_HINT = "build it with `make module` (python smartredis_io/redisai/build.py --sanitize)"


def runtimes() -> list[str]:
    """The sanitizer runtimes the build links (libasan, libubsan), to preload into redis-server."""
    if not SANITIZED_MODULE.is_file():
        raise FileNotFoundError(f"{SANITIZED_MODULE} is missing: {BUILD_HINT}")
    ldd = subprocess.run(["ldd", str(SANITIZED_MODULE)], capture_output=True, text=True, check=True).stdout
    found = re.findall(r"^\s*(lib(?:asan|ubsan)\.so[.\d]*) => (\S+)", ldd, re.MULTILINE)
    if not any(name.startswith("libasan") for name, _ in found):
        raise RuntimeError(f"{SANITIZED_MODULE} links no AddressSanitizer runtime:\n{ldd}")
    return [path for _, path in found]


def sanitizer_env(log_dir: Path, max_allocation_mb: int | None = None) -> dict[str, str]:
    """The environment of a redis-server that loads the sanitized module and logs reports to ``log_dir``
    (``max_allocation_mb``: an allocation by the module above this is a report too)."""
    asan = ["detect_leaks=0", "abort_on_error=1", f"log_path={log_dir}/asan"]
    if max_allocation_mb:
        asan.append(f"max_allocation_size_mb={max_allocation_mb}")
    return {
        "LD_PRELOAD": " ".join(runtimes()),
        "ASAN_OPTIONS": ":".join(asan),
        "UBSAN_OPTIONS": f"print_stacktrace=1:halt_on_error=0:log_path={log_dir}/ubsan",
    }


def reports(log_dir: Path) -> list[str]:
    """What the sanitizers reported into ``log_dir``: one text per report file."""
    return [path.read_text(errors="replace") for path in sorted(log_dir.glob("*san.*"))]


@contextmanager
def sanitized(max_allocation_mb: int | None = None) -> Iterator[dict[str, Any]]:
    """Keyword arguments for ``RedisServer`` / ``RedisCluster`` loading the sanitized module; on exit
    (after the servers stopped) the sanitizers must have reported nothing."""
    with tempfile.TemporaryDirectory(prefix="srio-sanitizers-") as tmp:
        log_dir = Path(tmp)
        yield {"module": os.fspath(SANITIZED_MODULE), "env": sanitizer_env(log_dir, max_allocation_mb)}
        found = reports(log_dir)
        assert not found, "the sanitizers reported:\n" + "\n".join(found)
