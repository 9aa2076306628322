"""The README's Python snippets run as written, from a wheel installed outside the checkout.

A user copies a snippet into a file and runs it with the package installed from PyPI. So: build the
wheel, install it with ``pip install --target`` into a temporary directory, and run every ``python``
block of the README in a fresh interpreter whose working directory is outside the checkout. A block
preceded by ``<!-- not run: REASON -->`` is skipped (e.g. one that needs real GCS credentials).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
FENCE = re.compile(r"^```python\s*$")


def readme_snippets() -> list[tuple[str, str, str | None]]:
    """``(id, code, reason_not_run)`` for each ```python block of the README, in order."""
    lines = (ROOT / "README.md").read_text().splitlines()
    snippets: list[tuple[str, str, str | None]] = []
    index = 0
    while index < len(lines):
        if FENCE.match(lines[index]):
            previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
            skip = NOT_RUN.search(previous)
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            snippets.append((f"line{index + 1}", "\n".join(lines[index + 1 : end]) + "\n",
                             skip.group("reason") if skip else None))
            index = end
        index += 1
    return snippets


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project built as a wheel and installed (without dependencies) into a fresh directory."""
    work = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = work.glob("lightning_storage_plugins-*.whl")
    site = work / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return site


def _run(code: str, site: Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_wheel_ships_only_the_plugins_and_their_support(installed_wheel: Path) -> None:
    top_level = sorted(p.name for p in installed_wheel.iterdir() if not p.name.endswith(".dist-info"))
    assert top_level == ["dataflux_ckpt", "fastpersist", "lightning_storage_plugins", "smartredis_io"]


def test_wheel_is_what_the_snippets_import(installed_wheel: Path, tmp_path: Path) -> None:
    done = _run("import dataflux_ckpt, fastpersist, smartredis_io, lightning_storage_plugins as l\n"
                "for m in (dataflux_ckpt, fastpersist, smartredis_io, l): print(m.__file__)", installed_wheel, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(line.startswith(str(installed_wheel)) for line in done.stdout.split())


@pytest.mark.slow
@pytest.mark.parametrize(("name", "code", "reason"), readme_snippets(), ids=[s[0] for s in readme_snippets()])
def test_readme_snippet_runs_as_written(name: str, code: str, reason: str | None, installed_wheel: Path,
                                        tmp_path: Path) -> None:
    if reason:
        pytest.skip(reason)
    done = _run(code, installed_wheel, tmp_path)
    assert done.returncode == 0, f"README snippet at {name} failed:\n{done.stderr[-4000:]}"
