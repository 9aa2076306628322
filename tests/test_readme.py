"""The README's and the documents' Python snippets run as written, from a wheel installed outside the
checkout, and their relative links lead somewhere.

A user copies a snippet into a file and runs it with the package installed from PyPI. So: build the
wheel, install it with ``pip install --target`` into a temporary directory, and run every ``python``
block of ``README.md`` and ``docs/*.md`` in a fresh interpreter whose working directory is outside the
checkout and whose environment has none of the settings a test session may have left (emulator host,
Redis address and credentials). A block preceded by ``<!-- not run: REASON -->`` is skipped (one that
needs real GCS credentials or a GPU; each is paired with a block that runs anywhere).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.support import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
FENCE = re.compile(r"^```python\s*$")
# Settings a user's fresh shell does not have, but a test session (or its fixtures) may have set.
SESSION_ONLY = re.compile(r"^(STORAGE_EMULATOR_HOST|GCSFS_.*|SSDB|SSKEYIN|SSKEYOUT|SR_.*|PYTHONPATH)$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)|!\[[^\]]*\]\((?P<image>[^)\s]+)\)")


class Snippet(NamedTuple):
    name: str  # document:line
    code: str
    reason_not_run: str | None


def snippets(document: Path) -> list[Snippet]:
    """Each ```python block of ``document``, in order."""
    lines = document.read_text().splitlines()
    found: list[Snippet] = []
    index = 0
    while index < len(lines):
        if FENCE.match(lines[index]):
            previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
            skip = NOT_RUN.search(previous)
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            found.append(Snippet(f"{document.relative_to(ROOT)}:{index + 1}", "\n".join(lines[index + 1 : end]) + "\n",
                                 skip.group("reason") if skip else None))
            index = end
        index += 1
    return found


SNIPPETS = [snippet for document in DOCUMENTS for snippet in snippets(document)]


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(document: Path) -> set[str]:
    """The anchors of ``document``'s headings (outside code blocks), numbered as GitHub numbers repeats."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    in_code = False
    for line in document.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"^#{1,6}\s+(.*)$", line)):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(document: Path) -> list[str]:
    """The relative link and image targets of ``document`` (outside code blocks)."""
    targets: list[str] = []
    in_code = False
    for line in document.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match.group("target") or match.group("image")
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # not https:, mailto:, ...
                targets.append(target)
    return targets


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: str(d.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings_that_exist(document: Path) -> None:
    broken = []
    for target in links(document):
        path, _, anchor = target.partition("#")
        destination = (document.parent / path).resolve() if path else document
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.name}")
    assert not broken, f"{document.name}: " + "; ".join(broken)


def test_every_document_has_the_snippets_a_user_runs() -> None:
    ran = {snippet.name.split(":")[0] for snippet in SNIPPETS if snippet.reason_not_run is None}
    assert ran == {"README.md", "docs/gcs.md", "docs/fastpersist.md", "docs/smartredis.md", "docs/sharded.md"}
    # No image a document shows is missing (the charts are committed files under docs/img).
    for document in DOCUMENTS:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", document.read_text()):
            assert (document.parent / target).exists(), f"{document.name} shows a missing image {target}"


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
    env = {key: value for key, value in os.environ.items() if not SESSION_ONLY.match(key)}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_wheel_ships_only_the_plugins_and_their_support(installed_wheel: Path) -> None:
    top_level = sorted(p.name for p in installed_wheel.iterdir() if not p.name.endswith(".dist-info"))
    assert top_level == ["dataflux_ckpt", "fastpersist", "lightning_storage_plugins", "smartredis_io"]


def test_nothing_the_wheel_installs_names_the_checkout(installed_wheel: Path) -> None:
    """Installed code never refers to the source checkout: no file of the wheel holds its path."""
    naming = [str(path.relative_to(installed_wheel)) for path in installed_wheel.rglob("*")
              if path.is_file() and ".dist-info" not in path.parts and str(ROOT).encode() in path.read_bytes()]
    assert naming == []


def test_wheel_is_what_the_snippets_import(installed_wheel: Path, tmp_path: Path) -> None:
    done = _run("import dataflux_ckpt, fastpersist, smartredis_io, lightning_storage_plugins as l\n"
                "for m in (dataflux_ckpt, fastpersist, smartredis_io, l): print(m.__file__)", installed_wheel, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(line.startswith(str(installed_wheel)) for line in done.stdout.split())


# What snippets print where the output is the point: a print call in a snippet -> lines it must print.
EXPECTED_OUTPUT = {
    'print("resumed and trained to step", resumed.global_step)': ["resumed and trained to step 6"],
    'print(DatafluxCheckpointIO().list_checkpoints("gs://ckpts/"))': ["['gs://ckpts/state.pt']"],
    'print(client.get_tensor("y"))': ["[0. 2. 4. 6.]"],
    '        print("trained to step", trainer.global_step)': ["trained to step 4", "trained to step 8"],
    '\nprint("trained to step", trainer.global_step)': ["trained to step 64"],
    'print(f"rank {trainer.global_rank} trained to step {trainer.global_step}")': ["rank 0 trained to step 8"],
    'print(client.get_tensor("y").shape)': ["(3, 2)"],
    'print(client.get_tensor("x"))': ["[0. 1. 2. 3.]"],
    'print(client.key_exists("run1/last.ckpt"), client.model_exists("boring"))': ["True True"],
    'print(client.get_tensor("scores").shape)': ["(5, 2)"],
    'print(analysis.get_tensor("field").sum())': ["15.0"],
}


def test_every_expected_output_belongs_to_a_snippet_that_runs() -> None:
    running = [snippet.code for snippet in SNIPPETS if snippet.reason_not_run is None]
    assert all(any(call in code for code in running) for call in EXPECTED_OUTPUT)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[snippet.name for snippet in SNIPPETS])
def test_snippet_runs_as_written(snippet: Snippet, installed_wheel: Path, tmp_path: Path) -> None:
    if snippet.reason_not_run:
        pytest.skip(snippet.reason_not_run)
    done = _run(snippet.code, installed_wheel, tmp_path)
    assert done.returncode == 0, f"{snippet.name} failed:\n{done.stderr[-4000:]}"
    printed = [line.strip() for line in done.stdout.splitlines()]
    expected = [line for call, lines in EXPECTED_OUTPUT.items() if call in snippet.code for line in lines]
    assert [line for line in printed if line in expected] == expected, f"{snippet.name} printed:\n{done.stdout}"
