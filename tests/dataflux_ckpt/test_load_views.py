"""Loads from GCS unpickle while the object arrives and hand out views of the downloaded buffer.

Whatever the checkpoint, ``DatafluxCheckpointIO.load_checkpoint`` returns what ``torch.load`` returns
for the same bytes (structure, dtypes, strides, values, storage sharing, refusals), refuses crafted
archives or loads them as ``torch.load`` does, and holds about one checkpoint of extra memory.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflux_ckpt import DatafluxCheckpointIO
from dataflux_ckpt.download import READ_BLOCK_BYTES
from dataflux_ckpt.errors import InvalidCheckpointError
from tests.fastpersist.test_crafted_archives import STATE as CRAFTED_STATE
from tests.fastpersist.test_crafted_archives import _apply, mutations
from tests.support.fork import exit_code_in_fork
from tests.support.fp_compare import (
    assert_loads_are_writable_and_independent,
    assert_loads_as_torch_load,
    assert_same,
)
from tests.support.gcs import LoopbackServer, client_for, ranged_read_ports
from tests.support.load_memory import load_peak

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.complex64]


@st.composite
def states(draw: st.DrawFn) -> dict[str, object]:
    """State dicts of plain tensors: several dtypes, empty ones, views and slices sharing a storage,
    non-contiguous ones, Parameters, nested containers."""
    state: dict[str, object] = OrderedDict()
    for index in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        numel = draw(st.sampled_from([0, 1, 7, 1000, 70_000]))
        base = (torch.arange(numel) % 251).to(dtype)
        kind = draw(st.sampled_from(["plain", "slice", "strided", "parameter", "shared"]))
        if kind == "slice" and numel > 2:
            state[f"t{index}"] = base[1:]
        elif kind == "strided" and numel >= 6:
            state[f"t{index}"] = base[: numel // 2 * 2].view(-1, 2).t()
        elif kind == "parameter" and dtype.is_floating_point:
            state[f"t{index}"] = torch.nn.Parameter(base, requires_grad=draw(st.booleans()))
        elif kind == "shared":
            state[f"t{index}"] = base
            state[f"t{index}_again"] = base[: max(numel - 1, 0)]
        else:
            state[f"t{index}"] = base
    if draw(st.booleans()):
        state["nested"] = {"list": [torch.ones(3), (torch.zeros(2, dtype=torch.int32), 5)], "step": 3}
    return state


def _put(plugin: DatafluxCheckpointIO, path: str, data: bytes) -> None:
    with plugin.writer(path) as stream:
        stream.write(data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=states(), weights_only=st.sampled_from([True, False, None]),
       map_location=st.sampled_from([None, "cpu", torch.device("cpu"), {"cpu": "cpu"}]),
       writer=st.sampled_from(["plugin", "torch.save"]))
def test_loads_match_torch_load(make_plugin, gcs_bucket, state, weights_only, map_location, writer):
    plugin = make_plugin()  # 256 KiB ranges: a checkpoint spans several
    path = f"gs://{gcs_bucket}/views/{writer}.ckpt"
    if writer == "plugin":
        plugin.save_checkpoint(state, path)
        with plugin.reader(path) as stream:
            data = stream.read()
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        _put(plugin, path, data)
    want = torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    got = plugin.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
    assert_same(got, want)


def test_loaded_tensors_are_writable_and_independent_of_another_load(ckpt_io, ckpt_path):
    assert_loads_are_writable_and_independent(lambda state: ckpt_io.save_checkpoint(state, ckpt_path),
                                              lambda: ckpt_io.load_checkpoint(ckpt_path))


def test_legacy_format_and_torchscript_archives_load_as_torch_load_does(ckpt_io, gcs_bucket):
    legacy = io.BytesIO()
    torch.save({"w": torch.arange(5)}, legacy, _use_new_zipfile_serialization=False)
    _put(ckpt_io, f"gs://{gcs_bucket}/views/legacy.ckpt", legacy.getvalue())
    assert_same(ckpt_io.load_checkpoint(f"gs://{gcs_bucket}/views/legacy.ckpt", weights_only=True),
                {"w": torch.arange(5)})
    scripted = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), scripted)
    _put(ckpt_io, f"gs://{gcs_bucket}/views/scripted.pt", scripted.getvalue())
    loaded = ckpt_io.load_checkpoint(f"gs://{gcs_bucket}/views/scripted.pt", weights_only=False)
    assert isinstance(loaded, torch.jit.ScriptModule)


@pytest.fixture(scope="module")
def crafted_original() -> bytes:
    buffer = io.BytesIO()
    torch.save(CRAFTED_STATE, buffer)
    return buffer.getvalue()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_crafted_record_sizes_are_refused_or_load_as_torch_load_does(make_plugin, gcs_bucket, crafted_original,
                                                                     data):
    plugin = make_plugin()
    changes = data.draw(mutations(crafted_original), label="changes")
    crafted = _apply(crafted_original, changes)
    path = f"gs://{gcs_bucket}/views/crafted.ckpt"
    _put(plugin, path, crafted)
    assert_loads_as_torch_load(crafted, lambda: plugin.load_checkpoint(path, weights_only=True),
                               InvalidCheckpointError, path)


_MAKE_PLUGIN = """
from dataflux_ckpt import DatafluxCheckpointIO
from google.cloud import storage
from google.auth.credentials import AnonymousCredentials

