"""Real services for the whole suite, started once per session and always stopped."""

from __future__ import annotations

import os
import uuid

from dataflux_ckpt.emulator import configure_gcsfs_for_emulator

# Before anything imports gcsfs: an emulator does not serve its gRPC bucket-type probe.
configure_gcsfs_for_emulator()

import pytest  # noqa: E402

from benchmarks.worker_python import redis_server_reaching_python  # noqa: E402
from dataflux_ckpt.testing import FakeGcsServer  # noqa: E402
from dataflux_ckpt.xml_server import XmlMultipartServer  # noqa: E402
from smartredis_io import RedisCluster, RedisServer  # noqa: E402
from tests.support import ROOT  # noqa: E402
from tests.support.slurm import LocalSlurm, slurm_unavailable_reason  # noqa: E402
from tests.support.srio_sanitizers import sanitized  # noqa: E402

# The checkout's set-up (`make setup`) builds the service binaries here; the installed package never
# looks in a checkout, so the suite (and the examples and benchmarks it runs as child processes) is told.
for _binary, _env_var in (("fake-gcs-server", "FAKE_GCS_SERVER_BIN"), ("toxiproxy-server", "TOXIPROXY_SERVER_BIN")):
    if (ROOT / ".tools" / "bin" / _binary).exists():
        os.environ.setdefault(_env_var, str(ROOT / ".tools" / "bin" / _binary))
# As root, the Redis module's workers run as nobody, who must be able to run this environment's Python.
if (_reaching := redis_server_reaching_python()) is not None:
    os.environ["REDIS_SERVER_BIN"] = _reaching
# Child processes (workers, fresh-process readers) import the test-support package too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)


@pytest.fixture(scope="session")
def gcs_emulator():
    """A fake-gcs-server over HTTP, with this process' GCS clients pointed at it."""
    with FakeGcsServer() as server, server.activated():
        yield server


@pytest.fixture(scope="session")
def gcs_xml_server(gcs_emulator: FakeGcsServer):
    """The XML multipart server in front of the session emulator; parts of any size are accepted."""
    with XmlMultipartServer(gcs_emulator, min_part_bytes=0) as server:
        yield server


@pytest.fixture
def gcs_bucket(gcs_emulator: FakeGcsServer) -> str:
    """A fresh, empty bucket on the emulator."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    gcs_emulator.create_bucket(name)
    return name


@pytest.fixture(scope="session")
def redis_server():
    """A standalone redis-server on loopback, with the Redis module's sanitizer build: every test on
    it checks the module too, and the sanitizers must report nothing."""
    with sanitized() as module, RedisServer(**module) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-shard Redis Cluster on loopback, with the Redis module's sanitizer build."""
    with sanitized() as module, RedisCluster(shards=3, **module) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm_cluster():
    """A private 3-node Slurm cluster with accounting (slurmdbd on a MariaDB server of its own).

    Skipped where Slurm is not installed or the tests do not run as root; where it is installed and
    does not come up, every test using it errors with the daemon's log tail, never skips.
    """
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with LocalSlurm(nodes=3, accounting=True) as cluster:
        yield cluster
