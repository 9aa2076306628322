"""The Redis module supervises its execution workers as a service manager would, on real redis-servers
started as a user starts them: a clean environment (``PATH=/usr/bin:/bin``, no virtual environment, no
PYTHONPATH) and ``--loadmodule`` with no launcher of ours.

- The workers run in the Python installation that holds the module: the source checkout's (the
  interpreter its in-place build recorded), an installed wheel's, and that of a copy of the module
  in another directory; a TorchScript model runs on each.
- A worker that cannot start (an interpreter without smartredis_io) is named in ``INFO srio`` and in
  the runs' error within seconds of the server's start.
- A demoted primary stops its workers, a promoted one starts them; WORKER_USER must be an existing
  user other than root; no process of the workers runs as root or keeps a capability or a descriptor
  of the server; the secret file's mode and bytes follow one rule in C and Python; failed
  ``SRIO.HELLO``\\s are answered late and logged with the client's address, never the secret; the
  secret reaches no argv, environment, MONITOR, SLOWLOG, CLIENT LIST or INFO; under redis-server as
  PID 1 finished supervisors leave no zombie and BGSAVE no "unmatched pid"; requests that come while
  the first worker starts wait for it.
- The worker command: restarts back off after a worker killed by a signal, and start over once a
  worker ran a while (``--healthy-after``); without a secret it says in one line how to give one.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.worker_python import WORKER_USER
from lightning_storage_plugins.services import ManagedProcess, ServiceStartError, free_port
from smartredis_io import Client, RedisServer
from smartredis_io.error import RedisReplyError
from smartredis_io.worker.worker_protocol import SECRET_MAX_BYTES, SECRET_MIN_BYTES, secret_from_line
from tests.support import ROOT
from tests.support.srio_models import SCRIPT, linear, torchscript_bytes
from tests.support.srio_sanitizers import sanitized
from tests.support.srio_workers import (
    WORKER_START_S,
    protocol_client,
    registry,
    run_client,
    wait_until,
    worker_env,
)

pytestmark = pytest.mark.slow

CLEAN_ENV = {"PATH": "/usr/bin:/bin"}
AS_ROOT = os.geteuid() == 0
AS_USER = ("WORKER_USER", WORKER_USER) if AS_ROOT else ()
X = np.arange(8, dtype=np.float32).reshape(2, 4)
IN_PLACE = ROOT / "smartredis_io" / "redisai" / "srio_redisai.so"
needs_root = pytest.mark.skipif(not AS_ROOT, reason="the workers change user only under a server run as root")


def _build_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("srio_build", ROOT / "smartredis_io" / "redisai" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def _shared_dir(prefix: str) -> Path:
    """A fresh directory the workers' user may read (pytest's are root's only)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


@dataclass
class UserServer:
    """A redis-server started as a user starts one, its log (standard output) kept."""

    port: int
    process: ManagedProcess
    client: redis.Redis
    unixsocket: Path | None = None

    @property
    def address(self) -> str:
        return f"unix://{self.unixsocket}" if self.unixsocket else f"127.0.0.1:{self.port}"

    def srio(self) -> dict:
        return self.client.info("srio")

    def log(self) -> str:
        return self.process.log_tail(1 << 20)


@contextmanager
def user_server(module: str | os.PathLike[str], *module_args: str, env: dict[str, str] | None = None,
                wrap: tuple[str, ...] = (), extra: tuple[str, ...] = (),
                unixsocket: Path | None = None) -> Iterator[UserServer]:
    """``redis-server --loadmodule module module_args...`` in a clean environment (``wrap`` runs it:
    ``unshare ...``), on a free port (or only on ``unixsocket``, mode 0700), with no persistence unless
    ``extra`` asks."""
    port = 0 if unixsocket else free_port()
    workdir = tempfile.mkdtemp(prefix="srio-user-server-")
    binary = os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
    if unixsocket:
        extra = ("--unixsocket", str(unixsocket), "--unixsocketperm", "700", *extra)
        client = redis.Redis(unix_socket_path=str(unixsocket), socket_timeout=30)
    else:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.exceptions.RedisError:
            return False

    process = ManagedProcess(
        f"redis-server:{port or unixsocket.name}",
        [*wrap, binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir, *extra,
         "--loadmodule", os.fspath(module), *module_args],
        ready=answers, env=dict(env or CLEAN_ENV), startup_timeout_s=30,
    )
    try:
        process.start()
        yield UserServer(port, process, client, unixsocket)
    finally:
        process.stop()
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _serving(server: UserServer, seconds: float = WORKER_START_S) -> dict:
    """INFO srio once one of the module's workers registered."""
    return wait_until(lambda: (info := server.srio())["srio_workers"] >= 1 and info, seconds,
                      f"the module's worker registers (log tail: {server.log()[-3000:]})")


