"""Datasets with metadata, aggregation lists (concurrent producers, one consumer) and key prefixing."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster, key_slot

from smartredis_io import Client, Dataset
from smartredis_io._client import wire
from smartredis_io.error import RedisKeyError, RedisRuntimeError
from tests.support.redis_faults import deaths, lasting_orphans

PRODUCERS = 4
DATASETS_PER_PRODUCER = 5


def _dataset(name: str, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    ds = Dataset(name)
    ds.add_tensor("u", rng.random((3, 4)).astype(np.float32))
    ds.add_tensor("ids", np.arange(5, dtype=np.int64))
    ds.add_meta_scalar("step", seed)
    ds.add_meta_scalar("step", seed + 1)
    ds.add_meta_scalar("dt", np.float32(0.5))
    ds.add_meta_string("origin", "sim")
    ds.add_meta_string("origin", f"rank{seed}")
    return ds


def _keys(raw, pattern: str) -> list[bytes]:
    """Keys matching ``pattern`` on every shard."""
    if isinstance(raw, RedisCluster):
        return raw.keys(pattern, target_nodes=RedisCluster.ALL_NODES)
    return raw.keys(pattern)


def _assert_same(a: Dataset, b: Dataset) -> None:
    assert a.get_tensor_names() == b.get_tensor_names()
    for name in a.get_tensor_names():
        np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name))
        assert a.get_tensor(name).dtype == b.get_tensor(name).dtype
    assert sorted(a.get_metadata_field_names()) == sorted(b.get_metadata_field_names())
    for field in ("step", "dt"):
        np.testing.assert_array_equal(a.get_meta_scalars(field), b.get_meta_scalars(field))
        assert a.get_meta_scalars(field).dtype == b.get_meta_scalars(field).dtype
    assert a.get_meta_strings("origin") == b.get_meta_strings("origin")


def test_dataset_round_trip_with_metadata(any_client: Client, uid: str) -> None:
    ds = _dataset(uid, seed=3)
    any_client.put_dataset(ds)
    assert any_client.dataset_exists(uid) and any_client.poll_dataset(uid, 10, 1)
    back = any_client.get_dataset(uid)
    assert back.get_name() == uid
    _assert_same(ds, back)
    assert back.get_meta_scalars("step").tolist() == [3, 4]
    assert back.get_meta_scalars("dt").dtype == np.float32


def test_dataset_parts_share_one_shard(clustered: Client, raw, uid: str) -> None:
    clustered.put_dataset(_dataset(uid))
    keys = _keys(raw, f"{{{uid}}}*")
    assert len(keys) == 3  # manifest + two tensors
    assert len({key_slot(k) for k in keys}) == 1


def test_dataset_copy_rename_delete(any_client: Client, raw, uid: str) -> None:
    any_client.put_dataset(_dataset(uid))
    any_client.copy_dataset(uid, uid + "copy")
    any_client.rename_dataset(uid + "copy", uid + "moved")
    assert not any_client.dataset_exists(uid + "copy")
    moved = any_client.get_dataset(uid + "moved")
    assert moved.get_name() == uid + "moved"
    _assert_same(_dataset(uid), moved)
    any_client.delete_dataset(uid)
    assert not any_client.dataset_exists(uid)
    assert not _keys(raw, f"{{{uid}}}*"), "no part of the deleted dataset is left"
    with pytest.raises(RedisKeyError):
        any_client.get_dataset(uid)
    with pytest.raises(RedisKeyError):
        any_client.delete_dataset(uid)


def test_overwriting_a_dataset_replaces_it_whole(standalone: Client, raw, uid: str) -> None:
    standalone.put_dataset(_dataset(uid, 1))
    smaller = Dataset(uid)
    smaller.add_tensor("only", np.zeros(2))
    standalone.put_dataset(smaller)
    back = standalone.get_dataset(uid)
    assert back.get_tensor_names() == ["only"] and back.get_metadata_field_names() == []
    assert len(_keys(raw, f"{{{uid}}}*")) == 2  # the old version's tensors are gone


CHUNKED_LIMIT = 65536  # a lowered bulk limit: BIG elements of float32 take several chunks
BIG = 100_000


def _with_big(name: str, value: float) -> Dataset:
    ds = Dataset(name)
    ds.add_tensor("big", np.full(BIG, value, np.float32))
    ds.add_tensor("u", np.full(3, value, np.float32))
    return ds


def _without_big(name: str) -> Dataset:
    ds = Dataset(name)
    ds.add_tensor("u", np.zeros(3, np.float32))
    return ds


def test_replacing_and_deleting_datasets_removes_the_chunks_of_their_tensors(
        any_client: Client, raw, uid: str, monkeypatch) -> None:
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, str(CHUNKED_LIMIT))
    any_client.put_dataset(_with_big(uid, 1.0))
    first = set(_keys(raw, f"{{{uid}}}*"))
    assert sum(b".chunk." in key for key in first) > 1
    any_client.put_dataset(_with_big(uid, 2.0))
    second = set(_keys(raw, f"{{{uid}}}*"))
    assert len(second) == len(first) and not {key for key in first if b".chunk." in key} & second
    any_client.put_dataset(_without_big(uid))
    assert len(_keys(raw, f"{{{uid}}}*")) == 2, "the dropped tensor's chunks went with it"
    any_client.put_dataset(_with_big(uid, 3.0))
    any_client.delete_dataset(uid)
    assert not _keys(raw, f"{{{uid}}}*"), "no chunk of the deleted dataset is left"


def test_a_dataset_replaced_while_it_is_being_deleted_leaves_nothing_behind(
        any_client: Client, raw, uid: str, monkeypatch) -> None:
    """Another writer stores a dataset with a chunked tensor after the delete read the old one: the
    delete starts again and takes the new tensor and its chunks too."""
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, str(CHUNKED_LIMIT))
    any_client.put_dataset(_without_big(uid))
    chunk_keys, replaced = wire.stored_chunk_keys, []

    def replaced_meanwhile(*args, **kwargs):
        if not replaced:
            replaced.append(True)
            any_client.put_dataset(_with_big(uid, 2.0))
        return chunk_keys(*args, **kwargs)

    monkeypatch.setattr(wire, "stored_chunk_keys", replaced_meanwhile)
    assert any_client.delete_dataset(uid) is None and replaced
    assert not _keys(raw, f"{{{uid}}}*"), "the replacing dataset's tensors and chunks are gone too"


@pytest.mark.parametrize("operation", ["replace", "drop a tensor", "delete"])
def test_a_dataset_writer_killed_before_any_of_its_commands_leaves_a_whole_dataset_and_only_keys_that_expire(
        redis_server, uid: str, monkeypatch, operation: str) -> None:
    """The writer dies before its n-th command, for every n: the dataset reads as before or after,
    and every key no stored value reaches expires."""
    monkeypatch.setenv(wire.BULK_LIMIT_ENV, str(CHUNKED_LIMIT))
    plain = redis.Redis(host=redis_server.host, port=redis_server.port)

    def store(ds: Dataset) -> None:
        with Client(False, redis_server.address) as client:
            client.put_dataset(ds)

    def run() -> None:
        with Client(False, redis_server.address) as client:
            if operation == "delete":
                client.delete_dataset(uid)
            else:
                client.put_dataset(_with_big(uid, 2.0) if operation == "replace" else _without_big(uid))

    for where in deaths(monkeypatch, run, lambda: store(_with_big(uid, 1.0))):
        assert not lasting_orphans(plain, f"{{{uid}}}*"), where
        with Client(False, redis_server.address) as client:
            if client.dataset_exists(uid):
                back = client.get_dataset(uid)
                values = {name: np.unique(back.get_tensor(name)).tolist() for name in back.get_tensor_names()}
                assert values in ({"big": [1.0], "u": [1.0]}, {"big": [2.0], "u": [2.0]}, {"u": [0.0]}), where
            else:
                lasting = [key for key in plain.scan_iter(match=f"{{{uid}}}*") if plain.pttl(key) < 0]
                assert operation == "delete" and not lasting, where
    plain.close()


def test_readers_never_see_half_a_dataset(redis_server, uid: str) -> None:
    stop = threading.Event()
    seen: list[tuple] = []
    errors: list[BaseException] = []

    def writer() -> None:
        with Client(False, redis_server.address) as client:
            for i in range(40):
                ds = Dataset(uid)
                ds.add_tensor("a", np.full(1000, i))
                ds.add_tensor("b", np.full(1000, i))
                ds.add_meta_scalar("i", i)
                client.put_dataset(ds)
        stop.set()

    def reader() -> None:
        with Client(False, redis_server.address) as client:
            while not stop.is_set():
                try:
                    ds = client.get_dataset(uid)
                except RedisKeyError:
                    continue
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return
                seen.append((ds.get_meta_scalars("i")[0], ds.get_tensor("a")[0], ds.get_tensor("b")[-1]))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert seen and all(i == a == b for i, a, b in seen)


def test_dataset_bad_input() -> None:
    ds = Dataset("x")
    with pytest.raises(TypeError):
        Dataset(3)
    with pytest.raises(TypeError):
        ds.add_tensor("t", [1, 2])
    with pytest.raises(TypeError, match="scalar"):
        ds.add_meta_scalar("s", [1, 2])
    with pytest.raises(TypeError):
        ds.add_meta_scalar("s", "text")
    with pytest.raises(TypeError):
        ds.add_meta_string("s", 3)
    ds.add_meta_string("s", "a")
    with pytest.raises(RedisRuntimeError):
        ds.add_meta_scalar("s", 1)
    with pytest.raises(RedisKeyError):
        ds.get_tensor("missing")
    with pytest.raises(RedisKeyError):
        ds.get_meta_scalars("missing")


def test_list_aggregation_with_concurrent_producers(any_client: Client, redis_server, redis_cluster, uid: str) -> None:
    cluster = "Clustered" in str(any_client)
    address = redis_cluster.address if cluster else redis_server.address
    total = PRODUCERS * DATASETS_PER_PRODUCER
    consumed: list[Dataset] = []

    def produce(rank: int) -> None:
        with Client(cluster, address) as client:
            for i in range(DATASETS_PER_PRODUCER):
                ds = _dataset(f"{uid}_{rank}_{i}", seed=rank * 100 + i)
                client.put_dataset(ds)
                client.append_to_list(uid, ds)

    def consume() -> None:
        with Client(cluster, address) as client:
            assert client.poll_list_length_gte(uid, total, 20, 1500)
            consumed.extend(client.get_datasets_from_list(uid))

    threads = [threading.Thread(target=produce, args=(r,)) for r in range(PRODUCERS)]
    consumer = threading.Thread(target=consume)
    consumer.start()
    for t in threads:
        t.start()
    for t in threads + [consumer]:
        t.join()
    assert len(consumed) == total
    assert sorted(d.get_name() for d in consumed) == sorted(
        f"{uid}_{r}_{i}" for r in range(PRODUCERS) for i in range(DATASETS_PER_PRODUCER))
    for ds in consumed:
        _, rank, i = ds.get_name().rsplit("_", 2)
        _assert_same(_dataset(ds.get_name(), int(rank) * 100 + int(i)), ds)
    assert any_client.get_list_length(uid) == total
    assert any_client.poll_list_length(uid, total, 10, 1)
    assert any_client.poll_list_length_lte(uid, total, 10, 1)
    assert not any_client.poll_list_length_lte(uid, total - 1, 10, 2)
    assert len(any_client.get_dataset_list_range(uid, 0, 2)) == 3
    assert len(any_client.get_dataset_list_range(uid, -2, -1)) == 2
    assert any_client.get_dataset_list_range(uid, 5, 1) == []
    any_client.copy_list(uid, uid + "copy")
    any_client.rename_list(uid + "copy", uid + "moved")
    assert any_client.get_list_length(uid + "copy") == 0 and any_client.get_list_length(uid + "moved") == total
    any_client.delete_list(uid)
    assert any_client.get_list_length(uid) == 0 and any_client.get_datasets_from_list(uid) == []
    with pytest.raises(RedisKeyError):
        any_client.copy_list(uid, uid + "x")


def test_ensemble_prefixes(redis_server, raw, monkeypatch, uid: str) -> None:
    a, b = f"{uid}a", f"{uid}b"
    monkeypatch.setenv("SSDB", redis_server.address)
    monkeypatch.setenv("SSKEYOUT", a)
    monkeypatch.setenv("SSKEYIN", f"{a},{b}")
    producer = Client(None)
    producer.put_tensor("t", np.arange(3))
    ds = _dataset("d")
    producer.put_dataset(ds)
    producer.append_to_list("l", ds)
    producer.use_model_ensemble_prefix(True)
    producer.set_script("s", "def f(x):\n    return x\n")
    assert raw.exists(f"{a}.t") and raw.exists(f"{a}.{{d}}.meta") and raw.exists(f"{a}.l") and raw.exists(f"{a}.s")

    monkeypatch.setenv("SSKEYOUT", b)
    consumer = Client(None)
    np.testing.assert_array_equal(consumer.get_tensor("t"), np.arange(3))  # reads with SSKEYIN's first, a
    consumer.put_tensor("t", np.zeros(1))  # writes with b
    consumer.set_data_source(b)
    np.testing.assert_array_equal(consumer.get_tensor("t"), np.zeros(1))
    consumer.set_data_source(a)
    _assert_same(ds, consumer.get_dataset("d"))
    assert [d.get_name() for d in consumer.get_datasets_from_list("l")] == ["d"]
    assert not consumer.model_exists("s")  # model prefixing is off by default
    consumer.use_model_ensemble_prefix(True)
    assert consumer.model_exists("s")
    consumer.use_tensor_ensemble_prefix(False)
    consumer.put_tensor("plain", np.ones(1))
    assert raw.exists("plain")
    raw.delete("plain")
    consumer.use_dataset_ensemble_prefix(False)
    assert not consumer.dataset_exists("d")
    consumer.use_list_ensemble_prefix(False)
    assert consumer.get_list_length("l") == 0
    with pytest.raises(RedisRuntimeError, match="could not be found"):
        consumer.set_data_source("elsewhere")
    with pytest.raises(TypeError):
        consumer.use_tensor_ensemble_prefix("yes")
    producer.close()
    consumer.close()
