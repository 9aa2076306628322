"""A SmartSim driver script as users run one inside a Slurm allocation (``salloc ... python THIS CASE DIR``):
``Experiment(launcher="slurm")`` starts the database with ``srun``, and the smartredis_io Redis module
serves it in RedisAI's place (``$SMARTSIM_DEP_INSTALL_PATH`` names the layout of
``python -m smartredis_io.smartsim_setup``).

Cases:

``standalone``
    a database on one node and, beside it on that node, an application launched by ``srun``
    (:mod:`tests.support.smartsim_app`, which finds the database through ``SSDB``); the driver uses the
    database too. Two steps on one node: the allocation needs ``SLURM_OVERLAP=1``.
``cluster``
    a database of three shards, one per node of a 3-node allocation, all on one port, clustered by
    SmartSim; the driver uses it from here.
``colocated``
    two applications launched by ``srun`` at once, each with a database colocated on its node: one over TCP
    on the node's loopback, one over a Unix socket in DIR.

Each application, and the driver for a cluster, puts and gets tensors, stores and runs a TorchScript model
and a torch.export program, and stores and runs a script, from the published SmartRedis client; then the
driver stops what it started and prints one line, ``RESULT {json}``, for the test to read: the database's
addresses and, for a cluster, the keys on each shard. An application that fails makes the driver exit
with every failed application's output.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import redis
import smartredis
from smartsim import Experiment
from smartsim.status import SmartSimStatus

from tests.support import smartsim_app
from tests.support.node_networks import NODE_INTERFACE

PORT = 6780  # SmartSim-Scaling's: each node has an address of its own, so every shard can listen on it


def _app(exp: Experiment, name: str, prefix: str):
    settings = exp.create_run_settings(sys.executable, [smartsim_app.__file__, prefix], run_command="srun")
    settings.set_nodes(1)
    settings.set_tasks(1)
    return exp.create_model(name, settings)


def _output(model) -> str:
    return "".join(Path(model.path, f"{model.name}.{kind}").read_text(errors="replace") for kind in ("out", "err"))


def _check_completed(exp: Experiment, *models) -> None:
    failed = []
    for model, status in zip(models, exp.get_status(*models), strict=True):
        output = _output(model)
        if status != SmartSimStatus.STATUS_COMPLETED or "exercised" not in output:
            failed.append(f"{model.name} ended {status}; its output ends:\n{output[-3000:]}")
    if failed:
        raise SystemExit("\n".join(failed))


def standalone(exp: Experiment) -> dict:
    db = exp.create_database(db_nodes=1, port=PORT, interface=NODE_INTERFACE)
    app = _app(exp, "app", f"app{uuid.uuid4().hex[:6]}")
    exp.generate(db, app, overwrite=True)
    exp.start(db)
    try:
        exp.start(app, block=True)  # SmartSim hands it the database's address in SSDB
        _check_completed(exp, app)
        return {"addresses": db.get_address()}
    finally:
        exp.stop(db)


def cluster(exp: Experiment) -> dict:
    db = exp.create_database(db_nodes=3, port=PORT, interface=NODE_INTERFACE, single_cmd=False)
    exp.generate(db, overwrite=True)
    exp.start(db)
    try:
        addresses = db.get_address()
        client = smartredis.Client(address=addresses[0], cluster=True)
        for i in range(3):  # keys, models and scripts on every shard
            smartsim_app.exercise(client, f"c{i}")
        keys = {}
        for address in addresses:
            host, _, port = address.rpartition(":")
            keys[address] = redis.Redis(host=host, port=int(port), socket_timeout=30).dbsize()
        return {"addresses": addresses, "keys": keys}
    finally:
        exp.stop(db)


def colocated(exp: Experiment, directory: Path) -> dict:
    over_tcp = _app(exp, "app_tcp", f"tcp{uuid.uuid4().hex[:6]}")
    over_tcp.colocate_db_tcp(port=PORT, ifname="lo")
    over_uds = _app(exp, "app_uds", f"uds{uuid.uuid4().hex[:6]}")
    # not SmartSim's default, /tmp/redis.socket: several nodes share this host's /tmp
    over_uds.colocate_db_uds(unix_socket=str(directory / "redis.socket"))
    exp.generate(over_tcp, over_uds, overwrite=True)
    exp.start(over_tcp, over_uds, block=True)
    _check_completed(exp, over_tcp, over_uds)
    return {}


def main(case: str, directory: str) -> int:
    started = time.monotonic()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    exp = Experiment(f"srio-slurm-{case}", exp_path=str(path), launcher="slurm")
    if case == "standalone":
        result = standalone(exp)
    elif case == "cluster":
        result = cluster(exp)
    elif case == "colocated":
        result = colocated(exp, path)
    else:
        raise SystemExit(f"unknown case {case!r}")
    result.update(case=case, job=os.environ.get("SLURM_JOB_ID"), seconds=time.monotonic() - started)
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
