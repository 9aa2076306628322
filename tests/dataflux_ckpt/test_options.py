"""``TransferOptions``: checked once with errors naming the field, frozen, and one object giving the
plugin, the DCP writer and reader and the strategies the same settings, over a real fake-gcs-server."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import re
import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import dataflux_ckpt
from dataflux_ckpt import (
    DatafluxCheckpointIO,
    DatafluxFSDPStrategy,
    DatafluxModelParallelStrategy,
    DatafluxStorageReader,
    DatafluxStorageWriter,
    RetryPolicy,
    TransferOptions,
)
from dataflux_ckpt.dcp import GcsItemInfo
from dataflux_ckpt.options import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from tests.support.gcs import FAST_RETRY

BYTE_COUNTS = ("chunk_size", "max_workers", "stream_chunk_size", "block_size")
SECONDS = ("deadline_s", "request_timeout_s", "cleanup_timeout_s")
# The individual keyword arguments each surface takes besides ``options``.
PLUGIN_FIELDS = ("chunk_size", "max_workers", "stream_chunk_size", "upload_mode", "retry", *SECONDS)
WRITER_FIELDS = ("chunk_size", "max_workers", "upload_mode", "block_size", "retry", "deadline_s")
READER_FIELDS = ("chunk_size", "max_workers", "coalesce_gap", "retry", "deadline_s")
GS_PATH = "gs://bkt/run/step-1"

not_numbers = st.one_of(st.booleans(), st.text(max_size=5), st.just(None), st.lists(st.integers(), max_size=2))


@st.composite
def refused(draw: st.DrawFn) -> tuple[str, Any, type[Exception]]:
    """A field, a value it must refuse, and the error type that names it."""
    name = draw(st.sampled_from((*BYTE_COUNTS, "coalesce_gap", *SECONDS, "upload_mode", "retry")))
    if name in BYTE_COUNTS or name == "coalesce_gap":
        lowest = 0 if name == "coalesce_gap" else 1
        return draw(st.one_of(
            st.tuples(st.just(name), st.integers(max_value=lowest - 1), st.just(ValueError)),
            st.tuples(st.just(name), st.one_of(not_numbers, st.floats(allow_nan=True)), st.just(TypeError)),
        ))
    if name in SECONDS:
        return draw(st.one_of(
            st.tuples(st.just(name), st.one_of(st.floats(max_value=0.0), st.integers(max_value=0),
                                               st.sampled_from([math.nan, math.inf, -math.inf])), st.just(ValueError)),
            st.tuples(st.just(name), not_numbers, st.just(TypeError)),
        ))
    if name == "upload_mode":
        return draw(st.one_of(
            st.tuples(st.just(name), st.text(max_size=12).filter(lambda m: m not in ("auto", "xml", "composite")),
                      st.just(ValueError)),
            st.tuples(st.just(name), st.one_of(st.integers(), st.booleans(), st.binary(max_size=4)), st.just(TypeError)),
        ))
    return name, draw(st.one_of(st.integers(), st.text(max_size=5), st.just({"attempts": 2}))), TypeError


@settings(max_examples=300, deadline=None)
@given(case=refused())
def test_every_field_refuses_its_boundaries_with_an_error_naming_it(case: tuple[str, Any, type[Exception]]) -> None:
    name, value, error = case
    with pytest.raises(error, match=rf"^TransferOptions\.{name} must be .*, not .*{re.escape(repr(value)[:20])}"):
        TransferOptions(**{name: value})


@settings(max_examples=100, deadline=None)
@given(case=refused())
def test_each_surface_refuses_what_the_options_refuse(case: tuple[str, Any, type[Exception]]) -> None:
    """The individual keyword arguments go through the same checks: same error type, same field named."""
    name, value, error = case
    surfaces = [(DatafluxCheckpointIO, (), PLUGIN_FIELDS), (DatafluxStorageWriter, (GS_PATH,), WRITER_FIELDS),
                (DatafluxStorageReader, (GS_PATH,), READER_FIELDS)]
    for cls, args, fields in surfaces:
        if name in fields and value is not None:  # None means "not given"
            with pytest.raises(error, match=rf"TransferOptions\.{name} "):
                cls(*args, **{name: value})


def test_stream_chunks_are_whole_multiples_of_256_kib() -> None:
    assert TransferOptions(stream_chunk_size=3 * C).stream_chunk_size == 3 * C
    for bad in (C - 1, C + 1, 1000):
        with pytest.raises(ValueError, match=rf"TransferOptions\.stream_chunk_size must be a multiple of {C} .*{bad}"):
            TransferOptions(stream_chunk_size=bad)


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 2**40), gap=st.integers(0, 2**40), seconds=st.one_of(
    st.floats(min_value=1e-6, max_value=1e9), st.integers(1, 10**9)), mode=st.sampled_from(["auto", "xml", "composite"]))
def test_values_inside_the_boundaries_are_kept_as_given(count: int, gap: int, seconds: float, mode: str) -> None:
    options = TransferOptions(chunk_size=count, max_workers=count, block_size=count, stream_chunk_size=count * C,
                              coalesce_gap=gap, deadline_s=seconds, request_timeout_s=seconds,
                              cleanup_timeout_s=seconds, upload_mode=mode)
    assert (options.chunk_size, options.coalesce_gap, options.deadline_s, options.upload_mode) == \
        (count, gap, seconds, mode)


def test_options_are_frozen_and_so_are_the_attributes_read_from_them() -> None:
    options = TransferOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.chunk_size = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        DatafluxCheckpointIO(options=options).chunk_size = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        DatafluxStorageWriter(GS_PATH, options=options).max_workers = 1  # type: ignore[misc]
    changed = options.replace(chunk_size=2**20)
    assert (changed.chunk_size, options.chunk_size) == (2**20, dataflux_ckpt.CHUNK_SIZE_BYTES)
    with pytest.raises(ValueError, match=r"TransferOptions\.max_workers must be positive, not 0"):
        options.replace(max_workers=0)


def test_defaults_are_todays_defaults() -> None:
    options = TransferOptions()
    assert DatafluxCheckpointIO().options == options
    assert DatafluxStorageWriter(GS_PATH).options == options
    assert DatafluxStorageReader(GS_PATH).options == options
    assert (options.chunk_size, options.max_workers, options.stream_chunk_size, options.upload_mode, options.retry,
            options.deadline_s) == (32 * 2**20, 8, 128 * 2**20, "auto", RetryPolicy(), 1800.0)


def test_an_individual_option_that_conflicts_with_the_options_is_a_type_error() -> None:
    options = TransferOptions(chunk_size=2**20, deadline_s=60.0)
    for make in (lambda **kw: DatafluxCheckpointIO(options=options, **kw),
                 lambda **kw: DatafluxStorageWriter(GS_PATH, options=options, **kw),
                 lambda **kw: DatafluxStorageReader(GS_PATH, options=options, **kw)):
        with pytest.raises(TypeError, match=r"chunk_size=4096 \(options\.chunk_size=1048576\) conflicts"):
            make(chunk_size=4096)
        with pytest.raises(TypeError, match=r"deadline_s=5\.0 \(options\.deadline_s=60\.0\) conflicts"):
            make(deadline_s=5.0)
        assert make(chunk_size=2**20).options is options  # the same value twice is no conflict
    with pytest.raises(TypeError, match="options must be a TransferOptions, not dict"):
        DatafluxCheckpointIO(options={"chunk_size": 2**20})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reader_options: max_workers=2 \(options\.max_workers=8\) conflicts"):
        DatafluxModelParallelStrategy(options=TransferOptions(), reader_options={"max_workers": 2})
    with pytest.raises(ValueError, match=r"TransferOptions\.block_size must be positive, not -1"):
        DatafluxModelParallelStrategy(writer_options={"block_size": -1})  # at construction, not at the first save


def test_writers_and_readers_with_options_pickle_and_copy() -> None:
    """``dcp.async_save`` pickles or copies its writer; the options travel with it."""
    options = TransferOptions(chunk_size=2**20, max_workers=3, block_size=4096, coalesce_gap=0, retry=FAST_RETRY)
    for obj in (DatafluxStorageWriter(GS_PATH, options=options), DatafluxStorageReader(GS_PATH, options=options),
                DatafluxCheckpointIO(options=options)):
        for clone in (pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj)):
            assert clone.options == options
            assert (clone.chunk_size, clone.max_workers, clone.retry) == (2**20, 3, FAST_RETRY)


@pytest.mark.parametrize("strategy", [DatafluxFSDPStrategy, DatafluxModelParallelStrategy])
def test_one_options_object_gives_every_surface_the_same_settings(gcs_bucket: str, strategy: type) -> None:
    options = TransferOptions(chunk_size=C, max_workers=3, upload_mode="composite", block_size=4096, coalesce_gap=512,
                              retry=FAST_RETRY, deadline_s=120.0, request_timeout_s=20.0, cleanup_timeout_s=5.0)
    path = f"gs://{gcs_bucket}/run"
    plugin = DatafluxCheckpointIO(options=options)
    made = strategy(options=options, writer_options={"overwrite": False})
    surfaces = [plugin, DatafluxStorageWriter(path, options=options), DatafluxStorageReader(path, options=options),
                made.storage_writer(path), made.storage_reader(path)]
    try:
        for surface in surfaces:
            assert surface.options is options
            assert (surface.chunk_size, surface.max_workers, surface.retry, surface.deadline_s) == \
                (C, 3, FAST_RETRY, 120.0)
            gcs = surface.gcs if surface is plugin else surface._connection.gcs
            assert (gcs.retry, gcs.request_timeout_s, gcs.connect_timeout_s) == (FAST_RETRY, 20.0, 10.0)
        assert surfaces[3].overwrite is False and surfaces[3].upload_mode == "composite"
        assert (surfaces[3].block_size, surfaces[4].coalesce_gap) == (4096, 512)
    finally:
        plugin.teardown()


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group exists
def test_save_and_load_through_fake_gcs_server_with_options(gcs_bucket: str) -> None:
    options = TransferOptions(chunk_size=C, max_workers=3, stream_chunk_size=C, block_size=4096, coalesce_gap=0,
                              retry=FAST_RETRY, deadline_s=120.0)
    checkpoint = {"weights": torch.randn(300_000), "step": 7}  # 1.2 MB: several parts of 256 KiB
    plugin = DatafluxCheckpointIO(options=options)
    try:
        path = f"gs://{gcs_bucket}/run/last.ckpt"
        plugin.save_checkpoint(checkpoint, path)
        loaded = plugin.load_checkpoint(path)
        assert loaded["step"] == 7 and torch.equal(loaded["weights"], checkpoint["weights"])
    finally:
        plugin.teardown()

    prefix = f"gs://{gcs_bucket}/dcp-{uuid.uuid4().hex[:6]}"
    state = {"a": torch.arange(100_000, dtype=torch.float32), "b": torch.randn(7, 13)}
    dcp.save(state, storage_writer=DatafluxStorageWriter(prefix, options=options))
    reader = DatafluxStorageReader(prefix, options=options)
    stored = reader.read_metadata().storage_data
    assert {info.block_size for info in stored.values() if isinstance(info, GcsItemInfo)} == {4096}
    loaded_state = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(loaded_state, storage_reader=reader)
    assert all(torch.equal(loaded_state[key], value) for key, value in state.items())
