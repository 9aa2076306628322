"""What a load (or save) says when the object is not a loadable checkpoint, or not there at all."""

from __future__ import annotations

import io
import pathlib
import pickle
import random
import zipfile

import pytest
import torch

from dataflux_ckpt import BucketNotFoundError, InvalidCheckpointError
from tests.support.gcs import client_for


def _put(url: str, bucket: str, key: str, data: bytes) -> str:
    client_for(url).bucket(bucket).blob(key).upload_from_string(data)
    return f"gs://{bucket}/{key}"


def _serialized(obj: object, **options: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("transfer_manager", [True, False])
@pytest.mark.parametrize(("content", "message"), [
    (random.Random(0).randbytes(5000), r"is not a torch checkpoint: it starts with"),
    (b"", r"is an empty object \(0 bytes\)"),
    (_serialized({"w": torch.arange(100_000)})[:300_000], r"is a truncated torch checkpoint"),
])
def test_unloadable_objects_are_refused_naming_the_object(make_plugin, gcs_emulator, gcs_bucket, content, message,
                                                          transfer_manager):
    path = _put(gcs_emulator.url, gcs_bucket, "bad/last.ckpt", content)
    plugin = make_plugin(use_transfer_manager=transfer_manager)
    with pytest.raises(InvalidCheckpointError, match=rf"^{path} {message}"):
        plugin.load_checkpoint(path)


def test_a_zip_that_is_not_a_torch_checkpoint_is_refused(ckpt_io, gcs_emulator, gcs_bucket):
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("notes.txt", "hello")
    path = _put(gcs_emulator.url, gcs_bucket, "notes.zip", archive.getvalue())
    with pytest.raises(InvalidCheckpointError, match=rf"^{path} could not be loaded as a torch checkpoint"):
        ckpt_io.load_checkpoint(path)


def test_torch_legacy_format_still_loads(ckpt_io, gcs_emulator, gcs_bucket):
    path = _put(gcs_emulator.url, gcs_bucket, "legacy.ckpt",
                _serialized({"w": torch.ones(3)}, _use_new_zipfile_serialization=False))
    assert torch.equal(ckpt_io.load_checkpoint(path)["w"], torch.ones(3))


@pytest.mark.parametrize("transfer_manager", [True, False])
def test_missing_object_is_named(make_plugin, gcs_bucket, transfer_manager):
    path = f"gs://{gcs_bucket}/nope/missing.ckpt"
    with pytest.raises(FileNotFoundError, match=f"^no GCS object at {path}$") as caught:
        make_plugin(use_transfer_manager=transfer_manager).load_checkpoint(path)
    assert not isinstance(caught.value, BucketNotFoundError)


@pytest.mark.parametrize("transfer_manager", [True, False])
def test_missing_bucket_is_named_on_load_and_on_save_before_serializing(make_plugin, transfer_manager):
    plugin = make_plugin(use_transfer_manager=transfer_manager)
    path = "gs://no-such-bucket-at-all/run/last.ckpt"
    with pytest.raises(BucketNotFoundError, match=f"bucket 'no-such-bucket-at-all' of {path} does not exist"):
        plugin.load_checkpoint(path)

    class Unserializable:
        def __reduce__(self):
            raise AssertionError("serialization started although the bucket is missing")

    with pytest.raises(BucketNotFoundError, match=f"bucket 'no-such-bucket-at-all' of {path} does not exist"):
        plugin.save_checkpoint({"x": Unserializable()}, path)
    with pytest.raises(BucketNotFoundError):
        plugin.list_checkpoints("gs://no-such-bucket-at-all/run/")


class RunsCode:
    """A pickle payload that runs code when it is loaded: it creates a file."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_checkpoint_that_runs_code_is_refused_by_default(ckpt_io, ckpt_path, tmp_path):
    marker = tmp_path / "pwned"
    ckpt_io.save_checkpoint({"state": torch.ones(2), "payload": RunsCode(marker)}, ckpt_path)
    with pytest.raises(pickle.UnpicklingError, match=rf"^Weights only load of checkpoint {ckpt_path} refused"):
        ckpt_io.load_checkpoint(ckpt_path)  # weights_only=None: torch's default
    with pytest.raises(pickle.UnpicklingError, match=rf"^Weights only load of checkpoint {ckpt_path} "):
        ckpt_io.load_checkpoint(ckpt_path, weights_only=True)
    assert not marker.exists()
    ckpt_io.load_checkpoint(ckpt_path, weights_only=False)  # the caller's explicit choice is passed through
    assert marker.exists()
