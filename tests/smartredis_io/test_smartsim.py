"""SmartSim 0.8.0's own launches, with the smartredis_io Redis module in RedisAI's place and nothing
else started (``python -m smartredis_io.smartsim_setup``): a standalone Orchestrator, a 3-shard
cluster, and databases colocated with the application over TCP and over a Unix socket, each running
tensors, models (TorchScript and torch.export) and scripts from the published SmartRedis client on
the workers the module starts.

SmartSim 0.8.0's local launcher refuses an Orchestrator of several shards, so the cluster is started
as SmartSim starts one on a workload manager: its database entry point (``+cluster``) once per shard,
then its own ``create_cluster`` and ``check_cluster_status``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import redis

from lightning_storage_plugins.services import free_port
from smartredis_io.launchers.redis_module import module_path
from smartredis_io.launchers.smartsim_setup import DEP_PATH_ENV, lay_out
from tests.support import smartsim_app
from tests.support.ports import is_free
from tests.support.srio_models import PUBLISHED_SKIP
from tests.support.srio_workers import wait_until

try:
    import smartredis
    from smartsim import Experiment
    from smartsim._core.config import CONFIG
    from smartsim._core.utils import installed_redisai_backends
    from smartsim._core.utils.redis import check_cluster_status, create_cluster
    from smartsim.status import SmartSimStatus
except ImportError:
    smartsim_here = False
else:
    smartsim_here = True

needs_smartsim = pytest.mark.skipif(
    not smartsim_here, reason="SmartSim 0.8.0 and the published SmartRedis client (installed by the set-up on "
                              f"Python < 3.12, where that client has wheels) are not importable here. {PUBLISHED_SKIP}")
APP = Path(smartsim_app.__file__)


def test_the_layout_is_what_smartsim_looks_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = lay_out(tmp_path / "deps", worker_user="nobody")
    version = subprocess.run([layout.redis_server, "--version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("Redis server v="), version  # the server, not redis-check-rdb behind Debian's link
    script = layout.redis_server.read_text()
    assert f"SRIO_WORKER_PYTHON={shlex.quote(sys.executable)}" in script
    assert "SRIO_WORKER_USER=nobody" in script
    assert os.path.realpath(layout.redisai) == module_path()
    assert lay_out(tmp_path / "deps") == layout
    assert "SRIO_WORKER_USER" not in layout.redis_server.read_text(), "laying out again replaces the script"
    if smartsim_here:
        monkeypatch.setenv(DEP_PATH_ENV, str(layout.root))
        assert CONFIG.database_exe == str(layout.redis_server)
        assert CONFIG.redisai == module_path()
        assert CONFIG.database_cli == os.path.realpath(layout.redis_cli)
        assert installed_redisai_backends() == {"torch"}


@pytest.fixture(scope="module")
def smartsim_deps(tmp_path_factory: pytest.TempPathFactory):
    """SmartSim pointed at the module (as root, its workers run as nobody), logging quietly."""
    layout = lay_out(tmp_path_factory.mktemp("smartsim-deps"), worker_user="nobody" if os.geteuid() == 0 else None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEP_PATH_ENV, str(layout.root))
        patch.setenv("SR_LOG_LEVEL", "QUIET")  # the published client logs to stdout otherwise
        patch.setenv("SMARTSIM_FLAG_TELEMETRY", "0")
        yield layout


def _prefix() -> str:
    return f"ss{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
@needs_smartsim
def test_a_standalone_orchestrator(smartsim_deps, tmp_path: Path) -> None:
    exp = Experiment("srio-standalone", exp_path=str(tmp_path), launcher="local")
    db = exp.create_database(port=free_port(), interface="lo")
    exp.start(db)
    try:
        client = smartredis.Client(address=db.get_address()[0], cluster=False)
        smartsim_app.exercise(client, _prefix())
    finally:
        exp.stop(db)


@pytest.mark.slow
@needs_smartsim
def test_a_three_shard_cluster(smartsim_deps, tmp_path: Path) -> None:
    exp = Experiment("srio-cluster", exp_path=str(tmp_path), launcher="local")
    ports = [_cluster_port() for _ in range(3)]
    shards = []
    for index, port in enumerate(ports):
        arguments = ["-m", "smartsim._core.entrypoints.redis", f"+orc-exe={CONFIG.database_exe}",
                     f"+conf-file={CONFIG.database_conf}", "+rai-module", "--loadmodule", CONFIG.redisai,
                     f"+name=shard{index}", f"+port={port}", "+ifname=lo", "+cluster"]
        shards.append(exp.create_model(f"shard{index}", exp.create_run_settings(sys.executable, arguments)))
    for shard in shards:
        exp.generate(shard, overwrite=True)
    exp.start(*shards, block=False)
    try:
        _create_cluster(ports)
        client = smartredis.Client(address=f"127.0.0.1:{ports[0]}", cluster=True)
        for _ in range(3):  # keys, models and scripts on every shard
            smartsim_app.exercise(client, _prefix())
    finally:
        exp.stop(*shards)


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 higher, as SmartSim leaves it) is free too."""
    while True:
        port = free_port()
        if port <= 55535 and is_free(port + 10000):
            return port


def _create_cluster(ports: list[int]) -> None:
    """SmartSim's cluster creation, once every shard answers."""

    def answers(port: int) -> bool:
        try:
            return redis.Redis(port=port, socket_timeout=1).ping()
        except redis.exceptions.ConnectionError:
            return False

    wait_until(lambda: all(answers(port) for port in ports), 60, "every shard answers")
    create_cluster(["127.0.0.1"], ports)
    check_cluster_status(["127.0.0.1"], ports)


@pytest.mark.slow
@needs_smartsim
def test_databases_colocated_over_tcp_and_a_unix_socket(smartsim_deps, tmp_path: Path) -> None:
    exp = Experiment("srio-colocated", exp_path=str(tmp_path), launcher="local")
    # as root, the module's workers (nobody) connect through the socket: a directory they may search
    sockets = Path(tempfile.mkdtemp(prefix="srio-sockets-"))
    sockets.chmod(0o755)
    try:
        apps = []
        for kind in ("tcp", "uds"):
            settings = exp.create_run_settings(sys.executable, [str(APP), _prefix()])
            app = exp.create_model(f"app_{kind}", settings)
            if kind == "tcp":
                app.colocate_db_tcp(port=free_port(), ifname="lo")
            else:
                app.colocate_db_uds(unix_socket=str(sockets / "redis.socket"))
            apps.append(app)
        exp.generate(*apps, overwrite=True)
        exp.start(*apps, block=True)
        statuses = exp.get_status(*apps)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    for app, status in zip(apps, statuses, strict=True):
        output = Path(app.path, f"{app.name}.out").read_text() + Path(app.path, f"{app.name}.err").read_text()
        assert status == SmartSimStatus.STATUS_COMPLETED, f"{app.name}: {status}\n{output[-3000:]}"
        assert "exercised" in output, output[-3000:]
