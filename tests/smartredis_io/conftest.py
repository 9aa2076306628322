"""Fixtures of the smartredis_io tests: clients on the session's standalone server and 3-shard cluster,
and an Orchestrator (its own redis-server plus two execution workers) started once."""

from __future__ import annotations

import uuid

import pytest
import redis
from redis.cluster import RedisCluster

from smartredis_io import Client, Orchestrator
from tests.support.srio_sanitizers import sanitized

CLIENT_ENV = ("SSDB", "SR_DB_TYPE", "SSKEYIN", "SSKEYOUT", "SR_CONN_TIMEOUT", "SR_CONN_INTERVAL", "SR_CMD_TIMEOUT",
              "SR_MODEL_TIMEOUT", "SR_USERNAME", "SR_PASSWORD", "SR_TLS", "SR_TLS_CA_CERT", "SR_TLS_CERT", "SR_TLS_KEY",
              "SRIO_BULK_LIMIT_BYTES")


@pytest.fixture(autouse=True)
def _client_env(monkeypatch: pytest.MonkeyPatch):
    """Each test starts without SmartRedis variables."""
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def uid() -> str:
    """A unique name prefix, so tests sharing a database never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def standalone(redis_server) -> Client:
    with Client(False, redis_server.address) as client:
        yield client


@pytest.fixture
def clustered(redis_cluster) -> Client:
    with Client(True, redis_cluster.address) as client:
        yield client


@pytest.fixture(params=["standalone", "cluster"])
def any_client(request: pytest.FixtureRequest) -> Client:
    """The test runs once on the standalone server and once on the cluster."""
    return request.getfixturevalue("standalone" if request.param == "standalone" else "clustered")


@pytest.fixture(scope="session")
def orchestrator():
    """redis-server plus two execution workers, shared by the worker and Lightning tests; the module is
    its sanitizer build, which must report nothing."""
    with sanitized() as module, Orchestrator(shards=1, workers=2, module=module["module"],
                                             server_env=module["env"]) as orch:
        yield orch


@pytest.fixture
def orch_client(orchestrator: Orchestrator) -> Client:
    with Client(False, orchestrator.address) as client:
        yield client


def _plain(server, cluster: bool):
    settings = server.settings()
    if cluster:
        return RedisCluster(host=server.host, port=server.ports[0], password=settings.password)
    return redis.Redis(host="127.0.0.1", port=int(server.address.rsplit(":", 1)[1]), password=settings.password)


@pytest.fixture
def raw(request: pytest.FixtureRequest, redis_server, redis_cluster):
    """A plain redis-py client of the database the test's client uses (the cluster for ``clustered``
    and for the cluster case of a fixture parametrized "standalone"/"cluster"), to look at what is
    stored as any Redis client would."""
    callspec = getattr(request.node, "callspec", None)
    cluster = "clustered" in request.fixturenames or (callspec is not None and "cluster" in callspec.params.values())
    client = _plain(redis_cluster if cluster else redis_server, cluster)
    yield client
    client.close()


@pytest.fixture
def orch_raw(orchestrator: Orchestrator):
    """A plain redis-py client of the shared Orchestrator's database."""
    client = _plain(orchestrator.database, False)
    yield client
    client.close()
