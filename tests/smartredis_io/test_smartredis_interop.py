"""One database, two kinds of client: the published SmartRedis client (``smartredis==0.6.1``, the C++
core every SmartRedis language binding shares) and ``smartredis_io``, through the smartredis_io Redis
module, on a real redis-server and a real 3-shard Redis Cluster. What either client puts, the other
reads: tensors, datasets (with aggregation lists), models and scripts."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import smartredis_io
from smartredis_io import AclUser, ConfigOptions, RedisCluster, RedisServer
from smartredis_io._client import wire
from smartredis_io.error import RedisReplyError
from tests.support.srio_models import PUBLISHED_SKIP, SCRIPT, linear, torchscript_bytes

smartredis = pytest.importorskip("smartredis", reason=PUBLISHED_SKIP, exc_type=ImportError)

#: the tensor types the published client sends (smartredis.util.Dtypes)
PUBLISHED_DTYPES = ("float64", "float32", "int8", "int16", "int32", "int64", "uint8", "uint16")
BULK_LIMIT = 4096


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SR_LOG_LEVEL", "QUIET")  # the published client logs to stdout otherwise


def _database(request: pytest.FixtureRequest, mode: str):
    return request.getfixturevalue("redis_cluster" if mode == "cluster" else "redis_server")


@pytest.fixture(params=["standalone", "cluster"])
def clients(request: pytest.FixtureRequest):
    """(published client, smartredis_io client) on one database, standalone then cluster."""
    cluster = request.param == "cluster"
    database = _database(request, request.param)
    published = smartredis.Client(address=database.address, cluster=cluster)
    with smartredis_io.Client(cluster, database.address) as ours:
        yield published, ours


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def chunking_database(request: pytest.FixtureRequest):
    """A database whose module chunks values above 4 KiB, as smartredis_io does with SRIO_BULK_LIMIT_BYTES."""
    args = ("BULK_LIMIT_BYTES", str(BULK_LIMIT))
    launcher = RedisCluster(3, module_args=args) if request.param == "cluster" else RedisServer(module_args=args)
    with launcher:
        yield launcher, request.param == "cluster"


# ---- tensors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", PUBLISHED_DTYPES)
def test_tensors_of_every_type_both_ways(clients, uid: str, dtype: str) -> None:
    published, ours = clients
    array = (np.arange(24) * 7 - 50).astype(dtype).reshape(2, 3, 4)
    published.put_tensor(uid + "p", array)
    got = ours.get_tensor(uid + "p")
    assert got.dtype == array.dtype
    np.testing.assert_array_equal(got, array)
    ours.put_tensor(uid + "o", array[:, ::2, 1:])  # not contiguous: sent in C order
    np.testing.assert_array_equal(published.get_tensor(uid + "o"), array[:, ::2, 1:])
    assert published.tensor_exists(uid + "o") and ours.tensor_exists(uid + "p")


def test_tensor_copy_rename_delete_across(clients, uid: str) -> None:
    published, ours = clients
    array = np.linspace(0, 1, 10, dtype=np.float32)
    ours.put_tensor(uid, array)
    published.copy_tensor(uid, uid + "c")
    published.rename_tensor(uid + "c", uid + "r")
    np.testing.assert_array_equal(ours.get_tensor(uid + "r"), array)
    assert not ours.tensor_exists(uid + "c")
    published.delete_tensor(uid + "r")
    assert not ours.tensor_exists(uid + "r")
    for client in (published, ours):  # a name with no tensor: both delete nothing, without an error
        client.delete_tensor(uid + "r")
    ours.copy_tensor(uid, uid + "c2")
    np.testing.assert_array_equal(published.get_tensor(uid + "c2"), array)


def test_large_chunked_tensors_both_ways(chunking_database, uid: str, monkeypatch) -> None:
    database, cluster = chunking_database
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, str(BULK_LIMIT))
    published = smartredis.Client(address=database.address, cluster=cluster)
    big = np.random.default_rng(0).standard_normal((100, 123)).astype(np.float32)  # 48 KiB: 13 chunks
    with smartredis_io.Client(cluster, database.address) as ours:
        published.put_tensor(uid + "p", big)
        assert wire.read_header(ours._db, uid + "p").chunks == 13
        np.testing.assert_array_equal(ours.get_tensor(uid + "p"), big)
        ours.put_tensor(uid + "o", big.T)
        assert wire.read_header(ours._db, uid + "o").chunks == 13
        np.testing.assert_array_equal(published.get_tensor(uid + "o"), big.T)
        published.put_tensor(uid + "o", big[:2])  # replaced by a small one: the chunks go
        assert wire.read_header(ours._db, uid + "o").chunks == 0
        np.testing.assert_array_equal(ours.get_tensor(uid + "o"), big[:2])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(array=st.sampled_from(PUBLISHED_DTYPES).flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6))))
def test_round_trips_between_the_clients(clients, uid: str, array: np.ndarray) -> None:
    """Any array the published client sends comes back bit for bit through the other client, both ways."""
    published, ours = clients
    published.put_tensor(uid, array)
    got = ours.get_tensor(uid)
    assert got.dtype == array.dtype and got.shape == array.shape and got.tobytes() == array.tobytes()
    ours.put_tensor(uid, array)
    back = published.get_tensor(uid)
    assert back.dtype == array.dtype and back.shape == array.shape and back.tobytes() == array.tobytes()


def test_what_the_published_client_refuses_itself(clients, uid: str) -> None:
    """0-d and empty tensors are smartredis_io's (and the module's); the published client checks dims itself."""
    published, ours = clients
    ours.put_tensor(uid, np.zeros((2, 0), dtype=np.float32))
    with pytest.raises(smartredis.error.RedisRuntimeError, match="not valid: 0"):
        published.get_tensor(uid)
    with pytest.raises(smartredis.error.RedisRuntimeError, match="must be positive"):
        published.put_tensor(uid, np.zeros((0,), dtype=np.float32))


# ---- datasets ------------------------------------------------------------------------------------

def _dataset(module, name: str):
    dataset = module.Dataset(name)
    dataset.add_tensor("field", np.arange(12, dtype=np.float64).reshape(3, 4))
    dataset.add_tensor("mask", np.array([1, 0, 1], dtype=np.uint8))
    dataset.add_meta_scalar("time", 0.25)
    dataset.add_meta_scalar("time", 0.5)
    dataset.add_meta_scalar("step", np.int64(7))
    dataset.add_meta_scalar("rank", np.uint32(3))
    dataset.add_meta_scalar("dt", np.float32(1e-3))
    dataset.add_meta_string("solver", "lbm")
    dataset.add_meta_string("solver", "ünïcode ok")
    return dataset


def _check(dataset) -> None:
    assert sorted(dataset.get_tensor_names()) == ["field", "mask"]
    np.testing.assert_array_equal(dataset.get_tensor("field"), np.arange(12, dtype=np.float64).reshape(3, 4))
    np.testing.assert_array_equal(dataset.get_tensor("mask"), [1, 0, 1])
    np.testing.assert_array_equal(dataset.get_meta_scalars("time"), [0.25, 0.5])
    np.testing.assert_array_equal(dataset.get_meta_scalars("step"), [7])
    assert dataset.get_meta_scalars("rank").dtype == np.uint32
    assert dataset.get_meta_scalars("dt").dtype == np.float32
    assert dataset.get_meta_strings("solver") == ["lbm", "ünïcode ok"]


def test_datasets_both_ways(clients, uid: str) -> None:
    published, ours = clients
    published.put_dataset(_dataset(smartredis, uid + "p"))
    assert ours.dataset_exists(uid + "p")
    _check(ours.get_dataset(uid + "p"))
    ours.put_dataset(_dataset(smartredis_io, uid + "o"))
    assert published.dataset_exists(uid + "o")
    _check(published.get_dataset(uid + "o"))

    ours.copy_dataset(uid + "p", uid + "c")
    _check(published.get_dataset(uid + "c"))
    published.rename_dataset(uid + "o", uid + "r")
    _check(ours.get_dataset(uid + "r"))
    assert not ours.dataset_exists(uid + "o")
    published.delete_dataset(uid + "r")
    ours.delete_dataset(uid + "c")
    assert not ours.dataset_exists(uid + "r") and not published.dataset_exists(uid + "c")


def test_a_dataset_put_again_with_fewer_tensors(clients, uid: str) -> None:
    published, ours = clients
    ours.put_dataset(_dataset(smartredis_io, uid))
    smaller = smartredis_io.Dataset(uid)
    smaller.add_tensor("field", np.ones(2, dtype=np.int16))
    ours.put_dataset(smaller)
    again = published.get_dataset(uid)
    assert again.get_tensor_names() == ["field"] and again.get_metadata_field_names() == []
    assert not ours.tensor_exists(f"{{{uid}}}.mask")  # the tensor it no longer has is gone


def test_aggregation_lists_both_ways(clients, uid: str) -> None:
    published, ours = clients
    for i in range(2):
        published.put_dataset(_dataset(smartredis, f"{uid}p{i}"))
        published.append_to_list(uid, _dataset(smartredis, f"{uid}p{i}"))
        ours.put_dataset(_dataset(smartredis_io, f"{uid}o{i}"))
        ours.append_to_list(uid, _dataset(smartredis_io, f"{uid}o{i}"))
    assert ours.get_list_length(uid) == published.get_list_length(uid) == 4
    for datasets in (ours.get_datasets_from_list(uid), published.get_datasets_from_list(uid)):
        assert [d.get_name() for d in datasets] == [f"{uid}p0", f"{uid}o0", f"{uid}p1", f"{uid}o1"]
        for dataset in datasets:
            _check(dataset)


def test_prefixed_datasets_and_tensors_share_keys(request: pytest.FixtureRequest, monkeypatch, uid: str) -> None:
    """Ensemble prefixes (SSKEYIN/SSKEYOUT) form the same keys in both clients."""
    database = request.getfixturevalue("redis_server")
    monkeypatch.setenv("SSKEYOUT", f"{uid}sim")
    monkeypatch.setenv("SSKEYIN", f"{uid}sim")
    published = smartredis.Client(address=database.address, cluster=False)
    published.put_tensor("x", np.ones(3, dtype=np.int32))
    published.put_dataset(_dataset(smartredis, "d"))
    with smartredis_io.Client(False, database.address) as ours:
        np.testing.assert_array_equal(ours.get_tensor("x"), [1, 1, 1])
        _check(ours.get_dataset("d"))
        with redis.Redis(host="127.0.0.1", port=database.port) as plain:
            assert plain.exists(f"{uid}sim.x", f"{uid}sim.{{d}}.meta") == 2


# ---- models and scripts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return torchscript_bytes(linear(2), torch.ones(2, 4))


def test_models_and_scripts_both_ways(clients, uid: str, model_bytes: bytes) -> None:
    published, ours = clients
    published.set_model(uid + "p", model_bytes, "TORCH", "CPU", batch_size=4, min_batch_size=2,
                        min_batch_timeout=10, tag="from smartredis")
    assert ours.model_exists(uid + "p") and ours.get_model(uid + "p") == model_bytes
    ours.set_model(uid + "o", model_bytes, "TORCH", "CPU", tag="from smartredis_io")
    assert published.model_exists(uid + "o") and published.get_model(uid + "o") == model_bytes

    published.set_script(uid + "ps", SCRIPT)
    assert ours.get_script(uid + "ps") == SCRIPT
    ours.set_script(uid + "os", SCRIPT)
    assert published.get_script(uid + "os") == SCRIPT
    published.set_function(uid + "pf", _double)
    assert "def _double" in ours.get_script(uid + "pf")

    published.delete_model(uid + "o")
    published.delete_script(uid + "os")
    ours.delete_model(uid + "p")
    ours.delete_script(uid + "ps")
    assert not any(ours.model_exists(uid + s) or published.model_exists(uid + s) for s in ("o", "os", "p", "ps"))


def _double(x):
    return x * 2


def test_models_of_a_cluster_are_on_every_shard(redis_cluster, uid: str, model_bytes: bytes) -> None:
    """Where SmartRedis puts a model in a cluster (a copy per shard), smartredis_io puts it too."""
    published = smartredis.Client(address=redis_cluster.address, cluster=True)
    with smartredis_io.Client(True, redis_cluster.address) as ours:
        ours.set_model(uid, model_bytes, "TORCH", "CPU")
        published.set_model(uid + "p", model_bytes, "TORCH", "CPU")
    for port in redis_cluster.ports:
        with redis.Redis(host="127.0.0.1", port=port) as node:
            keys = {key for key in node.scan_iter(match=f"{{*}}.{uid}*") if b".blob." not in key}
            assert len(keys) == 2 and {key.split(b"}.", 1)[1] for key in keys} == {uid.encode(), f"{uid}p".encode()}


def test_unserved_backends_are_refused_with_a_clear_error(clients, uid: str, model_bytes: bytes) -> None:
    published, ours = clients
    for backend in ("TF", "TFLITE", "ONNX"):
        with pytest.raises(smartredis.error.RedisReplyError, match=f"backend {backend} is not served"):
            published.set_model(uid, model_bytes, backend, "CPU", inputs=["a"] if backend == "TF" else None,
                                outputs=["b"] if backend == "TF" else None)
    assert not ours.model_exists(uid)


# ---- a database without the module ---------------------------------------------------------------

def test_without_the_module_the_published_client_names_the_missing_command(uid: str) -> None:
    with RedisServer(module=False) as server, smartredis_io.Client(False, server.address) as ours:
        published = smartredis.Client(address=server.address, cluster=False)
        with pytest.raises(smartredis.error.RedisReplyError, match="unknown command 'AI.TENSORSET'"):
            published.put_tensor(uid, np.ones(2))
        ours.put_tensor(uid, np.ones(2))  # smartredis_io's own data path needs no module
        ours.put_dataset(_dataset(smartredis_io, uid))
        _check(ours.get_dataset(uid))
        ours.set_model(uid, torchscript_bytes(linear(0), torch.ones(1, 4)), "TORCH", "CPU")
        assert ours.model_exists(uid)


# ---- ACL: a client writes datasets and scripts under its write keys ------------------------------

def test_a_client_user_puts_datasets_and_scripts_under_its_write_keys(uid: str) -> None:
    user = AclUser("sim", "sim-pw", write_keys=(f"{uid}sim.*",))
    with RedisServer(users=[user]) as server:
        options = ConfigOptions.create_from_environment("")
        for name, value in (("SSDB", server.address), ("SR_USERNAME", "sim"), ("SR_PASSWORD", "sim-pw"),
                            ("SSKEYOUT", f"{uid}sim"), ("SSKEYIN", f"{uid}sim")):
            options.override_string_option(name, value)
        with smartredis_io.Client(options) as client:
            client.use_model_ensemble_prefix(True)
            client.put_dataset(_dataset(smartredis_io, "d"))
            _check(client.get_dataset("d"))
            client.set_script("s", SCRIPT)
            assert client.get_script("s") == SCRIPT
            client.put_tensor("x", np.ones(2))
            client.use_dataset_ensemble_prefix(False)
            with pytest.raises(RedisReplyError, match="permission"):
                client.put_dataset(_dataset(smartredis_io, f"{uid}elsewhere"))
