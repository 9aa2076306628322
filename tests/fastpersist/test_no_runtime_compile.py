"""No import and no save compiles DeepSpeed's ops: not in a second environment, not in one venv
reached through a symlink. torch's JIT cache is keyed by Python and CUDA version only, so either used
to rewrite its build.ninja and stall the next save for minutes."""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fastpersist import _deepspeed_compat
from fastpersist.aio import aio_unavailable_reason
from tests.support.direct_io import o_direct_dir

# Two saves and a load with engine "aio", each save through a context of its own; prints the engines.
SAVE_SCRIPT = """
import logging, sys
import torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
from fastpersist import fastpersist_load, fastpersist_save
engines = [fastpersist_save({"w": torch.arange(5000)}, sys.argv[1], engine="aio").engine for _ in range(2)]
assert torch.equal(fastpersist_load(sys.argv[1], engine="aio")["w"], torch.arange(5000))
print("engines", *engines)
"""
# A compile takes minutes; importing torch and DeepSpeed and saving take seconds.
DEADLINE_S = 120


def _run_save(python: Path, checkpoint: Path, extensions: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(extensions),  # where a JIT compile would write its build.ninja
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    child = subprocess.Popen(
        [str(python), "-c", SAVE_SCRIPT, str(checkpoint)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a compiler it started goes down with it
    )
    try:
        out, err = child.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        written = sorted(str(p.relative_to(extensions)) for p in extensions.rglob("*"))
        pytest.fail(f"{python}: a save took over {DEADLINE_S} s (compiling? it wrote {written})")
    assert child.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def _second_environment(root: Path) -> Path:
    """A new venv of the same base interpreter that sees this one's packages (not its prebuilt ops)."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True, timeout=DEADLINE_S)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    shared = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    # As site directories, so that their own .pth files run too (setuptools' distutils for DeepSpeed
    # on Python 3.12, where the standard library has none).
    lines = [f"import site; site.addsitedir({path!r})" for path in dict.fromkeys(shared)]
    Path(purelib, "shared_packages.pth").write_text("\n".join(lines) + "\n")
    return python


def test_environments_and_a_symlinked_venv_save_in_turn_without_compiling(tmp_path: Path) -> None:
    if aio_unavailable_reason() is not None:
        pytest.skip(f"this environment has no prebuilt async_io op: {aio_unavailable_reason()}")
    if sys.prefix == sys.base_prefix:
        pytest.skip("runs from a virtual environment only (it links to one and builds a second)")
    work = o_direct_dir(tmp_path)
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    (tmp_path / "linked").symlink_to(sys.prefix, target_is_directory=True)
    this = Path(sys.prefix, os.path.relpath(sys.executable, sys.prefix))
    through_link = tmp_path / "linked" / this.relative_to(sys.prefix)
    second = _second_environment(tmp_path / "second")

    for name, python in [("this", this), ("second", second), ("link", through_link), ("this again", this)]:
        done = _run_save(python, work / "ckpt.pt", extensions)
        output = done.stdout + done.stderr
        assert not list(extensions.rglob("*")), (
            f"{name}: something was compiled: {list(extensions.rglob('*'))}"
        )
        assert "ninja" not in output.lower(), f"{name}: {output[-2000:]}"
        warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING fastpersist")]
        if name == "second":
            # No prebuilt op in that environment: one plain warning saying how to build it, python engine.
            assert "engines python python" in done.stdout, output[-2000:]
            assert len(warnings) == 1, warnings
            assert "not built for this environment" in warnings[0]
            assert _deepspeed_compat.BUILD_COMMAND in warnings[0]
        else:
            assert "engines aio aio" in done.stdout, output[-2000:]
            assert not warnings, warnings
