"""One ``gs://`` path names one object: the same in every upload mode and every read, or refused
before any request. Against the real emulator and the XML multipart server."""

from __future__ import annotations

import uuid
from urllib.parse import unquote

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflux_ckpt import (
    DatafluxStorageWriter,
    GcsPath,
    InvalidObjectNameError,
    parse_gcs_path,
    parse_gcs_prefix,
)
from dataflux_ckpt import paths as gcs_paths
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from dataflux_ckpt.gcs import Gcs
from dataflux_ckpt.upload import PARTS_SUFFIX
from tests.support.gcs import client_for, object_names

# (upload mode, use_transfer_manager, size): XML multipart and composite parts, a resumable stream,
# and a single-request upload.
MODES = {
    "xml": ("xml", True, 2 * C + 5),
    "composite": ("composite", True, 2 * C + 5),
    "stream": ("composite", False, 2 * C + 5),
    "single": ("composite", True, 10),
}


def _new_bucket(gcs_emulator, stem: str) -> str:
    name = f"{stem}-{uuid.uuid4().hex[:10]}"
    gcs_emulator.create_bucket(name)
    return name


@pytest.mark.parametrize("mode", list(MODES))
def test_dot_segments_are_refused_before_any_request_and_write_nothing(make_plugin, gcs_emulator, xml_proxy,
                                                                      mode):
    upload_mode, transfer_manager, size = MODES[mode]
    ckpts, victim = _new_bucket(gcs_emulator, "ckpts"), _new_bucket(gcs_emulator, "victim")
    prod = client_for(gcs_emulator.url).bucket(ckpts).blob("prod/best.ckpt")
    prod.upload_from_string(b"the good checkpoint")
    plugin = make_plugin(xml_proxy.client(), upload_mode=upload_mode, use_transfer_manager=transfer_manager)
    plugin.gcs  # noqa: B018 (the client is made now: what follows must send nothing)
    before = len(xml_proxy.requests)
    for path in (f"gs://{ckpts}/run/../../{victim}/planted.ckpt", f"gs://{ckpts}/scratch/../prod/best.ckpt",
                 f"gs://{ckpts}/a/./b.ckpt", f"gs://{ckpts}/..", f"gs://{ckpts}/run/."):
        with pytest.raises(InvalidObjectNameError, match="segment") as caught:
            with plugin.writer(path) as stream:
                stream.write(b"x" * size)
        assert caught.value.bucket == ckpts
        for call, args in ((plugin.save_checkpoint, ({"planted": torch.ones(size)}, path)),
                           (plugin.load_checkpoint, (path,)), (plugin.reader, (path,)),
                           (plugin.remove_checkpoint, (path,)), (DatafluxStorageWriter, (path,))):
            with pytest.raises(InvalidObjectNameError, match="segment"):
                call(*args)
    assert len(xml_proxy.requests) == before
    assert object_names(gcs_emulator.url, victim) == []
    assert object_names(gcs_emulator.url, ckpts) == ["prod/best.ckpt"]
    assert prod.download_as_bytes() == b"the good checkpoint"


@pytest.mark.parametrize("name", ["run/../../victim/planted.ckpt", "scratch/../prod/best.ckpt", "..", ".",
                                  "a/./b", "trailing/..", "nul\x00.ckpt", "cr\r.ckpt", "lf\n.ckpt", "del\x7f",
                                  "c1\x85", "lone\ud800surrogate", "x" * 1025])
def test_every_url_builder_refuses_what_parsing_refuses(gcs_emulator, name):
    gcs = Gcs(client_for(gcs_emulator.url))
    try:
        for build in (gcs.object_url, gcs.media_url, gcs.xml_url,
                      lambda b, n: gcs_paths.upload_url_path(b, n, "media")):
            with pytest.raises(InvalidObjectNameError):
                build("ckpts", name)
    finally:
        gcs.close()
    with pytest.raises(InvalidObjectNameError):
        parse_gcs_path(f"gs://ckpts/{name}")
    with pytest.raises(InvalidObjectNameError):
        parse_gcs_prefix(f"gs://ckpts/{name}")


@pytest.mark.parametrize("path", ["gs://../x", "gs://./x", "gs://My_Bucket!/x", "gs://bucket%2F/x", "gs://-b/x"])
def test_invalid_bucket_names_are_refused_as_names(path):
    with pytest.raises(InvalidObjectNameError, match="bucket name"):
        parse_gcs_path(path)