def _client(address: str, timeout_ms: int = 120_000) -> Client:
    return run_client(address, timeout_ms)


def _runs_a_model(address: str, tag: str) -> None:
    module = linear(3)
    with _client(address) as client:
        client.put_tensor(tag + "x", X)
        client.set_model(tag + "m", torchscript_bytes(module, torch.from_numpy(X)), "TORCH", "CPU")
        client.run_model(tag + "m", [tag + "x"], [tag + "y"])
        with torch.no_grad():
            expected = module(torch.from_numpy(X)).numpy()
        np.testing.assert_allclose(client.get_tensor(tag + "y"), expected, rtol=1e-6)


# ---- any install ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wheel_environment() -> Iterator[Path]:
    """A fresh virtual environment with the project's wheel installed (``pip wheel --no-deps``), its
    dependencies (torch, redis-py...) taken from this environment by a ``.pth`` file processed after
    the wheel's own packages, so that the wheel's smartredis_io is the one imported."""
    base = _shared_dir("srio-wheel-")
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(base / "dist"), str(ROOT)], check=True, timeout=900, capture_output=True)
        (wheel,) = (base / "dist").glob("*.whl")
        venv = base / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
        python = venv / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        # without the suite's PYTHONPATH (the checkout), where pip would find the project installed already
        env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                        "-q", str(wheel)], check=True, timeout=600, capture_output=True, env=env)
        (site,) = venv.glob("lib/python3*/site-packages")
        (site / "zz-dependencies.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
        imported = subprocess.run([str(python), "-c", "import smartredis_io; print(smartredis_io.__file__)"],
                                  env=CLEAN_ENV, cwd="/", capture_output=True, text=True, check=True, timeout=120).stdout
        assert imported.startswith(str(site)), f"the wheel's package is not the one imported: {imported}"
        yield venv
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("install", ["checkout", "wheel", "copy"])
def test_the_workers_run_in_the_installation_of_the_module(install: str, request: pytest.FixtureRequest,
                                                             uid: str) -> None:
    recorded = _build_script().recorded_python(IN_PLACE)
    if install == "wheel":
        venv = request.getfixturevalue("wheel_environment")
        (module,) = venv.glob("lib/python3*/site-packages/smartredis_io/redisai/srio_redisai.so")
        expected = str(venv / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")
        copy_dir = None
    else:
        assert recorded, f"{IN_PLACE} records no interpreter: `make module` builds it with --python"
        expected = recorded
        copy_dir = _shared_dir("srio-module-copy-") if install == "copy" else None
        module = shutil.copy(IN_PLACE, copy_dir / "redisai.so") if copy_dir else IN_PLACE
    try:
        with user_server(module, *AS_USER) as server:
            info = _serving(server)
            assert info["srio_worker_start"] == "ok" and info["srio_worker_python"] == expected, info
            _runs_a_model(server.address, uid)
    finally:
        if copy_dir:
            shutil.rmtree(copy_dir)


def test_an_interpreter_without_smartredis_io_is_named_at_once(uid: str) -> None:
    base = _shared_dir("srio-bare-venv-")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=300)
        python = str(base / "venv" / "bin" / "python3")
        started = time.monotonic()
        with user_server(IN_PLACE, "WORKER_PYTHON", python, *AS_USER) as server:
            info = wait_until(lambda: (i := server.srio())["srio_worker_start"] == "failed" and i, 10,
                              "INFO srio names the failed start")
            assert "No module named 'smartredis_io'" in info["srio_worker_start_error"], info
            assert python in info["srio_worker_start_error"]
            with _client(server.address) as client:
                client.set_script(uid, SCRIPT)
                client.put_tensor(uid + "x", X)
                with pytest.raises(RedisReplyError, match="No module named 'smartredis_io'"):
                    client.run_script(uid, "double", [uid + "x"], [uid + "y"])
            assert time.monotonic() - started < 10, "the run fails within 10 s of the server's start"
            assert "No module named 'smartredis_io'" in server.log(), "the interpreter's own words reach the log"
    finally:
        shutil.rmtree(base)


# ---- the review -------------------------------------------------------------------------------

def _module_args(*more: str) -> tuple[str, ...]:
    return ("WORKERS", "1", "WORKER_PYTHON", sys.executable, *AS_USER, *more)


def _gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def test_a_demoted_primary_stops_its_workers_and_a_promoted_one_starts_them(uid: str) -> None:
    """(With the module's sanitizer build, which must report nothing.)"""
    with sanitized() as module, RedisServer(module=False) as primary, \
            RedisServer(module_args=_module_args(), **module) as server:
        plain = protocol_client(server)
        info = wait_until(lambda: (i := plain.info("srio"))["srio_workers"] >= 1 and i, WORKER_START_S,
                          "the module's worker registers")
        processes = [info["srio_supervisor_pid"], *(entry.pid for entry in registry(plain).values())]
        plain.replicaof("127.0.0.1", primary.port)
        assert _gone(processes, 30), "the supervisor and its workers stop when the server becomes a replica"
        info = plain.info("srio")
        assert info["srio_worker_start"] == "replica" and info["srio_supervisor_pid"] == 0, info
        plain.replicaof("no", "one")
        wait_until(lambda: plain.info("srio")["srio_workers"] >= 1, WORKER_START_S, "a promoted primary starts workers")
        _runs_a_model(server.address, uid)
        plain.close()


@pytest.mark.parametrize("user, why", [("srio-no-such-user", "no such user"), ("root", "is root")])
def test_worker_user_must_be_an_existing_user_other_than_root(user: str, why: str) -> None:
    with pytest.raises(ServiceStartError, match=f"WORKER_USER {user}.*{why}"):
        RedisServer(module_args=("WORKERS", "1", "WORKER_USER", user)).start()


def _status(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()
    return fields


def _session(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return pids


def _fd_inodes(pid: int) -> dict[int, str]:
    inodes = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            inodes[int(fd.name)] = os.readlink(fd)
        except FileNotFoundError:
            pass
    return inodes


@needs_root
def test_no_process_of_the_workers_runs_as_root_or_holds_the_servers_descriptors(uid: str) -> None:
    nobody = pwd.getpwnam(WORKER_USER)
    groups = sorted(os.getgrouplist(WORKER_USER, nobody.pw_gid))
    with sanitized() as module, RedisServer(module_args=_module_args(), **module) as server:
        plain = protocol_client(server)
        info = wait_until(lambda: (i := plain.info("srio"))["srio_workers"] >= 1 and i, WORKER_START_S,
                          "the module's worker registers")
        supervisor = info["srio_supervisor_pid"]
        processes = _session(supervisor)  # the supervisor, multiprocessing's resource tracker, the worker
        assert len(processes) >= 3, processes
        for pid in processes:
            status = _status(pid)
            assert status["Uid"] == [str(nobody.pw_uid)] * 4 and status["Gid"] == [str(nobody.pw_gid)] * 4, status
            assert sorted(map(int, status["Groups"])) == groups, status
            for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
                assert int(status[caps][0], 16) == 0, (pid, caps, status[caps])
            assert status["NoNewPrivs"] == ["1"]
        (redis_pid,) = server.pids
        assert _parent(supervisor) != redis_pid, "the supervisor is no child of redis-server (a double fork)"
        shared = {fd: target for fd, target in _fd_inodes(supervisor).items()
                  if target in set(_fd_inodes(redis_pid).values())}
        assert set(shared) <= {1, 2}, f"the supervisor holds descriptors of the server: {shared}"
        _runs_a_model(server.address, uid)
        plain.close()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_secret_reaches_no_argv_environment_monitor_slowlog_client_list_or_info(uid: str) -> None:
    with RedisServer(module_args=_module_args()) as server:
        secret = server.worker_secret
        plain = protocol_client(server)
        plain.config_set("slowlog-log-slower-than", 0)
        info = wait_until(lambda: (i := plain.info("srio"))["srio_workers"] >= 1 and i, WORKER_START_S,
                          "the module's worker registers")
        (victim,) = (entry.pid for entry in registry(plain).values())
        with redis.Redis(host="127.0.0.1", port=server.port) as watcher, watcher.monitor() as monitor:
            os.kill(victim, signal.SIGKILL)  # its replacement says SRIO.HELLO while MONITOR watches
            wait_until(lambda: {e.pid for e in registry(plain).values()} - {victim}, WORKER_START_S,
                       "a new worker registers")
            plain.ping()
            seen = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                command = monitor.next_command()["command"]
                seen.append(command)
                if command.startswith("PING"):
                    break
        everything = [
            *seen, repr(plain.slowlog_get(1000)), repr(plain.client_list()), repr(plain.info("everything")),
            *(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
              for pid in _session(info["srio_supervisor_pid"])),
            *(Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
              for pid in _session(info["srio_supervisor_pid"])),
        ]
        assert not [text for text in everything if secret in text]
        plain.close()


@pytest.mark.parametrize("mode, loads", [(0o600, True), (0o400, True), (0o640, False), (0o604, False), (0o620, False)])
def test_the_secret_file_is_its_owners_only(mode: int, loads: bool, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(mode)
    if loads:
        with user_server(IN_PLACE, "WORKERS", "0", "WORKER_SECRET_FILE", str(secret)) as server:
            assert server.srio()["srio_worker_start"] == "off"
        return
    with pytest.raises(ServiceStartError, match=rf"may be used by its group or other users \(mode 0{mode:o}\)"):
        with user_server(IN_PLACE, "WORKERS", "0", "WORKER_SECRET_FILE", str(secret)):
            pass


def _module_loads_secret(path: Path) -> tuple[bool, str]:
    """Whether the module loads with the secret file ``path`` (redis-server comes up, or exits at once),
    and redis-server's output."""
    process = subprocess.Popen(
        [shutil.which("redis-server"), "--port", "0", "--unixsocket", str(path.with_name("redis.sock")), "--save", "",
         "--loadmodule", str(IN_PLACE), "WORKERS", "0", "WORKER_SECRET_FILE", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=CLEAN_ENV)
    output = []
    try:
        for line in process.stdout:  # ends when it exits (refused) or is stopped below (it came up)
            output.append(line.decode(errors="replace"))
            if b"ready to accept connections" in line.lower():
                break
    finally:
        process.terminate()
        process.wait(60)
        process.stdout.close()
    text = "".join(output)
    return "Module 'srio' loaded" in text, text


SECRET_BYTES = st.one_of(
    st.binary(max_size=SECRET_MAX_BYTES + 8),
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E),
            min_size=SECRET_MIN_BYTES - 2, max_size=SECRET_MAX_BYTES + 2).map(str.encode),
    st.tuples(st.sampled_from([b"", b" ", b"\t", b"\r"]),
              st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), min_size=14, max_size=20)
              .map(lambda t: t.encode("utf-8")),
              st.sampled_from([b"", b"\n", b" \r\n", b"\nsecond line"])).map(b"".join),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=SECRET_BYTES)
def test_c_and_python_take_the_same_secrets(data: bytes, tmp_path: Path) -> None:
    """The module (C, at load) and the worker command (Python) accept a secret file's bytes alike."""
    path = tmp_path / "secret"
    path.write_bytes(data)
    path.chmod(0o600)
    try:
        python = secret_from_line(data, "test")
    except ValueError:
        python = None
    loads, output = _module_loads_secret(path)
    assert loads == (python is not None), (data, output[-1000:])


def test_a_worker_with_a_secret_that_is_no_text_says_so_in_one_line(redis_server: RedisServer, tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"\xff\xfe" + b"x" * 30 + b"\n")
    path.chmod(0o600)
    result = subprocess.run([sys.executable, "-m", "smartredis_io.worker", "--address", redis_server.address,
                             "--secret-file", str(path), *(["--user", WORKER_USER] if AS_ROOT else [])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "printable ASCII" in line and "WORKER_SECRET_FILE" in line, line


def _hello_seconds(client: redis.Redis, secret: str) -> tuple[float, object]:
    started = time.monotonic()
    try:
        reply = client.execute_command("SRIO.HELLO", secret)
    except redis.exceptions.ResponseError as exc:
        reply = exc
    return time.monotonic() - started, reply


def test_failed_hellos_are_answered_late_and_logged_with_the_address_not_the_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("the-real-secret-0123456789\n")
    secret.chmod(0o600)
    guess = "a-wrong-guess-0123456789"
    with user_server(IN_PLACE, "WORKERS", "0", "WORKER_SECRET_FILE", str(secret)) as server:
        durations = []
        for _ in range(4):
            elapsed, reply = _hello_seconds(server.client, guess)
            assert isinstance(reply, redis.exceptions.NoPermissionError), reply
            durations.append(elapsed)
        assert durations[3] >= 0.8, f"the fourth failure of the window waits 800 ms at least: {durations}"
        assert _hello_seconds(server.client, "the-real-secret-0123456789")[1] == b"OK"
        pipe = server.client.pipeline(transaction=True)
        pipe.execute_command("SRIO.HELLO", guess)
        with pytest.raises(redis.exceptions.ResponseError, match="cannot run inside MULTI"):
            pipe.execute()
        assert server.srio()["srio_failed_hellos"] == 4
        log = wait_until(lambda: "3 SRIO.HELLO" in (text := server.log()) and text, 30,
                         "the failures after the first are logged together at the window's end")
        lines = [line for line in log.splitlines() if "SRIO.HELLO with a wrong worker secret" in line]
        assert len(lines) == 2 and all(re.search(r"the latest from 127\.0\.0\.1:\d+", line) for line in lines), lines
        assert guess not in log and "the-real-secret" not in log


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_as_pid_1_finished_supervisors_leave_no_zombie_and_bgsave_no_unmatched_pid(uid: str) -> None:
    wrap = ("unshare", "--pid", "--fork", "--mount-proc")
    with user_server(IN_PLACE, *AS_USER, wrap=wrap) as server:
        assert server.client.info("server")["process_id"] == 1
        (redis_pid,) = [pid for pid in _children(server.process.pid)]
        first = _serving(server)
        (supervisor,) = [pid for pid in _children(redis_pid) if b"smartredis_io.worker" in _cmdline(pid)]
        os.kill(supervisor, signal.SIGKILL)  # its workers follow it (parent-death signal): orphans of PID 1
        wait_until(lambda: server.srio()["srio_supervisor_pid"] not in (0, first["srio_supervisor_pid"]), 60,
                   "the module starts another supervisor")
        wait_until(lambda: not [pid for pid in _children(redis_pid) if _state(pid) == "Z"], 30,
                   "no zombie is left under redis-server")
        assert _state(supervisor) == "gone"
        server.client.bgsave()
        wait_until(lambda: "Background saving terminated" in server.log(), 60, "the background save ends")
        assert "unmatched pid" not in server.log()
        _serving(server)
        _runs_a_model(server.address, uid)


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_as_pid_1_supervisors_that_end_during_a_bgsave_are_no_unmatched_pids(uid: str) -> None:
    """redis-server reaps every child it finds while its background save runs, and logs those it did
    not start: a supervisor that ends (stopped by a signal, or by the module on demotion) and what it
    started never become such children."""
    wrap = ("unshare", "--pid", "--fork", "--mount-proc")
    with user_server(IN_PLACE, *AS_USER, wrap=wrap) as server:
        (redis_pid,) = [pid for pid in _children(server.process.pid)]
        first = _serving(server)
        server.client.config_set("rdb-key-save-delay", 1_000_000)  # a second per key: ended below
        server.client.mset({f"{uid}{i}": i for i in range(600)})
        server.client.bgsave()
        (saver,) = wait_until(lambda: [pid for pid in _children(redis_pid) if b"redis-rdb-bgsave" in _cmdline(pid)],
                              30, "the background save starts")

        started = _supervisor_and_descendants(redis_pid)
        os.kill(started[0], signal.SIGTERM)  # it stops its worker and ends
        wait_until(lambda: all(_state(pid) == "gone" for pid in started), 60,
                   "the supervisor and the processes it started end and are reaped")
        wait_until(lambda: server.srio()["srio_supervisor_pid"] not in (0, first["srio_supervisor_pid"]), 60,
                   "the module starts another supervisor")
        _serving(server)

        started = _supervisor_and_descendants(redis_pid)
        server.client.replicaof("127.0.0.1", free_port())  # no primary there: the server stays a replica
        wait_until(lambda: all(_state(pid) == "gone" for pid in started), 60,
                   "the demoted server's supervisor and the processes it started end and are reaped")
        assert server.client.info("persistence")["rdb_bgsave_in_progress"] == 1, "all that while the save ran"
        os.kill(saver, signal.SIGUSR1)  # the save ends as redis-server ends one itself
        wait_until(lambda: "Background saving terminated" in server.log(), 60, "the background save ends")
        assert "unmatched pid" not in server.log()


def _supervisor_and_descendants(redis_pid: int) -> list[int]:
    """The module's supervisor, multiprocessing's resource tracker and the worker."""
    (supervisor,) = [pid for pid in _children(redis_pid) if b"smartredis_io.worker" in _cmdline(pid)]
    started = [supervisor, *_descendants(supervisor)]
    assert len(started) >= 3, started
    return started


def _descendants(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


@needs_root
def test_workers_of_another_user_reach_a_servers_unix_socket_or_say_why_not(uid: str, tmp_path: Path) -> None:
    """A server on a unix socket only (SmartSim's colocated database): a socket only root may open
    (unixsocketperm 700) gets an ACL entry for the workers' user alone; a socket in a directory that
    user may not search is named."""
    reachable = _shared_dir("srio-socket-")
    try:
        with user_server(IN_PLACE, *AS_USER, unixsocket=reachable / "redis.sock") as server:
            _serving(server)
            assert stat.S_IMODE(os.stat(reachable / "redis.sock").st_mode) & 0o007 == 0, "no one else may connect"
            _runs_a_model(server.address, uid)
    finally:
        shutil.rmtree(reachable)
    with user_server(IN_PLACE, *AS_USER, unixsocket=tmp_path / "redis.sock") as server:  # pytest's: root's only
        info = wait_until(lambda: (i := server.srio())["srio_worker_start"] == "failed" and i, 30,
                          "INFO srio names the failed start")
        assert f"{WORKER_USER} may not connect to the server's unix socket" in info["srio_worker_start_error"]
        assert re.search(rf"{WORKER_USER} may not search /\S+: mode 0700", info["srio_worker_start_error"]), info


def test_runs_that_come_while_the_first_worker_starts_wait_for_it(uid: str) -> None:
    """Neither WORKER_STARTUP_MS (for replacements) nor QUEUE_TIMEOUT refuses them: their own deadline
    bounds them. The workers' interpreter starts slowly here (5 s more per process, as on a busy CPU
    it is pinned to), so that the run surely comes first."""
    slow = _shared_dir("srio-slow-start-")
    (slow / "sitecustomize.py").write_text("import time\n\ntime.sleep(5)\n")
    (slow / "sitecustomize.py").chmod(0o644)
    try:
        with user_server(IN_PLACE, "WORKER_STARTUP_MS", "0", "QUEUE_TIMEOUT", "500", *AS_USER,
                         env={**CLEAN_ENV, "PYTHONPATH": str(slow)}) as server:
            with _client(server.address, timeout_ms=WORKER_START_S * 1000) as client:
                client.set_script(uid, SCRIPT)
                client.put_tensor(uid + "x", X)
                info = server.srio()
                assert info["srio_workers"] == 0 and info["srio_worker_start"] == "starting", info
                started = time.monotonic()
                client.run_script(uid, "double", [uid + "x"], [uid + "y"])
                assert time.monotonic() - started > 1, "the run waited for the worker"
                np.testing.assert_array_equal(client.get_tensor(uid + "y"), 2 * X)
    finally:
        shutil.rmtree(slow)


def test_queue_timeout_counts_from_when_the_first_worker_asks_for_requests(uid: str, tmp_path: Path) -> None:
    """A worker registers before its slow warm-up (torch's first compile as another user, on a busy
    CPU): runs queued while no registered worker has asked for one yet are not refused by
    QUEUE_TIMEOUT, whatever their wait; from the moment one asks, QUEUE_TIMEOUT counts. The worker
    here speaks the protocol by hand, so that its steps come in a known order."""
    secret = tmp_path / "secret"
    secret.write_text("queue-timeout-secret-0123456789\n")
    secret.chmod(0o600)
    queue_timeout_ms = 300
    with user_server(IN_PLACE, "WORKERS", "0", "WORKER_SECRET_FILE", str(secret),
                     "QUEUE_TIMEOUT", str(queue_timeout_ms)) as server:
        worker = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30, single_connection_client=True)
        with worker, _client(server.address, timeout_ms=120_000) as client, ThreadPoolExecutor(2) as pool:
            assert worker.execute_command("SRIO.HELLO", "queue-timeout-secret-0123456789") == b"OK"
            worker.execute_command("SRIO.HEARTBEAT", "w", os.getpid())
            client.set_script(uid, SCRIPT)
            client.put_tensor(uid + "x", X)
            first = pool.submit(client.run_script, uid, "double", [uid + "x"], [uid + "y"])
            wait_until(lambda: server.srio()["srio_queued"] == 1, 60, "the first run is queued")
            # Ten times QUEUE_TIMEOUT, heartbeats going on (a silent worker is unregistered after 3 s):
            # a run refused for QUEUE_TIMEOUT would be answered within it.
            for _ in range(6):
                time.sleep(queue_timeout_ms * 10 / 6 / 1000)
                worker.execute_command("SRIO.HEARTBEAT", "w", os.getpid())
            assert not first.done() and server.srio()["srio_queued"] == 1, first
            request = worker.execute_command("SRIO.POP", "w", 1000)
            assert request and request[2].decode().endswith(uid), request
            # The worker holds the first run; the next one has QUEUE_TIMEOUT to be taken, and is not.
            with _client(server.address, timeout_ms=120_000) as other:
                started = time.monotonic()
                with pytest.raises(RedisReplyError, match=rf"within {queue_timeout_ms} ms \(1 registered, all busy; "
                                                          r"QUEUE_TIMEOUT\)"):
                    other.run_script(uid, "double", [uid + "x"], [uid + "z"])
                assert time.monotonic() - started < 60
            worker.execute_command("SRIO.REPLY", "w", request[0], 0, 0, 0, "ERROR", "answered by the test")
            with pytest.raises(RedisReplyError, match="answered by the test"):
                first.result(60)


def test_a_server_that_goes_away_is_no_error_in_the_workers_log(tmp_path: Path) -> None:
    """A unix-socket database shut down under its workers (SmartSim's colocated one at the end of a
    run): they leave with an INFO line, no ERROR and no traceback, and their words reach the log after
    the server is gone."""
    sockets = _shared_dir("srio-going-")
    try:
        with user_server(IN_PLACE, *AS_USER, unixsocket=sockets / "redis.sock") as server:
            info = _serving(server)
            processes = _session(info["srio_supervisor_pid"])
            try:
                server.client.shutdown(nosave=True)
            except redis.exceptions.ConnectionError:
                pass  # the server closes the connection as it leaves
            assert _gone(processes, 30), "the workers leave with the server"
            lines = [line for line in server.log().splitlines() if "smartredis_io.worker" in line]
    finally:
        shutil.rmtree(sockets)
    assert any("gone" in line or "closed its connection" in line or "stopping" in line for line in lines), lines
    assert not [line for line in lines if " ERROR " in line or "Traceback" in line], lines


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("cc") is None, reason="needs unshare and cc")
def test_without_a_random_source_the_module_makes_no_secret(tmp_path: Path) -> None:
    """getrandom(2) failing (a shim preloaded into redis-server), the module reads /dev/urandom; with
    /dev/urandom empty too (/dev/null mounted over it), it refuses to load: no secret from the time
    and the pid."""
    shim = tmp_path / "no_getrandom.so"
    (tmp_path / "shim.c").write_text("#include <errno.h>\n#include <stddef.h>\n#include <sys/types.h>\n"
                                     "ssize_t getrandom(void *b, size_t n, unsigned f) { errno = ENOSYS; return -1; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c")], check=True, timeout=120)
    server = ["redis-server", "--port", "0", "--unixsocket", str(tmp_path / "redis.sock"), "--save", "",
              "--loadmodule", str(IN_PLACE), "WORKERS", "0"]
    with subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                           f'exec env LD_PRELOAD={shim} "$@"', "sh", *server],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=CLEAN_ENV) as loaded:
        for line in loaded.stdout:
            if b"ready to accept connections" in line.lower() or b"aborting" in line:
                break
        loaded.terminate()
        assert b"ready to accept connections" in line.lower(), line
    refused = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                              f'mount --bind /dev/null /dev/urandom; exec env LD_PRELOAD={shim} "$@"', "sh", *server],
                             capture_output=True, text=True, timeout=60, env=CLEAN_ENV)
    assert refused.returncode != 0
    assert re.search(r"cannot make a worker secret: getrandom: Function not implemented; /dev/urandom: short read; "
                     r"give one with the module argument WORKER_SECRET_FILE", refused.stdout), refused.stdout[-2000:]


