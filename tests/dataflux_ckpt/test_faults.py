"""Faults over real HTTP: retried parts, an XML multipart server, corruption, a server that stops."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from dataflux_ckpt import DataCorruptionError, FakeGcsServer, RetryPolicy, TransferError
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from dataflux_ckpt.upload import PARTS_SUFFIX
from tests.support.gcs import uploads_in_progress


def _data(size: int) -> bytes:
    return random.Random(size).randbytes(size)


@pytest.mark.parametrize("fault", [503, 429, "reset"])
def test_part_failing_once_is_retried(gcs_proxy, gcs_bucket, fault, make_plugin):
    gcs_proxy.fault = lambda r, seen: fault if "000002" in r.path and seen == 1 else None
    plugin = make_plugin(gcs_proxy.client())
    data = _data(4 * C + 1)
    with plugin.writer(f"gs://{gcs_bucket}/r.bin") as stream:
        stream.write(data)
    assert gcs_proxy.count("POST", "000002") == 2
    with plugin.reader(f"gs://{gcs_bucket}/r.bin") as stream:
        assert stream.read() == data


def test_part_that_keeps_failing_fails_the_save_naming_bucket_key_part(gcs_proxy, gcs_bucket, make_plugin):
    gcs_proxy.fault = lambda r, seen: 503 if "000003" in r.path else None
    plugin = make_plugin(gcs_proxy.client())
    path = f"gs://{gcs_bucket}/dir/fail.ckpt"
    with pytest.raises(TransferError, match=rf"part 3 of {path} \(bucket {gcs_bucket}, key dir/fail.ckpt\)"):
        plugin.save_checkpoint({"w": torch.randn(6 * C // 4)}, path)
    assert gcs_proxy.count("POST", "000003") == plugin.retry.attempts
    assert plugin.gcs.list_names(gcs_bucket, "") == []


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


def test_xml_multipart_upload_over_http(xml_proxy, gcs_bucket, make_plugin):
    plugin = make_plugin(xml_proxy.client(), upload_mode="auto")
    data = _data(5 * C + 11)
    path = f"gs://{gcs_bucket}/xml/obj.bin"
    xml_proxy.fault = lambda r, seen: 503 if "partNumber=2&" in r.path and seen == 1 else None
    with plugin.writer(path) as stream:
        stream.write(data)
    assert xml_proxy.count("POST", "?uploads") == 1
    assert xml_proxy.count("PUT", "partNumber=") == 6 + 1  # one part retried
    assert xml_proxy.count("POST", "uploadType=media") == 0  # no composite part objects
    with plugin.reader(path) as stream:
        assert stream.read() == data


def test_failed_xml_multipart_upload_is_aborted(xml_proxy, gcs_bucket, make_plugin):
    plugin = make_plugin(xml_proxy.client(), upload_mode="xml")
    path = f"gs://{gcs_bucket}/xml/fail.bin"
    xml_proxy.fault = lambda r, seen: 500 if "partNumber=3&" in r.path else None
    with pytest.raises(TransferError, match="part 3"), plugin.writer(path) as stream:
        stream.write(_data(5 * C))
    assert xml_proxy.count("DELETE", "uploadId=") == 1
    assert uploads_in_progress(xml_proxy.url, gcs_bucket) == []
    with pytest.raises(FileNotFoundError):
        plugin.reader(path)


def test_server_stopped_mid_upload_leaves_previous_object_and_no_parts(tmp_path, make_plugin):
    """The emulator dies during a save; the save fails, cleanup runs once it is back."""
    root = tmp_path / "gcs"
    server = FakeGcsServer(root=root).start()
    port, bucket, path = server.port, "stopped", "gs://stopped/run/last.ckpt"
    restarted: list[FakeGcsServer] = []

    class RestartWhenCleanupStarts(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "cleaning up" in record.getMessage():
                restarted.append(FakeGcsServer(port=port, root=root).start())

    handler = RestartWhenCleanupStarts()
    logging.getLogger("dataflux_ckpt.upload").addHandler(handler)
    try:
        server.create_bucket(bucket)
        client = storage.Client(project="p", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": server.url})
        plugin = make_plugin(client, upload_mode="composite",
                             retry=RetryPolicy(attempts=8, initial_backoff_s=0.05, max_backoff_s=0.5))
        plugin.save_checkpoint({"previous": 1}, path)
        stream = plugin.writer(path)
        stream.write(_data(3 * C))
        deadline = time.monotonic() + 30
        while len(plugin.gcs.list_names(bucket, "run/last.ckpt" + PARTS_SUFFIX)) < 2:
            assert time.monotonic() < deadline, "parts never arrived"
            time.sleep(0.02)
        server.stop()
        with pytest.raises(TransferError, match=r"part [34] of gs://stopped/run/last.ckpt \(bucket stopped, key run/last.ckpt\)"), stream:
            stream.write(_data(2 * C))
        assert restarted, "cleanup never started"
        assert sorted(plugin.gcs.list_names(bucket, "")) == ["run/last.ckpt"]
        assert plugin.load_checkpoint(path) == {"previous": 1}
    finally:
        logging.getLogger("dataflux_ckpt.upload").removeHandler(handler)
        server.stop()
        for s in restarted:
            s.stop()


def test_part_objects_are_deleted_in_the_background_and_teardown_waits(gcs_proxy, gcs_bucket, make_plugin):
    release = threading.Event()
    gcs_proxy.fault = lambda r, seen: release.wait(30) and None if r.method == "DELETE" else None
    plugin = make_plugin(gcs_proxy.client(), upload_mode="composite")
    path = f"gs://{gcs_bucket}/bg/last.ckpt"
    data = _data(3 * C + 5)
    with plugin.writer(path) as stream:
        stream.write(data)
    # The save returned while every part deletion is still held by the proxy.
    assert len(plugin.gcs.list_names(gcs_bucket, "bg/last.ckpt" + PARTS_SUFFIX)) == 4
    with plugin.reader(path) as stream:
        assert stream.read() == data
    release.set()
    plugin.teardown()
    assert plugin.gcs.list_names(gcs_bucket, "bg/") == ["bg/last.ckpt"]


def test_failed_background_deletion_is_logged_and_the_checkpoint_kept(gcs_proxy, gcs_bucket, make_plugin, caplog):
    gcs_proxy.fault = lambda r, seen: 500 if r.method == "DELETE" else None
    plugin = make_plugin(gcs_proxy.client(), upload_mode="composite")
    path = f"gs://{gcs_bucket}/bgfail/last.ckpt"
    with caplog.at_level(logging.WARNING, logger="dataflux_ckpt.gcs"):
        plugin.save_checkpoint({"w": torch.arange(C, dtype=torch.uint8)}, path)
        plugin.teardown()
    assert any("deleting part object" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.arange(C, dtype=torch.uint8))
