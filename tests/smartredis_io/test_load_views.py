"""SmartRedisCheckpointIO loads tensors as views of the value it fetched from Redis, not as copies.

Checked against ``torch.load`` of the same bytes, whichever wrote them (the plugin, or
``TorchCheckpointIO`` through the ``redis://`` filesystem): the same objects and refusals, crafted
archives refused or loaded alike, and a peak of about one checkpoint of extra memory.
"""

from __future__ import annotations

import io
import pickle
import uuid
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflux_ckpt import InvalidCheckpointError as DatafluxInvalidCheckpointError
from smartredis_io import InvalidCheckpointError, SmartRedisCheckpointIO
from smartredis_io.lightning.filesystem import RedisFileSystem
from tests.dataflux_ckpt.test_load_views import crafted_original, states  # noqa: F401 - a fixture
from tests.fastpersist.test_crafted_archives import _apply, mutations
from tests.support.fp_compare import (
    assert_loads_are_writable_and_independent,
    assert_loads_as_torch_load,
    assert_same,
)
from tests.support.load_memory import load_peak

SMALL_CHUNK = 64 * 1024  # a checkpoint of these tests spans several chunks


@pytest.fixture
def plugin(redis_server) -> SmartRedisCheckpointIO:
    io_ = SmartRedisCheckpointIO(redis_server.address, chunk_bytes=SMALL_CHUNK)
    yield io_
    io_.teardown()


def _put(redis_server, key: str, data: bytes) -> None:
    """Store ``data`` at ``key`` as a file is stored there (what ``TorchCheckpointIO`` on redis:// writes)."""
    RedisFileSystem(address=redis_server.address).pipe_file(f"redis://{key}", data)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states(), weights_only=st.sampled_from([True, False, None]),
       map_location=st.sampled_from([None, "cpu", torch.device("cpu"), {"cpu": "cpu"}]),
       writer=st.sampled_from(["plugin", "torch.save"]))
def test_loads_match_torch_load(plugin, redis_server, state, weights_only, map_location, writer):
    key = f"views-{uuid.uuid4().hex[:8]}/{writer}.ckpt"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    if writer == "plugin":
        plugin.save_checkpoint(state, key)
    else:
        _put(redis_server, key, data)
    want = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    got = plugin.load_checkpoint(key, map_location=map_location, weights_only=weights_only)
    assert_same(got, want)


def test_loaded_tensors_are_writable_and_independent_of_another_load(plugin):
    key = f"views-{uuid.uuid4().hex[:8]}.ckpt"
    assert_loads_are_writable_and_independent(lambda state: plugin.save_checkpoint(state, key),
                                              lambda: plugin.load_checkpoint(key))


def test_legacy_format_and_torchscript_archives_load_as_torch_load_does(plugin, redis_server):
    prefix = f"views-{uuid.uuid4().hex[:8]}"
    legacy = io.BytesIO()
    torch.save({"w": torch.arange(5)}, legacy, _use_new_zipfile_serialization=False)
    _put(redis_server, f"{prefix}/legacy.ckpt", legacy.getvalue())
    assert_same(plugin.load_checkpoint(f"{prefix}/legacy.ckpt", weights_only=True), {"w": torch.arange(5)})
    scripted = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), scripted)
    _put(redis_server, f"{prefix}/scripted.pt", scripted.getvalue())
    assert isinstance(plugin.load_checkpoint(f"{prefix}/scripted.pt", weights_only=False), torch.jit.ScriptModule)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_crafted_record_sizes_are_refused_or_load_as_torch_load_does(plugin, redis_server, crafted_original,  # noqa: F811
                                                                     data):
    changes = data.draw(mutations(crafted_original), label="changes")
    crafted = _apply(crafted_original, changes)
    key = f"views-{uuid.uuid4().hex[:8]}/crafted.ckpt"
    _put(redis_server, key, crafted)
    assert_loads_as_torch_load(crafted, lambda: plugin.load_checkpoint(key, weights_only=True),
                               (InvalidCheckpointError, pickle.UnpicklingError), key)


@pytest.mark.parametrize("damage", ["not a torch archive", "truncated", "an archive without data.pkl"])
def test_a_damaged_checkpoint_is_refused_with_a_typed_error_naming_its_key(plugin, redis_server, damage):
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(1000.0)}, buffer)
    whole = buffer.getvalue()
    if damage == "not a torch archive":
        data = b"no checkpoint here " * 100
    elif damage == "truncated":
        data = whole[: len(whole) // 2]
    else:
        renamed = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(whole)) as source, zipfile.ZipFile(renamed, "w") as target:
            for item in source.infolist():
                target.writestr(item.filename.replace("data.pkl", "other.pkl"), source.read(item))
        data = renamed.getvalue()
    key = f"views-{uuid.uuid4().hex[:8]}/damaged.ckpt"
    _put(redis_server, key, data)
    with pytest.raises(InvalidCheckpointError) as caught:
        plugin.load_checkpoint(key, weights_only=True)
    assert key in str(caught.value) and redis_server.address in str(caught.value)
    # the error all plugins share, and a ValueError as torch's own refusals of such bytes are
    assert isinstance(caught.value, ValueError) and issubclass(DatafluxInvalidCheckpointError, InvalidCheckpointError)


def test_a_load_holds_about_one_checkpoint_of_extra_memory(redis_server):
    key = f"views-{uuid.uuid4().hex[:8]}/big.ckpt"
    saver = SmartRedisCheckpointIO(redis_server.address)
    saver.save_checkpoint({f"layer{index}": torch.randn(2**20) for index in range(48)}, key)  # 192 MiB
    saver.teardown()
    make_plugin = f"from smartredis_io import SmartRedisCheckpointIO\nplugin = SmartRedisCheckpointIO({redis_server.address!r})"
    measured = load_peak(make_plugin, key)
    # A copy per byte (the fetched value, then torch.load's tensors) would be twice the checkpoint.
    assert measured["extra"] < 1.4 * measured["bytes"], measured
