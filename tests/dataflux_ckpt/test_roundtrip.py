"""Byte-exact round trips through the real emulator (and the XML multipart server), for sizes around
the part size."""

from __future__ import annotations

import io
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflux_ckpt import DatafluxCheckpointIO, ObjectWriter, StreamingWriter, reader, writer
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from dataflux_ckpt.upload import MAX_COMPOSE_SOURCES, PARTS_SUFFIX
from tests.support.gcs import client_for, object_names

SIZES = [0, 1, C - 1, C, C + 1, 5 * C + 3, (MAX_COMPOSE_SOURCES + 9) * C + 17]


def _payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _names(plugin: DatafluxCheckpointIO, url: str, bucket: str) -> list[str]:
    """Every object in ``bucket``, once the plugin's background deletion of part objects is done."""
    plugin.teardown()
    return object_names(url, bucket)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.sampled_from(SIZES), seed=st.integers(0, 2**16),
       path=st.sampled_from(["composite", "xml", "stream"]),
       write_block=st.sampled_from([1 << 12, C - 5, 3 * C]), borrow=st.booleans())
def test_round_trip_is_byte_exact(make_plugin, gcs_xml_server, gcs_bucket, size, seed, path, write_block, borrow):
    transfer_manager = path != "stream"
    mode = "xml" if path == "xml" else "composite"
    plugin = make_plugin(client_for(gcs_xml_server.url), use_transfer_manager=transfer_manager, upload_mode=mode)
    path = f"gs://{gcs_bucket}/rt/{size}-{seed}.bin"
    data = _payload(size, seed)
    with plugin.writer(path) as stream:
        assert isinstance(stream, ObjectWriter if transfer_manager else StreamingWriter)
        for start in range(0, size, write_block):
            block = memoryview(data)[start : start + write_block]
            stream.write_borrowed(block) if borrow else stream.write(block)
    with plugin.reader(path) as stream:
        assert stream.size == size
        assert stream.read() == data
        stream.seek(size // 2)
        assert stream.read(7) == data[size // 2 : size // 2 + 7]
    assert not [n for n in _names(plugin, gcs_xml_server.url, gcs_bucket) if PARTS_SUFFIX in n]


def test_compose_tree_for_more_than_32_parts(make_plugin, gcs_emulator, gcs_bucket):
    """The emulator, as GCS, refuses a compose of more than 32 sources: 41 parts need a tree."""
    plugin = make_plugin(upload_mode="composite")
    data = _payload(SIZES[-1], 1)
    with plugin.writer(f"gs://{gcs_bucket}/tree.bin") as stream:
        stream.write(data)
    with plugin.reader(f"gs://{gcs_bucket}/tree.bin") as stream:
        assert stream.read() == data
    assert _names(plugin, gcs_emulator.url, gcs_bucket) == ["tree.bin"]


def test_torch_save_and_load_through_module_level_file_likes(gcs_emulator, gcs_bucket):
    state = {"w": torch.randn(300, 300), "step": 3, "nested": {"b": torch.arange(10)}}
    path = f"gs://{gcs_bucket}/sd.pt"
    with writer(path, chunk_size=C) as stream:
        torch.save(state, stream)
    with reader(path, chunk_size=C) as stream:
        loaded = torch.load(stream, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert torch.equal(loaded["nested"]["b"], state["nested"]["b"])


@pytest.mark.parametrize("transfer_manager", [True, False])
def test_failed_serialization_publishes_nothing_and_keeps_previous(make_plugin, gcs_emulator, gcs_bucket,
                                                                   transfer_manager):
    plugin = make_plugin(use_transfer_manager=transfer_manager)
    path = f"gs://{gcs_bucket}/keep.ckpt"
    plugin.save_checkpoint({"v": 1}, path)
    with pytest.raises(RuntimeError, match="boom"), plugin.writer(path) as stream:
        stream.write(b"x" * (3 * C + 5))
        raise RuntimeError("boom")
    assert _names(plugin, gcs_emulator.url, gcs_bucket) == ["keep.ckpt"]
    assert plugin.load_checkpoint(path) == {"v": 1}


def test_missing_object_raises_file_not_found_naming_path(ckpt_io, gcs_bucket):
    path = f"gs://{gcs_bucket}/nope/missing.ckpt"
    with pytest.raises(FileNotFoundError, match=path):
        ckpt_io.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=path):
        ckpt_io.reader(path)


def test_remove_checkpoint_deletes_object_and_tolerates_missing(ckpt_io, ckpt_path, gcs_emulator, gcs_bucket):
    ckpt_io.save_checkpoint({"a": 1}, ckpt_path)
    assert ckpt_io.list_checkpoints(f"gs://{gcs_bucket}/") == [ckpt_path]
    ckpt_io.remove_checkpoint(ckpt_path)
    ckpt_io.remove_checkpoint(ckpt_path)
    assert ckpt_io.list_checkpoints(f"gs://{gcs_bucket}/") == []
    assert _names(ckpt_io, gcs_emulator.url, gcs_bucket) == []


def test_storage_options_are_refused(ckpt_io, ckpt_path):
    with pytest.raises(TypeError, match="storage_options"):
        ckpt_io.save_checkpoint({}, ckpt_path, storage_options={"x": 1})


def test_writer_is_a_file_like_for_torch(ckpt_io, ckpt_path):
    stream = ckpt_io.writer(ckpt_path)
    assert stream.writable() and not stream.readable()
    buffer = io.BytesIO()
    torch.save({"t": torch.ones(3)}, buffer)
    with stream:
        torch.save({"t": torch.ones(3)}, stream)
        assert stream.tell() == len(buffer.getvalue())


def test_load_passes_map_location_and_weights_only(ckpt_io, ckpt_path):
    ckpt_io.save_checkpoint({"t": torch.ones(2), "obj": io.BytesIO}, ckpt_path)
    seen = []
    loaded = ckpt_io.load_checkpoint(ckpt_path, map_location=lambda s, loc: seen.append(loc) or s, weights_only=False)
    assert seen == ["cpu"] and loaded["obj"] is io.BytesIO
    with pytest.raises(Exception, match="[Ww]eights only"):
        ckpt_io.load_checkpoint(ckpt_path, weights_only=True)