client = storage.Client(project="test", credentials=AnonymousCredentials(),
                        client_options={{"api_endpoint": {endpoint!r}}})
plugin = DatafluxCheckpointIO(storage_client=client)
"""


def test_a_load_holds_about_one_checkpoint_of_extra_memory(gcs_emulator, ckpt_io, ckpt_path, tmp_path):
    state = {f"layer{index}": torch.randn(2**20) for index in range(48)}  # 192 MiB
    ckpt_io.save_checkpoint(state, ckpt_path)
    del state
    measured = load_peak(_MAKE_PLUGIN.format(endpoint=gcs_emulator.url), ckpt_path,
                         env={**os.environ, "STORAGE_EMULATOR_HOST": gcs_emulator.url})
    # The downloaded buffer is the tensors' memory: about one checkpoint, where copying tensors out
    # of it held 1.6-1.7 checkpoints at the peak.
    assert measured["extra"] <= 1.2 * measured["bytes"], measured


class _HoldingProxy(LoopbackServer):
    """A proxy to the emulator that sends the first ``hold_after`` bytes of every object download,
    then holds the rest until :attr:`release` is set."""

    def __init__(self, upstream: str, hold_after: int) -> None:
        upstream_parts = urlsplit(upstream)
        self.release = threading.Event()
        self.holding = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                conn = http.client.HTTPConnection(upstream_parts.hostname, upstream_parts.port, timeout=30)
                try:
                    conn.request("GET", self.path, headers={k: v for k, v in self.headers.items()
                                                            if k.lower() not in ("host", "connection")})
                    response = conn.getresponse()
                    payload = response.read()
                    self.send_response(response.status)
                    for name, value in response.getheaders():
                        if name.lower() not in ("connection", "transfer-encoding", "content-length"):
                            self.send_header(name, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if "alt=media" not in self.path or len(payload) <= hold_after:
                        self.wfile.write(payload)
                        return
                    self.wfile.write(payload[:hold_after])
                    self.wfile.flush()
                    proxy.holding.set()
                    proxy.release.wait(60)
                    self.wfile.write(payload[hold_after:])
                finally:
                    conn.close()

        super().__init__(Handler)

    def __exit__(self, *exc: object) -> None:
        self.release.set()  # a held response ends before the server stops
        super().__exit__(*exc)


def _pread_while_held(stream, proxy: _HoldingProxy, size: int, offset: int) -> tuple[bool, bytes]:
    """``stream.pread(size, offset)`` while the proxy holds the rest of a response back: whether the
    read was still waiting 30 s in (the proxy is then released), and what it returned."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(stream.pread(size, offset)))
    reader.start()
    proxy.holding.wait(30)
    reader.join(30)
    held = reader.is_alive()
    proxy.release.set()
    reader.join()
    return held, got[0]