ODD_NAMES = ["with space/a b.ckpt", "pct%41%2F%.ckpt", "hash#frag.ckpt", "q?x=1&y=2.ckpt", "plus+sign;semi=.ckpt",
             "ünïcødé/日本語/🙂.ckpt", "dots/...ckpt/..../x.", "double//slash.ckpt", "tilde~'quote\"<>.ckpt"]


@pytest.mark.parametrize("mode", list(MODES))
def test_odd_names_round_trip_identically_in_every_mode(make_plugin, gcs_emulator, gcs_xml_server, gcs_bucket, mode):
    upload_mode, transfer_manager, size = MODES[mode]
    plugin = make_plugin(client_for(gcs_xml_server.url), upload_mode=upload_mode,
                         use_transfer_manager=transfer_manager)
    client = client_for(gcs_emulator.url)
    for i, name in enumerate(ODD_NAMES):
        data = bytes([i]) * size
        path = f"gs://{gcs_bucket}/{name}"
        with plugin.writer(path) as stream:
            stream.write(data)
        with plugin.reader(path) as stream:
            assert stream.read() == data
        assert client.bucket(gcs_bucket).blob(name).download_as_bytes() == data
    plugin.teardown()
    listed = [n for n in object_names(gcs_emulator.url, gcs_bucket) if PARTS_SUFFIX not in n]
    assert listed == sorted(ODD_NAMES)
    assert plugin.list_checkpoints(f"gs://{gcs_bucket}") == sorted(f"gs://{gcs_bucket}/{n}" for n in ODD_NAMES)
    for name in ODD_NAMES:
        plugin.remove_checkpoint(f"gs://{gcs_bucket}/{name}")
    plugin.teardown()
    assert object_names(gcs_emulator.url, gcs_bucket) == []


def test_checkpoints_with_odd_names_save_and_load(make_plugin, gcs_xml_server, gcs_bucket):
    plugin = make_plugin(client_for(gcs_xml_server.url), upload_mode="xml")
    path = f"gs://{gcs_bucket}/ep och=1 #2 ?%20/ünï.ckpt"
    plugin.save_checkpoint({"w": torch.arange(3 * C // 4)}, path)
    assert torch.equal(plugin.load_checkpoint(path)["w"], torch.arange(3 * C // 4))


_segment = st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=8)
_names = st.lists(st.one_of(_segment, st.sampled_from([".", "..", "a\x00", "\r\n", "%2e%2E", "#?"])),
                  min_size=1, max_size=4).map("/".join)


def _acceptable(name: str) -> bool:
    return (not any(c < " " or "\x7f" <= c <= "\x9f" for c in name)
            and not {".", ".."} & set(name.split("/")) and len(name.encode()) <= 1024)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_names)
def test_every_name_is_refused_or_names_one_object_everywhere(make_plugin, gcs_emulator, gcs_xml_server,
                                                            gcs_bucket, name):
    if not _acceptable(name):
        with pytest.raises(InvalidObjectNameError):
            gcs_paths.check_object_name(gcs_bucket, name)
        with pytest.raises(InvalidObjectNameError):
            parse_gcs_path(f"gs://{gcs_bucket}/{name}")
        return
    assert parse_gcs_path(f"gs://{gcs_bucket}/{name}") == GcsPath(gcs_bucket, name)
    # Every URL carries the name exactly: decoding what was encoded gives it back.
    assert unquote(gcs_paths.xml_url_path(gcs_bucket, name).split("/", 2)[2]) == name
    assert unquote(gcs_paths.object_url_path(gcs_bucket, name).rsplit("/", 1)[1]) == name
    # XML multipart, then a single JSON upload, write the one object the JSON API reads under that name.
    path = f"gs://{gcs_bucket}/{name}"
    bucket = client_for(gcs_emulator.url).bucket(gcs_bucket)
    for mode, data in (("xml", b"x" * (C + 1)), ("composite", b"json")):
        plugin = make_plugin(client_for(gcs_xml_server.url), upload_mode=mode)
        with plugin.writer(path) as stream:
            stream.write(data)
        assert bucket.blob(name).download_as_bytes() == data
        with plugin.reader(path) as stream:
            assert stream.read() == data
    plugin.remove_checkpoint(path)
    assert not bucket.blob(name).exists()
