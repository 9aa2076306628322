"""Checkpoint loads from Redis hand out views of the fetched value instead of copying every byte again.

Whatever the checkpoint, ``SmartRedisCheckpointIO.load_checkpoint`` returns what ``torch.load`` returns
for the same bytes (structure, dtypes, strides, values, storage sharing, refusals), refuses crafted
archives or loads them as ``torch.load`` does, and holds about one checkpoint of extra memory.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smartredis_io import SmartRedisCheckpointIO
from smartredis_io.lightning.filesystem import RedisFileSystem
from tests.dataflux_ckpt.test_load_views import states
from tests.fastpersist.test_crafted_archives import STATE as CRAFTED_STATE
from tests.fastpersist.test_crafted_archives import _apply, mutations
from tests.support.fp_compare import assert_same

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
    plugin.save_checkpoint({"a": torch.zeros(100_000), "b": torch.ones(10)}, key)
    first = plugin.load_checkpoint(key)
    second = plugin.load_checkpoint(key)
    first["a"] += 5
    first["b"].mul_(3)
    assert torch.equal(second["a"], torch.zeros(100_000)) and torch.equal(second["b"], torch.ones(10))
    assert torch.equal(first["a"], torch.full((100_000,), 5.0)) and torch.equal(first["b"], torch.full((10,), 3.0))


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


@pytest.fixture(scope="module")
def crafted_original() -> bytes:
    buffer = io.BytesIO()
    torch.save(CRAFTED_STATE, buffer)
    return buffer.getvalue()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_crafted_record_sizes_are_refused_or_load_as_torch_load_does(plugin, redis_server, crafted_original, data):
    changes = data.draw(mutations(crafted_original), label="changes")
    crafted = _apply(crafted_original, changes)
    key = f"views-{uuid.uuid4().hex[:8]}/crafted.ckpt"
    _put(redis_server, key, crafted)
    expected, refused = None, False
    try:
        expected = torch.load(io.BytesIO(crafted), weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal by torch.load: the plugin must refuse too
        refused = True
    try:
        got = plugin.load_checkpoint(key, weights_only=True)
    except Exception as err:  # noqa: BLE001 - refused: it must say which checkpoint
        assert refused or key in str(err), f"the plugin refused what torch.load loads ({changes}): {err!r}"
        return
    assert not refused, f"torch.load refuses {changes}, the plugin returned {got!r}"
    assert_same(got, expected)


_MEASURE = textwrap.dedent("""
    import json, sys
    import torch
    from smartredis_io import SmartRedisCheckpointIO

    plugin = SmartRedisCheckpointIO(sys.argv[1])

    def rss_kib(field):
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident size starts again from the current one
    before = rss_kib("VmRSS")
    loaded = plugin.load_checkpoint(sys.argv[2])
    peak = rss_kib("VmHWM")
    total = sum(t.numel() * t.element_size() for t in loaded.values())
    plugin.teardown()
    print(json.dumps({"extra": (peak - before) * 1024, "bytes": total}))
""")


def test_a_load_holds_about_one_checkpoint_of_extra_memory(redis_server, tmp_path):
    key = f"views-{uuid.uuid4().hex[:8]}/big.ckpt"
    saver = SmartRedisCheckpointIO(redis_server.address)
    saver.save_checkpoint({f"layer{index}": torch.randn(2**20) for index in range(48)}, key)  # 192 MiB
    saver.teardown()
    out = subprocess.run([sys.executable, "-c", _MEASURE, redis_server.address, key], capture_output=True,
                         text=True, timeout=300, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    # A copy per byte (the fetched value, then torch.load's tensors) would be twice the checkpoint.
    assert measured["extra"] < 1.4 * measured["bytes"], measured