def test_bytes_are_served_as_they_arrive_not_when_their_range_is_complete(gcs_emulator, gcs_bucket, make_plugin):
    path = f"gs://{gcs_bucket}/views/held.bin"
    data = os.urandom(3 * READ_BLOCK_BYTES)
    _put(make_plugin(), path, data)
    # One range of three read blocks; the proxy holds the last block and a half back.
    with _HoldingProxy(gcs_emulator.url, hold_after=READ_BLOCK_BYTES + READ_BLOCK_BYTES // 2) as proxy:
        plugin = make_plugin(client=client_for(proxy.url), chunk_size=len(data), max_workers=1)
        with plugin.reader(path) as stream:
            held, got = _pread_while_held(stream, proxy, 1000, READ_BLOCK_BYTES - 1000)
            assert not held, "bytes of the first block were not served until the whole range arrived"
            assert got == data[READ_BLOCK_BYTES - 1000 : READ_BLOCK_BYTES]
            assert stream.pread(1000, len(data) - 1000) == data[-1000:]


def test_the_end_of_the_object_arrives_first(gcs_emulator, gcs_bucket, make_plugin):
    # A torch archive's zip directory is at its end, and a loader reads it before any record: the
    # end must not wait behind the range it would otherwise close.
    path = f"gs://{gcs_bucket}/views/tail.bin"
    data = os.urandom(3 * READ_BLOCK_BYTES)
    _put(make_plugin(), path, data)
    with _HoldingProxy(gcs_emulator.url, hold_after=2 * READ_BLOCK_BYTES) as proxy:
        plugin = make_plugin(client=client_for(proxy.url), chunk_size=len(data), max_workers=2)
        with plugin.reader(path) as stream:
            held, got = _pread_while_held(stream, proxy, 1000, len(data) - 1000)
            assert not held, "the end of the object waited for the rest of its range"
            assert got == data[-1000:]
            stream.verify()
            assert stream.pread(len(data), 0) == data


_SPANS_OBJECT = os.urandom(2 * 2**20 + 12_345)  # more than two tails long: the end gets a range of its own


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chunk_size=st.sampled_from([65_536, 300_001, 2**20, 1_500_000, len(_SPANS_OBJECT)]),
    spans=st.lists(st.tuples(st.integers(0, len(_SPANS_OBJECT) + 10), st.integers(0, len(_SPANS_OBJECT))),
                   min_size=1, max_size=8),
)
def test_any_span_reads_back_whatever_the_ranges(gcs_emulator, gcs_bucket, make_plugin, chunk_size, spans):
    path = f"gs://{gcs_bucket}/views/spans.bin"
    plugin = make_plugin(chunk_size=chunk_size, max_workers=3)
    _put(plugin, path, _SPANS_OBJECT)
    with plugin.reader(path) as stream:
        for offset, size in spans:
            assert stream.pread(size, offset) == _SPANS_OBJECT[offset : offset + size]
        stream.verify()


@contextlib.contextmanager
def _threads_started() -> Iterator[set[int]]:
    """The idents of the threads that ``threading`` starts inside the block."""
    started: set[int] = set()

    def first_event(frame: object, event: str, arg: object) -> None:
        started.add(threading.get_ident())
        sys.setprofile(None)  # once is enough: the thread has started

    threading.setprofile(first_event)
    try:
        yield started
    finally:
        threading.setprofile(None)


def test_loads_after_the_first_start_no_threads(ckpt_io, ckpt_path):
    # Starting a thread waits for the scheduler; on a busy machine that delayed every load's last ranges.
    state = {f"t{index}": torch.randn(100_000) for index in range(8)}  # 3.2 MB: many 256 KiB ranges
    ckpt_io.save_checkpoint(state, ckpt_path)
    assert_same(ckpt_io.load_checkpoint(ckpt_path), state)
    with _threads_started() as started:
        for _ in range(3):
            assert_same(ckpt_io.load_checkpoint(ckpt_path), state)
    assert not started


