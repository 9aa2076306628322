"""Faults over real HTTP: retried parts, XML multipart uploads, corruption, background clean-up."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from dataflux_ckpt import DataCorruptionError, TransferError
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from dataflux_ckpt.upload import PARTS_SUFFIX, XML_MIN_PART_BYTES
from tests.support.gcs import client_for, object_names, uploads_in_progress


def _data(size: int) -> bytes:
    return random.Random(size).randbytes(size)


@pytest.mark.parametrize("fault", [503, 429, "reset"])
def test_part_failing_once_is_retried(gcs_proxy, gcs_emulator, gcs_bucket, fault, make_plugin):
    gcs_proxy.fault = lambda r, seen: fault if "000002" in r.path and seen == 1 else None
    plugin = make_plugin(gcs_proxy.client(), upload_mode="composite")
    data = _data(4 * C + 1)
    with plugin.writer(f"gs://{gcs_bucket}/r.bin") as stream:
        stream.write(data)
    with plugin.reader(f"gs://{gcs_bucket}/r.bin") as stream:
        assert stream.read() == data
    plugin.teardown()
    assert object_names(gcs_emulator.url, gcs_bucket) == ["r.bin"]


def test_part_that_keeps_failing_fails_the_save_naming_bucket_key_part(gcs_proxy, gcs_emulator, gcs_bucket,
                                                                       make_plugin):
    gcs_proxy.fault = lambda r, seen: 503 if "000003" in r.path else None
    plugin = make_plugin(gcs_proxy.client(), upload_mode="composite")
    path = f"gs://{gcs_bucket}/dir/fail.ckpt"
    with pytest.raises(TransferError, match=rf"part 3 of {path} \(bucket {gcs_bucket}, key dir/fail.ckpt\)"):
        plugin.save_checkpoint({"w": torch.randn(6 * C // 4)}, path)
    plugin.teardown()
    assert object_names(gcs_emulator.url, gcs_bucket) == []


def test_ranged_read_failing_once_is_retried(gcs_proxy, gcs_bucket, make_plugin):
    plugin = make_plugin(gcs_proxy.client())
    plugin.save_checkpoint({"w": torch.arange(C)}, f"gs://{gcs_bucket}/g.ckpt")
    gcs_proxy.fault = lambda r, seen: "reset" if "alt=media" in r.path and seen == 1 else None
    assert torch.equal(plugin.load_checkpoint(f"gs://{gcs_bucket}/g.ckpt")["w"], torch.arange(C))


@pytest.mark.parametrize("transfer_manager", [True, False])
def test_corrupted_download_is_detected_not_loaded(gcs_proxy, gcs_bucket, transfer_manager, make_plugin):
    plugin = make_plugin(gcs_proxy.client(), use_transfer_manager=transfer_manager)
    path = f"gs://{gcs_bucket}/c.ckpt"
    plugin.save_checkpoint({"w": torch.zeros(C)}, path)
    # Flip one byte of the range that holds tensor bytes (not the zip directory).
    gcs_proxy.fault = lambda r, seen: "corrupt" if "alt=media" in r.path and r.method == "GET" and seen == 1 else None
    with pytest.raises(DataCorruptionError, match="crc32c"):
        plugin.load_checkpoint(path)
    stream = plugin.reader(path)  # the fault fires once per URL+range; fetch again cleanly
    assert stream.read(4) == b"PK\x03\x04"
    stream.close()


@pytest.mark.parametrize("fault", [503, "corrupt-request"])
def test_xml_multipart_upload_over_http(xml_proxy, gcs_xml_server, gcs_bucket, make_plugin, fault):
    """Parts through the XML multipart server; part 2 fails once (or arrives damaged) and is sent again."""
    plugin = make_plugin(xml_proxy.client(), upload_mode="xml")
    data = _data(5 * C + 11)
    path = f"gs://{gcs_bucket}/xml/obj.bin"
    if fault == "corrupt-request":
        xml_proxy.corrupt_request = lambda r, seen: "partNumber=2&" in r.path and seen == 1
    else:
        xml_proxy.fault = lambda r, seen: fault if "partNumber=2&" in r.path and seen == 1 else None
    with plugin.writer(path) as stream:
        stream.write(data)
    with plugin.reader(path) as stream:
        assert stream.read() == data
    plugin.teardown()
    assert object_names(gcs_xml_server.url, gcs_bucket) == ["xml/obj.bin"]  # no part objects
    assert uploads_in_progress(gcs_xml_server.url, gcs_bucket) == []


def test_auto_mode_probes_xml_multipart_once_per_bucket(gcs_xml_server, gcs_emulator, gcs_bucket, make_plugin):
    data = _data(2 * XML_MIN_PART_BYTES + 7)
    on_xml = make_plugin(client_for(gcs_xml_server.url), chunk_size=XML_MIN_PART_BYTES, upload_mode="auto")
    on_emulator = make_plugin(client_for(gcs_emulator.url), chunk_size=XML_MIN_PART_BYTES, upload_mode="auto")
    for plugin, prefix in ((on_xml, "xml"), (on_emulator, "emulator")):
        for name in ("a.bin", "b.bin"):
            with plugin.writer(f"gs://{gcs_bucket}/{prefix}/{name}") as stream:
                stream.write(data)
            with plugin.reader(f"gs://{gcs_bucket}/{prefix}/{name}") as stream:
                assert stream.read() == data
    assert on_xml.gcs.upload_mode(gcs_bucket) == "xml"
    assert on_emulator.gcs.upload_mode(gcs_bucket) == "composite"
    on_emulator.gcs.reset_upload_modes()
    assert on_emulator.gcs.upload_mode(gcs_bucket) is None
    for plugin in (on_xml, on_emulator):
        plugin.teardown()
    assert not [n for n in object_names(gcs_emulator.url, gcs_bucket) if PARTS_SUFFIX in n]


def test_failed_xml_multipart_upload_is_aborted(xml_proxy, gcs_bucket, make_plugin):
    plugin = make_plugin(xml_proxy.client(), upload_mode="xml")
    path = f"gs://{gcs_bucket}/xml/fail.bin"
    xml_proxy.fault = lambda r, seen: 500 if "partNumber=3&" in r.path else None
    with pytest.raises(TransferError, match="part 3"), plugin.writer(path) as stream:
        stream.write(_data(5 * C))
    assert uploads_in_progress(xml_proxy.url, gcs_bucket) == []
    with pytest.raises(FileNotFoundError, match=path):
        plugin.reader(path)


def test_part_objects_are_deleted_in_the_background_and_teardown_waits(gcs_proxy, gcs_emulator, gcs_bucket,
                                                                         make_plugin):
    release = threading.Event()
    gcs_proxy.fault = lambda r, seen: release.wait(30) and None if r.method == "DELETE" else None
    plugin = make_plugin(gcs_proxy.client(), upload_mode="composite")
    path = f"gs://{gcs_bucket}/bg/last.ckpt"
    data = _data(3 * C + 5)
    with plugin.writer(path) as stream:
        stream.write(data)
    # The save returned while every part deletion is still held by the proxy.
    assert len(object_names(gcs_emulator.url, gcs_bucket, "bg/last.ckpt" + PARTS_SUFFIX)) == 4
    with plugin.reader(path) as stream:
        assert stream.read() == data
    release.set()
    plugin.teardown()
    assert object_names(gcs_emulator.url, gcs_bucket, "bg/") == ["bg/last.ckpt"]


def test_failed_background_deletion_keeps_the_checkpoint(gcs_proxy, gcs_emulator, gcs_bucket, make_plugin):
    gcs_proxy.fault = lambda r, seen: 500 if r.method == "DELETE" else None
    plugin = make_plugin(gcs_proxy.client(), upload_mode="composite")
    path = f"gs://{gcs_bucket}/bgfail/last.ckpt"
    plugin.save_checkpoint({"w": torch.arange(C, dtype=torch.uint8)}, path)
    plugin.teardown()
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.arange(C, dtype=torch.uint8))
    # The parts stay (until a later save finds their upload dead), the checkpoint is whole.
    assert object_names(gcs_emulator.url, gcs_bucket, "bgfail/last.ckpt" + PARTS_SUFFIX)
