"""``python -m smartredis_io.smartsim_setup DIR`` lays out SmartSim's dependencies safely: DIR must be the
user's own and not writable by others; every file is written under a name no one can predict and never
through a link an attacker planted; files the command did not write are left alone unless ``--force``;
and any interpreter path, whatever its characters, reaches the module unchanged through the script."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smartredis_io.launchers.smartsim_setup import MARKER_TEXT, UnsafeLayoutError, lay_out

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")


def _echo_server(tmp_path: Path) -> str:
    """A stand-in for redis-server that prints the interpreter the module would be given."""
    script = tmp_path / "echo-server"
    script.write_text('#!/bin/sh\nprintf "%s" "$SRIO_WORKER_PYTHON"\n')
    script.chmod(0o755)
    return str(script)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_text("not to be touched\n")
    victim.chmod(0o600)
    return victim


def _untouched(victim: Path) -> bool:
    return victim.read_text() == "not to be touched\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_links_planted_at_the_temporary_names_are_not_followed(tmp_path: Path) -> None:
    """The names the command used to write through (``.NAME.<pid>.tmp``) hold links to another file: it
    stays as it was, and the layout is written."""
    victim = _victim(tmp_path)
    deps = tmp_path / "deps"
    for directory in (deps / "bin", deps / "lib" / "backends" / "redisai_torch"):
        directory.mkdir(parents=True)
    for name in ("bin/redis-server", "bin/redis-cli", "lib/redisai.so", "lib/backends/redisai_torch/redisai_torch.so"):
        path = deps / name
        for pid in range(os.getpid() - 50, os.getpid() + 200):
            path.with_name(f".{path.name}.{pid}.tmp").symlink_to(victim)
    layout = lay_out(deps)
    assert _untouched(victim)
    assert layout.redis_server.read_text().startswith("#!/bin/sh\n# Written by python -m smartredis_io.smartsim_setup")
    assert stat.S_IMODE(layout.redis_server.stat().st_mode) == 0o755
    assert layout.torch_backend.read_text() == MARKER_TEXT


def test_a_link_in_the_place_of_a_file_is_refused_then_replaced_not_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    deps = tmp_path / "deps"
    (deps / "bin").mkdir(parents=True)
    (deps / "bin" / "redis-server").symlink_to(victim)
    with pytest.raises(UnsafeLayoutError, match="redis-server"):
        lay_out(deps)
    layout = lay_out(deps, force=True)
    assert _untouched(victim) and not layout.redis_server.is_symlink()


def test_files_it_did_not_write_are_left_alone_unless_forced(tmp_path: Path) -> None:
    """``smart build``'s own binaries where the command writes: refused, named, kept; --force replaces them."""
    deps = tmp_path / "deps"
    (deps / "bin").mkdir(parents=True)
    (deps / "lib").mkdir()
    (deps / "bin" / "redis-server").write_bytes(b"\x7fELF a real redis-server")
    (deps / "lib" / "redisai.so").write_bytes(b"\x7fELF RedisAI")
    result = subprocess.run([sys.executable, "-m", "smartredis_io.smartsim_setup", str(deps)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "bin/redis-server" in result.stderr and "lib/redisai.so" in result.stderr and "--force" in result.stderr
    assert (deps / "bin" / "redis-server").read_bytes() == b"\x7fELF a real redis-server"
    assert not (deps / "bin" / "redis-cli").exists(), "nothing is written when anything is refused"
    result = subprocess.run([sys.executable, "-m", "smartredis_io.smartsim_setup", str(deps), "--force"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (deps / "lib" / "redisai.so").is_symlink()
    assert lay_out(deps).root == deps, "its own files are replaced without --force"


def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    deps = tmp_path / "deps"
    deps.mkdir()
    deps.chmod(0o777)
    with pytest.raises(UnsafeLayoutError, match=r"may be written by any user \(mode 0777\)"):
        lay_out(deps)
    deps.chmod(0o755)
    (deps / "bin").mkdir(mode=0o755)
    (deps / "bin").chmod(0o1777)
    with pytest.raises(UnsafeLayoutError, match="bin may be written by any user"):
        lay_out(deps)
    assert not (deps / "bin" / "redis-server").exists()


@needs_root
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    deps = tmp_path / "deps"
    deps.mkdir()
    os.chown(deps, 65534, 65534)
    with pytest.raises(UnsafeLayoutError, match="belongs to uid 65534"):
        lay_out(deps)
    assert not any(deps.iterdir())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40)
       .filter(lambda n: "/" not in n and "\x00" not in n))
def test_any_interpreter_path_reaches_the_module_unchanged(name: str, tmp_path: Path) -> None:
    """Quotes, ``$``, backquotes, ``}`` and spaces in --python cannot break the script."""
    python = f"/opt/{name}/bin/python3"
    layout = lay_out(tmp_path / "deps", python=python, redis_server=_echo_server(tmp_path))
    env = {key: value for key, value in os.environ.items() if key != "SRIO_WORKER_PYTHON"}
    result = subprocess.run([layout.redis_server], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert result.stdout == python


@pytest.mark.parametrize("python, why", [("/opt/py\nthon", "control character"), ("python3", "absolute path")])
def test_an_interpreter_the_module_cannot_take_is_refused(python: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=why):
        lay_out(tmp_path / "deps", python=python)
