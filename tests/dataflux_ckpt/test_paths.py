import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflux_ckpt import (
    DatafluxCheckpointIO,
    GcsPath,
    InvalidBucketNameError,
    UnsupportedSchemeError,
    parse_gcs_path,
    parse_gcs_prefix,
)
from lightning_storage_plugins.services import free_port


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("gs://bucket/key.ckpt", GcsPath("bucket", "key.ckpt")),
        ("GS://bucket/x", GcsPath("bucket", "x")),
        (Path("gs://bucket/run/epoch=1.ckpt"), GcsPath("bucket", "run/epoch=1.ckpt")),
        ("gs:/bucket/run/last.ckpt", GcsPath("bucket", "run/last.ckpt")),
    ],
)
def test_parses_gcs_paths(path, expected):
    assert parse_gcs_path(path) == expected
    assert parse_gcs_path(path).uri == f"gs://{expected.bucket}/{expected.key}"


@pytest.mark.parametrize(
    "path", ["s3://bucket/key", "/local/file.ckpt", "gs://bucket", "gs://bucket/", "gs:///key", "bucket/key", ""]
)
def test_rejects_other_paths_naming_them(path):
    with pytest.raises(ValueError, match=re.escape(repr(path))):
        parse_gcs_path(path)


def test_plugin_rejects_bad_paths_before_any_io(monkeypatch):
    # Nothing listens here: a request would fail with a connection error, not a ValueError.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    plugin = DatafluxCheckpointIO()
    for call in (lambda: plugin.save_checkpoint({}, "/tmp/x.ckpt"), lambda: plugin.load_checkpoint("gs:/"),
                 lambda: plugin.remove_checkpoint("gs://only-bucket"), lambda: plugin.writer("gs:///k"),
                 lambda: plugin.reader("bucket/key")):
        with pytest.raises(ValueError, match="not a GCS object path"):
            call()
    with pytest.raises(ValueError, match="not a GCS path"):
        plugin.list_checkpoints("/local/dir")


@pytest.mark.parametrize(("path", "expected"), [
    ("gs://bucket", GcsPath("bucket", "")), ("gs://bucket/", GcsPath("bucket", "")),
    ("gs://bucket/run1/", GcsPath("bucket", "run1/")), ("gs://bkt/x/y", GcsPath("bkt", "x/y")),
])
def test_prefixes_may_be_empty(path, expected):
    assert parse_gcs_prefix(path) == expected


@pytest.mark.parametrize(
    "options",
    [{"upload_mode": "fast"}, {"chunk_size": 0}, {"max_workers": 0}, {"stream_chunk_size": 1000},
     {"deadline_s": 0}, {"request_timeout_s": -1.0}, {"cleanup_timeout_s": 0.0}],
)
def test_plugin_rejects_bad_options(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        DatafluxCheckpointIO(**options)


# GCS's bucket naming rules ------------------------------------------------------------------------------
def _follows_gcs_bucket_rules(name: str) -> bool:
    if not name or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789-_." for c in name):
        return False
    if not (name[0].isalnum() and name[-1].isalnum()):
        return False
    if "." in name:
        return 3 <= len(name) <= 222 and all(len(part) <= 63 for part in name.split("."))
    return 3 <= len(name) <= 63


_BUCKET_ALPHABET = st.sampled_from("ab9z0-_.A!/%é ")
_BUCKET_NAMES = st.one_of(
    st.text(_BUCKET_ALPHABET, max_size=8),
    st.builds(lambda n, sep: sep.join(["a" * n] * 4), st.integers(0, 70), st.sampled_from([".", "-"])),
    st.builds(lambda n: "a" * n, st.integers(0, 240)),
)


@settings(max_examples=300, deadline=None)
@given(_BUCKET_NAMES)
def test_bucket_names_follow_gcs_rules(name):
    path = f"gs://{name}/key.ckpt"
    if "/" in name or not name:
        return
    if _follows_gcs_bucket_rules(name):
        assert parse_gcs_path(path) == GcsPath(name, "key.ckpt")
        assert parse_gcs_prefix(f"gs://{name}") == GcsPath(name, "")
    else:
        with pytest.raises(InvalidBucketNameError, match=re.escape(f"{name!r} is not a valid GCS bucket name")):
            parse_gcs_path(path)
        with pytest.raises(InvalidBucketNameError):
            parse_gcs_prefix(f"gs://{name}")


@pytest.mark.parametrize(("name", "rule"), [
    ("ab", "2 characters"), ("a" * 64, "64 characters"), ("a" * 64 + ".b", "each has at most 63"),
    (".".join(["a" * 60] * 4), "243 characters"), ("My_Bucket!", "lower-case letters"), ("-ab", "starts and ends"),
])
def test_invalid_bucket_names_name_the_rule(name, rule):
    with pytest.raises(InvalidBucketNameError, match=re.escape(rule)):
        parse_gcs_path(f"gs://{name}/x")


def test_my_bucket_is_reported_as_an_invalid_name_before_any_io(monkeypatch):
    # Nothing listens here: a request would fail with a connection error, not an invalid-name error.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    plugin = DatafluxCheckpointIO()
    with pytest.raises(InvalidBucketNameError, match=r"'My_Bucket!' is not a valid GCS bucket name"):
        plugin.save_checkpoint({}, "gs://My_Bucket!/run/last.ckpt")
    with pytest.raises(InvalidBucketNameError, match=r"'My_Bucket!' is not a valid GCS bucket name"):
        plugin.list_checkpoints("gs://My_Bucket!/run")


@pytest.mark.parametrize("scheme", ["gcs", "s3", "GCS", "file"])
def test_other_schemes_are_refused_naming_the_scheme(scheme):
    for parse in (parse_gcs_path, parse_gcs_prefix):
        with pytest.raises(UnsupportedSchemeError, match=re.escape(f"unsupported scheme '{scheme}://'")):
            parse(f"{scheme}://bucket/x")