def test_concurrent_loads_share_the_transfer_threads_and_all_complete(ckpt_io, ckpt_path):
    state = {f"t{index}": torch.randn(50_000) for index in range(6)}
    ckpt_io.save_checkpoint(state, ckpt_path)
    results: list[object] = [None] * 6
    barrier = threading.Barrier(len(results))

    def load(index: int) -> None:
        barrier.wait(30)
        results[index] = ckpt_io.load_checkpoint(ckpt_path)

    loaders = [threading.Thread(target=load, args=(index,)) for index in range(len(results))]
    for thread in loaders:
        thread.start()
    for thread in loaders:
        thread.join(120)
    assert not any(thread.is_alive() for thread in loaders)
    for loaded in results:
        assert_same(loaded, state)


class _Abandon(Exception):
    pass


def test_a_reader_abandoned_behind_another_readers_held_ranges_returns_at_once(gcs_emulator, gcs_bucket,
                                                                                 make_plugin):
    first_path, second_path = f"gs://{gcs_bucket}/views/first.bin", f"gs://{gcs_bucket}/views/second.bin"
    data = os.urandom(3 * READ_BLOCK_BYTES)
    _put(make_plugin(), first_path, data)
    _put(make_plugin(), second_path, data[::-1])
    with _HoldingProxy(gcs_emulator.url, hold_after=READ_BLOCK_BYTES) as proxy:
        # One transfer thread: the first reader's held range occupies it, the second reader's wait behind.
        plugin = make_plugin(client=client_for(proxy.url), chunk_size=len(data), max_workers=1)
        first = plugin.reader(first_path)
        assert proxy.holding.wait(30)
        closed = threading.Event()

        def abandon_second() -> None:
            with pytest.raises(_Abandon), plugin.reader(second_path):
                raise _Abandon
            closed.set()

        closer = threading.Thread(target=abandon_second)
        closer.start()
        assert closed.wait(30), "closing a reader waited for ranges it no longer needs"
        closer.join()
        proxy.release.set()
        with first:
            assert first.pread(len(data), 0) == data
        with plugin.reader(second_path) as again:  # the threads still serve new readers
            assert again.pread(len(data), 0) == data[::-1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_loads_on_threads_and_connections_of_its_own(make_plugin, gcs_proxy, ckpt_path):
    # ddp_fork and ddp_notebook fork processes that keep the plugin: the parent's transfer threads did
    # not survive the fork (ranges queued to them would wait out the deadline), and its pooled
    # connections would be shared by every child.
    plugin = make_plugin(client=client_for(gcs_proxy.url), deadline_s=20)
    state = {f"t{index}": torch.randn(100_000) for index in range(4)}
    plugin.save_checkpoint(state, ckpt_path)  # its part uploads leave connections in the pool
    assert_same(plugin.load_checkpoint(ckpt_path), state)  # and its ranged reads start the transfer threads
    assert plugin.gcs.wait_background(30)  # the save's clean-up is over: the parent sends nothing more
    parent_ports = {request.client_port for request in gcs_proxy.requests}
    before = len(gcs_proxy.requests)

    def child() -> bool:
        loaded = plugin.load_checkpoint(ckpt_path)
        return all(torch.equal(loaded[name], tensor) for name, tensor in state.items())

    assert exit_code_in_fork(child) == 0
    child_ports = {request.client_port for request in gcs_proxy.requests[before:]}
    assert child_ports and not child_ports & parent_ports, "the child sent requests on the parent's connections"


def test_ranged_reads_hand_their_connections_back(make_plugin, gcs_proxy, ckpt_path):
    # Each range's connection goes back to the pool once its body is read: on GCS a connection per
    # range would cost a TLS handshake per range.
    plugin = make_plugin(client=client_for(gcs_proxy.url), max_workers=1)
    state = {f"t{index}": torch.randn(200_000) for index in range(4)}  # 3.2 MB: a dozen ranges
    plugin.save_checkpoint(state, ckpt_path)
    assert plugin.gcs.wait_background(30)
    before = len(gcs_proxy.requests)
    assert_same(plugin.load_checkpoint(ckpt_path), state)
    ports = ranged_read_ports(gcs_proxy.requests[before:])
    assert len(ports) >= 10
    assert len(set(ports)) == 1, "a ranged read did not reuse the connection"
