import re
from pathlib import Path

import pytest

from dataflux_ckpt import DatafluxCheckpointIO, GcsPath, parse_gcs_path


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


def test_plugin_rejects_bad_paths_before_any_io():
    plugin = DatafluxCheckpointIO()  # no client is made for a bad path
    for call in (lambda: plugin.save_checkpoint({}, "/tmp/x.ckpt"), lambda: plugin.load_checkpoint("s3://b/k"),
                 lambda: plugin.remove_checkpoint("gs://only-bucket")):
        with pytest.raises(ValueError, match="not a GCS object path"):
            call()
    assert plugin._gcs is None


@pytest.mark.parametrize(
    "options",
    [{"upload_mode": "fast"}, {"chunk_size": 0}, {"max_workers": 0}, {"stream_chunk_size": 1000}],
)
def test_plugin_rejects_bad_options(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        DatafluxCheckpointIO(**options)
