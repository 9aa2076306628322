"""The worker protocol guarded inside the Redis module, on a plain ``redis-server --loadmodule`` with no
ACL users (every client is the default user, with every right), as SmartSim and a user by hand start
it: the module's own workers serve runs while any other client gets NOPERM from every worker command,
and a supervisor of theirs that dies is started again by the module."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest
import redis

from smartredis_io import Client, RedisServer
from smartredis_io.launchers.redis_module import module_path
from tests.support.srio_models import SCRIPT
from tests.support.srio_workers import WORKER_START_S, wait_until

X = np.arange(6, dtype=np.float32).reshape(2, 3)
WORKER_COMMANDS = [("SRIO.HELLO", "a guess"), ("SRIO.POP", "w", 100), ("SRIO.TAKE", "w", "m", 1, 1, 100),
                   ("SRIO.REPLY", "w", 1, 0, 0, 0, "OK"), ("SRIO.RETURN", "w", 1), ("SRIO.PAUSE", "w"),
                   ("SRIO.HEARTBEAT", "w", 1), ("SRIO.UNREGISTER", "w"), ("SRIO.WORKERS",), ("SRIO.POP",)]


@pytest.fixture(scope="module")
def loaded():
    """``redis-server --loadmodule <module>``: none of our launchers' module arguments, so the module
    makes its own secret, which only the workers it starts receive. They run this interpreter (a
    checkout's module sits in no virtual environment)."""
    user = ("WORKER_USER", "nobody") if os.geteuid() == 0 else ()
    with RedisServer(module=False, extra_args=("--loadmodule", module_path(), *user),
                     env={"SRIO_WORKER_PYTHON": sys.executable}) as server:
        yield server


def _srio(client: redis.Redis) -> dict:
    return client.info("srio")


def _serving(client: redis.Redis) -> int:
    """The pid of the module's supervisor once one of its workers registered."""
    return wait_until(lambda: _srio(client)["srio_workers"] >= 1 and _srio(client)["srio_supervisor_pid"],
                      WORKER_START_S, "the module's worker registers")


def _run(address: str, uid: str) -> None:
    with Client(False, address) as client:
        client.set_script(uid, SCRIPT)
        client.put_tensor(uid + "x", X)
        client.run_script(uid, "double", [uid + "x"], [uid + "y"])
        np.testing.assert_array_equal(client.get_tensor(uid + "y"), 2 * X)


@pytest.mark.slow
def test_clients_get_noperm_from_every_worker_command_while_the_workers_serve(loaded: RedisServer, uid: str) -> None:
    with redis.Redis(host="127.0.0.1", port=loaded.port) as client:
        assert client.acl_users() == ["default"]  # every client has every right
        _serving(client)
        for command in WORKER_COMMANDS:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        with pytest.raises(redis.exceptions.NoPermissionError, match="wrong worker secret"):
            client.execute_command("SRIO.HELLO", "")
        with pytest.raises(redis.exceptions.ResponseError, match="not allowed from script"):  # a script's
            client.eval("return redis.call('SRIO.POP', 'w', 0)", 0)  # connection is everyone's
        _run(loaded.address, uid)  # the workers keep serving
        assert client.ping() and _srio(client)["srio_workers"] >= 1


@pytest.mark.slow
def test_a_dead_supervisor_is_started_again(loaded: RedisServer, uid: str) -> None:
    with redis.Redis(host="127.0.0.1", port=loaded.port) as client:
        supervisor = _serving(client)
        os.kill(supervisor, signal.SIGKILL)  # its workers follow it (their parent-death signal)
        wait_until(lambda: _srio(client)["srio_supervisor_pid"] not in (0, supervisor), 10,
                   "the module starts a new supervisor")
        _serving(client)
        _run(loaded.address, uid)
