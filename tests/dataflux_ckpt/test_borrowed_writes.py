"""``write_borrowed``: whole parts go up from the caller's memory, without part buffers, and bytes
changed after a part was cut fail the upload instead of being stored."""

from __future__ import annotations

import random

import pytest

from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from dataflux_ckpt.checksums import crc32c_extend
from dataflux_ckpt.errors import DataCorruptionError, TransferError
from tests.support.gcs import client_for, object_names


@pytest.mark.parametrize("mode", ["xml", "composite"])
def test_whole_borrowed_parts_allocate_no_part_buffers(make_plugin, gcs_xml_server, gcs_bucket, mode):
    plugin = make_plugin(client_for(gcs_xml_server.url), upload_mode=mode)
    data = bytearray(random.Random(7).randbytes(5 * C + 11))
    path = f"gs://{gcs_bucket}/borrowed/{mode}.bin"
    with plugin.writer(path) as stream:
        stream.write(data[:3])  # a copied head: the first part needs a buffer
        stream.write_borrowed(memoryview(data)[3:])
    slots = []
    while not stream._free.empty():
        slots.append(stream._free.get())
    # Only the parts that start or end inside the borrowed bytes were copied: the first and the last.
    assert len([slot for slot in slots if slot is not None]) <= 2 < 6
    with plugin.reader(path) as reader:
        assert reader.read() == data


def test_a_borrowed_part_changed_after_it_was_cut_is_refused(make_plugin, gcs_xml_server, gcs_bucket):
    """The crc32c a part is sent with is taken when it is cut; the server refuses other bytes."""
    plugin = make_plugin(client_for(gcs_xml_server.url), upload_mode="xml")
    data = bytearray(random.Random(8).randbytes(3 * C))
    path = f"gs://{gcs_bucket}/borrowed/changed.bin"
    stream = plugin.writer(path)
    gcs = stream._gcs
    upload_part = gcs.xml_upload_part
    changed = data[C + 5] ^ 0xFF

    def change_then_upload(target, upload_id, number, part, crc, deadline):
        if number == 2:
            data[C + 5] = changed  # the caller broke its promise while the part was in flight
        return upload_part(target, upload_id, number, part, crc, deadline)

    gcs.xml_upload_part = change_then_upload
    try:
        with pytest.raises((DataCorruptionError, TransferError)), stream:
            stream.write_borrowed(data)
    finally:
        del gcs.xml_upload_part
    assert "borrowed/changed.bin" not in object_names(gcs_xml_server.url, gcs_bucket)


@pytest.mark.parametrize("size", [0, 1, C - 1, C, C + 1, 3 * C])
@pytest.mark.parametrize("mode", ["xml", "composite", "streaming"])
def test_a_writer_publishes_only_bytes_with_the_crc32c_it_requires(make_plugin, gcs_xml_server, gcs_bucket, mode, size):
    options = {"use_transfer_manager": False} if mode == "streaming" else {"upload_mode": mode}
    plugin = make_plugin(client_for(gcs_xml_server.url), **options)
    data = bytearray(random.Random(size).randbytes(size))
    changed = bytearray(data)
    if size:
        changed[size // 2] ^= 0x01
    required = crc32c_extend(0, data)
    good, bad = f"gs://{gcs_bucket}/required/{mode}-{size}.bin", f"gs://{gcs_bucket}/required/{mode}-{size}-changed.bin"
    with plugin.writer(good) as stream:
        stream.require_crc32c(required)
        stream.write_borrowed(data)
    with plugin.reader(good) as reader:
        assert reader.read() == data
    if not size:
        return  # no other bytes of that size
    stream = plugin.writer(bad)
    stream.require_crc32c(required)
    with pytest.raises(DataCorruptionError, match="they were written with"), stream:
        stream.write_borrowed(changed)
    names = object_names(gcs_xml_server.url, gcs_bucket)
    assert good.split("/", 3)[3] in names and bad.split("/", 3)[3] not in names