# ---- the worker command -------------------------------------------------------------------------

PAUSE = re.compile(r"worker 0 exited \(killed by signal 9\) after [\d.]+ s; starting a new one in ([\d.]+) s")
EXIT = re.compile(r"worker 0 exited \(killed by signal 9\) after ([\d.]+) s; starting a new one in ([\d.]+) s")
HEALTHY_AFTER_S = 5.0  # the test's --healthy-after: far longer than a worker killed as its interpreter starts lives


def test_workers_killed_by_a_signal_are_restarted_after_growing_pauses(redis_server: RedisServer,
                                                                       tmp_path: Path) -> None:
    """A worker killed by a signal while it starts (an OOM kill, a CUDA fault) is restarted after
    pauses that double, not at once: 144 restarts in 5 s before."""
    killer = _shared_dir("srio-killed-torch-")
    (killer / "torch.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    (killer / "torch.py").chmod(0o644)
    env = {**worker_env(redis_server), "PYTHONPATH": f"{killer}{os.pathsep}{os.environ['PYTHONPATH']}"}
    log = tmp_path / "supervisor.log"
    try:
        with log.open("wb") as out:
            supervisor = subprocess.Popen(
                [sys.executable, "-m", "smartredis_io.worker", "--address", redis_server.address,
                 *(["--user", WORKER_USER] if AS_ROOT else [])], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until(lambda: len(PAUSE.findall(log.read_text())) >= 4, 120, "four workers are killed")
        finally:
            supervisor.terminate()
            supervisor.wait(60)
    finally:
        shutil.rmtree(killer)
    pauses = [float(p) for p in PAUSE.findall(log.read_text())]
    assert pauses[:4] == [0.5, 1.0, 2.0, 4.0], pauses
    assert max(pauses) <= 10.0


def test_a_worker_that_ran_a_while_is_restarted_at_once_and_the_pauses_start_over(redis_server: RedisServer,
                                                                                   tmp_path: Path) -> None:
    """Workers killed as their interpreter starts (by a sitecustomize, while a marker file exists) are
    restarted after growing pauses; one that ran ``--healthy-after`` seconds, killed then, is restarted
    at once, and the next that dies young waits the first pause again."""
    shim = _shared_dir("srio-healthy-")
    marker = shim / "kill-workers"
    (shim / "sitecustomize.py").write_text(
        "import os, signal, sys\n\n"
        f"if '--multiprocessing-fork' in sys.argv and os.path.exists({str(marker)!r}):  # a worker, not the supervisor\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    (shim / "sitecustomize.py").chmod(0o644)
    marker.touch()
    env = {**worker_env(redis_server), "PYTHONPATH": f"{shim}{os.pathsep}{os.environ['PYTHONPATH']}"}
    log = tmp_path / "supervisor.log"
    name = f"healthy-{os.getpid()}"
    plain = protocol_client(redis_server)

    def exits() -> list[tuple[float, float]]:
        return [(float(lived), float(pause)) for lived, pause in EXIT.findall(log.read_text())]

    try:
        with log.open("wb") as out:
            supervisor = subprocess.Popen(
                [sys.executable, "-m", "smartredis_io.worker", "--address", redis_server.address, "--name", name,
                 "--healthy-after", str(HEALTHY_AFTER_S), *(["--user", WORKER_USER] if AS_ROOT else [])],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until(lambda: len(exits()) >= 2, 120, "two workers are killed as they start")
            marker.unlink()
            healthy = wait_until(lambda: next((entry.pid for worker, entry in registry(plain).items()
                                               if worker.startswith(name)), None), WORKER_START_S,
                                 "the next worker starts and registers")
            wait_until(lambda: _age(healthy) >= HEALTHY_AFTER_S + 1, 60, f"the worker has run {HEALTHY_AFTER_S} s")
            marker.touch()
            before = len(exits())
            os.kill(healthy, signal.SIGKILL)
            wait_until(lambda: len(exits()) >= before + 2, 120, "its successor starts, and is killed as it starts")
        finally:
            supervisor.terminate()
            supervisor.wait(60)
    finally:
        shutil.rmtree(shim)
    found = exits()
    (at,) = [index for index, (lived, _) in enumerate(found) if lived >= HEALTHY_AFTER_S]
    assert at >= 2 and [pause for _, pause in found[:at]] == [0.5 * 2 ** i for i in range(at)], found
    assert found[at][1] == 0.0, f"the worker that ran a while is restarted at once: {found}"
    assert found[at + 1][1] == 0.5, f"the pauses start over: {found}"


def _age(pid: int) -> float:
    """Seconds since the process ``pid`` started."""
    started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK")


def test_a_worker_without_a_secret_says_how_to_give_one_in_one_line(redis_server: RedisServer) -> None:
    env = {name: value for name, value in os.environ.items() if name != "SRIO_WORKER_SECRET"}
    result = subprocess.run([sys.executable, "-m", "smartredis_io.worker", "--address", redis_server.address,
                             *(["--user", WORKER_USER] if AS_ROOT else [])],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--secret-file FILE" in line and "WORKER_SECRET_FILE" in line, line
