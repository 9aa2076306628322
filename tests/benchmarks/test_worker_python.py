"""benchmarks.worker_python: a runner started by hand as root, on a machine whose Python only root may
reach (a pyenv under /root), starts redis-servers whose Redis-module workers run models; SmartSim's
layout of a redis-server that cannot is named, with the command that lays out one that can."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import redis

from benchmarks.smartredis_client import module_worker_args
from benchmarks.worker_python import (
    REACHING_SCRIPT,
    WORKER_USER,
    hidden_by,
    layout_unreached,
    start_servers_reaching_python,
)
from smartredis_io import RedisServer
from smartredis_io.error import RedisReplyError
from tests.support.srio_models import SCRIPT
from tests.support.srio_workers import WORKER_START_S, run_client, wait_until

X = np.arange(8, dtype=np.float32).reshape(2, 4)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not any(hidden_by(path) for path in (sys.base_prefix, sys.prefix)),
    reason="only a run as root, with a Python under a directory others may not search, needs the wrapper",
)


def _srio(server: RedisServer) -> dict:
    with redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30) as client:
        return client.info("srio")


@pytest.mark.slow
def test_a_runner_as_root_starts_servers_whose_module_workers_run_models(monkeypatch: pytest.MonkeyPatch) -> None:
    uid = "reach"  # each server is the test's own
    monkeypatch.setenv("REDIS_SERVER_BIN", shutil.which("redis-server"))  # as a runner started by hand finds it
    with RedisServer(module_args=module_worker_args()) as server, run_client(server.address) as client:
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        info = wait_until(lambda: (i := _srio(server))["srio_worker_start"] == "failed" and i, 60,
                          "the module names why its workers cannot start")
        assert f"{WORKER_USER} may not search /" in info["srio_worker_start_error"], info
        with pytest.raises(RedisReplyError, match="cannot start"):
            client.run_script(uid, "double", [uid + "x"], [uid + "y"])

    assert start_servers_reaching_python() == str(REACHING_SCRIPT) == os.environ["REDIS_SERVER_BIN"]
    with RedisServer(module_args=module_worker_args()) as server, \
            run_client(server.address, WORKER_START_S * 1000) as client:
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        client.run_script(uid, "double", [uid + "x"], [uid + "y"])  # waits for the first worker to start
        np.testing.assert_array_equal(client.get_tensor(uid + "y"), 2 * X)
        assert _srio(server)["srio_worker_start"] == "ok"


def test_a_smartsim_layout_whose_workers_cannot_run_python_is_named(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from smartredis_io.launchers.smartsim_setup import lay_out

    monkeypatch.setenv("REDIS_SERVER_BIN", shutil.which("redis-server"))
    plain = lay_out(tmp_path / "plain", worker_user=WORKER_USER)
    why = layout_unreached(plain.redis_server)
    assert why is not None and f"may not search {hidden_by(sys.executable)[0]}" in why, why
    assert '--redis-server "$(python -m benchmarks.worker_python)"' in why
    printed = subprocess.run([sys.executable, "-m", "benchmarks.worker_python"], capture_output=True, text=True,
                             check=True, timeout=120).stdout.strip()
    assert printed == str(REACHING_SCRIPT)
    assert layout_unreached(lay_out(tmp_path / "reaching", worker_user=WORKER_USER, redis_server=printed).redis_server) is None
