import re
from pathlib import Path

import pytest

from dataflux_ckpt import DatafluxCheckpointIO, GcsPath, parse_gcs_path, parse_gcs_prefix
from lightning_storage_plugins.services import free_port


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("gs://bucket/key.ckpt", GcsPath("bucket", "key.ckpt")),
        ("gcs://bucket/a/b/c.ckpt", GcsPath("bucket", "a/b/c.ckpt")),
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
    for call in (lambda: plugin.save_checkpoint({}, "/tmp/x.ckpt"), lambda: plugin.load_checkpoint("s3://b/k"),
                 lambda: plugin.remove_checkpoint("gs://only-bucket"), lambda: plugin.writer("gs:///k"),
                 lambda: plugin.reader("bucket/key")):
        with pytest.raises(ValueError, match="not a GCS object path"):
            call()
    with pytest.raises(ValueError, match="not a GCS path"):
        plugin.list_checkpoints("/local/dir")


@pytest.mark.parametrize(("path", "expected"), [
    ("gs://bucket", GcsPath("bucket", "")), ("gs://bucket/", GcsPath("bucket", "")),
    ("gs://bucket/run1/", GcsPath("bucket", "run1/")), ("gcs://b/x/y", GcsPath("b", "x/y")),
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
