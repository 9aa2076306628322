"""TieredCheckpointIO: a local FastPersist tier, the same file uploaded to GCS in the background,
loads from the newest whole copy; against the session's fake-gcs-server and real files."""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from dataflux_ckpt import (
    DatafluxCheckpointIO,
    DatafluxModelCheckpoint,
    LocalTierFullError,
    LocalTierInUseError,
    TieredCheckpointIO,
    TieredCheckpointMonitor,
    TieredOptions,
    tiered,
)
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES
from dataflux_ckpt.paths import parse_gcs_path
from dataflux_ckpt.retry import Deadline
from dataflux_ckpt.tiered import UPLOADED_KEPT, Manifest, ManifestError
from tests.support.gcs import FAST_RETRY, FaultProxy
from tests.support.processes import wait_for
from tests.support.tiered_crash import is_publish

TIERED_LOG = "dataflux_ckpt.tiered"


def checkpoint(step: int, numel: int = 200_000) -> dict:
    """A checkpoint whose every tensor is derived from ``step`` (so a mixed one is seen)."""
    generator = torch.Generator().manual_seed(step)
    return {"global_step": step, "state_dict": {"w": torch.randn(numel, generator=generator),
                                                "b": torch.full((7,), float(step))}}


def assert_is_step(loaded: dict, step: int) -> None:
    assert loaded["global_step"] == step
    expected = checkpoint(step, loaded["state_dict"]["w"].numel())
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name


@pytest.fixture
def make_tiered(gcs_emulator, tmp_path) -> Iterator[Callable[..., TieredCheckpointIO]]:
    """Tiered plugins with small parts and quick retries, torn down after the test."""
    made: list[TieredCheckpointIO] = []

    def make(local_dir: str | Path | None = None, **kwargs) -> TieredCheckpointIO:
        options = {"chunk_size": RESUMABLE_CHUNK_MULTIPLE_BYTES, "max_workers": 3, "retry": FAST_RETRY,
                   "io_buffer_mb": 8, "teardown_timeout_s": 120.0, **kwargs}
        made.append(TieredCheckpointIO(local_dir or tmp_path / "tier", **options))
        return made[-1]

    yield make
    for plugin in made:
        plugin.teardown()


def gcs_reader() -> DatafluxCheckpointIO:
    return DatafluxCheckpointIO(chunk_size=RESUMABLE_CHUNK_MULTIPLE_BYTES, retry=FAST_RETRY)


def manifests(local_dir: Path) -> dict[str, Manifest]:
    return {Manifest.from_json(path.read_bytes()).uri: Manifest.from_json(path.read_bytes())
            for path in local_dir.glob("*.manifest")}


def local_file(local_dir: Path, uri: str) -> Path:
    manifest = manifests(local_dir)[uri]
    (found,) = [path for path in local_dir.iterdir() if f"-{manifest.version}-" in path.name]
    return found


# Round trips -------------------------------------------------------------------------------------
def test_save_returns_after_the_local_write_and_the_same_file_becomes_durable(make_tiered, gcs_bucket, tmp_path):
    plugin = make_tiered()
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    plugin.save_checkpoint(checkpoint(3), uri)
    assert plugin.stats().saves == 1 and plugin.stats().last_save_s > 0
    assert_is_step(plugin.load_checkpoint(uri), 3)  # the local copy, whatever the upload's progress
    plugin.teardown()  # waits for the upload

    stats = plugin.stats()
    assert (stats.uploads_pending, stats.uploads_done, stats.last_durable) == (0, 1, uri)
    assert stats.last_durable_s >= stats.last_save_s
    manifest = manifests(tmp_path / "tier")[uri]
    assert manifest.durable and manifest.crc32c is not None
    info = gcs_reader().gcs.stat(parse_gcs_path(uri), Deadline(30, "stat", uri))
    # The object is the local file itself: same size, same crc32c, the generation the manifest records.
    assert (info.size, info.crc32c, info.generation) == (manifest.size, manifest.crc32c, manifest.durable_generation)
    assert local_file(tmp_path / "tier", uri).stat().st_size == manifest.size
    assert_is_step(torch.load(local_file(tmp_path / "tier", uri), weights_only=True), 3)  # a plain torch file
    assert_is_step(gcs_reader().load_checkpoint(uri), 3)


def test_a_new_save_of_a_path_replaces_its_local_version_and_uploads_the_newest(make_tiered, gcs_bucket, tmp_path):
    plugin = make_tiered()
    uri = f"gs://{gcs_bucket}/run/last.ckpt"
    for step in range(1, 5):
        plugin.save_checkpoint(checkpoint(step), uri)
    assert_is_step(plugin.load_checkpoint(uri), 4)
    plugin.teardown()
    assert_is_step(gcs_reader().load_checkpoint(uri), 4)
    assert len(local_files := [p for p in (tmp_path / "tier").iterdir() if not p.name.startswith(".")]) == 2, local_files


def test_trainer_save_checkpoint_and_a_gs_model_checkpoint_use_the_local_tier(make_tiered, gcs_bucket, tmp_path):
    plugin = make_tiered(keep_local=None)
    dirpath = f"gs://{gcs_bucket}/fit"
    trainer = Trainer(max_steps=3, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1, plugins=[plugin],
                      callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_last=True),
                                 TieredCheckpointMonitor()])
    trainer.fit(BoringModel())  # fit's end tears the plugin down: every upload has finished
    trainer.save_checkpoint(f"{dirpath}/manual.ckpt")
    plugin.teardown()
    assert gcs_reader().list_checkpoints(f"{dirpath}/") == [
        f"{dirpath}/epoch=0-step=3.ckpt", f"{dirpath}/last.ckpt", f"{dirpath}/manual.ckpt"]
    assert set(manifests(tmp_path / "tier")) == set(gcs_reader().list_checkpoints(f"{dirpath}/"))
    assert all(manifest.durable for manifest in manifests(tmp_path / "tier").values())
    assert gcs_reader().load_checkpoint(f"{dirpath}/manual.ckpt")["global_step"] == 3
    logged = trainer.logged_metrics
    assert logged["tiered/uploads_pending"] >= 0 and logged["tiered/save_wait_s"] > 0


# Loads: the newest whole copy ----------------------------------------------------------------------
@pytest.fixture
def proxied(make_tiered, gcs_proxy: FaultProxy) -> Callable[..., TieredCheckpointIO]:
    """A tiered plugin whose every GCS request goes through the fault proxy."""
    return lambda **kwargs: make_tiered(storage_client=gcs_proxy.client(), **kwargs)


def media_gets(proxy: FaultProxy) -> int:
    return sum(1 for request in proxy.requests if request.method == "GET" and "alt=media" in request.path)


def test_a_load_reads_the_whole_local_copy_without_downloading(proxied, gcs_proxy, gcs_bucket):
    plugin = proxied()
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    plugin.save_checkpoint(checkpoint(5), uri)
    plugin.teardown()
    before = media_gets(gcs_proxy)
    assert_is_step(plugin.load_checkpoint(uri), 5)
    assert media_gets(gcs_proxy) == before  # only a look-up: is GCS's copy newer? (it is the same)
    with plugin.reader(uri) as stream:  # the file-like reads the same copy
        assert torch.load(stream, weights_only=True)["global_step"] == 5


def test_tensors_loaded_from_the_local_tier_change_without_the_file_and_outlive_it(make_tiered, gcs_bucket,
                                                                                   tmp_path, caplog):
    plugin = make_tiered()
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    plugin.save_checkpoint(checkpoint(3), uri)
    path = local_file(tmp_path / "tier", uri)
    written = path.read_bytes()
    with caplog.at_level(logging.INFO, logger=TIERED_LOG):
        loaded = plugin.load_checkpoint(uri)
    assert "from the local tier" in caplog.text
    loaded["state_dict"]["w"].add_(1)  # as an optimizer steps on state it was loaded with
    assert path.read_bytes() == written
    assert_is_step(plugin.load_checkpoint(uri), 3)
    plugin.save_checkpoint(checkpoint(4), uri)  # replaces, and removes, the file the tensors came from
    plugin.teardown()
    assert not path.exists()
    assert torch.equal(loaded["state_dict"]["w"], checkpoint(3)["state_dict"]["w"] + 1)
    assert_is_step(gcs_reader().load_checkpoint(uri), 4)


def test_an_older_save_published_after_newer_local_saves_is_not_taken_for_a_newer_copy(proxied, gcs_proxy,
                                                                                      gcs_bucket):
    """Saves far faster than uploads: step 1's upload publishes only once steps 2 to N (more of them
    than the manifest keeps uploads) are saved locally. GCS then holds step 1 in an object made after
    step N's local save, and the local tier still holds the newest copy."""
    held = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]
    publishes = []

    def hold_publishes(request, seen):
        if is_publish(request) and len(publishes) < 2:
            publishes.append(request)
            number = len(publishes) - 1
            held[number].set()
            release[number].wait(120)
        return None

    gcs_proxy.fault = hold_publishes
    plugin = proxied(keep_local=None, upload_mode="composite")
    uri = f"gs://{gcs_bucket}/run/last.ckpt"
    newest = UPLOADED_KEPT + 4
    try:
        plugin.save_checkpoint(checkpoint(1), uri)
        assert held[0].wait(120), "step 1's upload reaches its publish"
        for step in range(2, newest + 1):
            plugin.save_checkpoint(checkpoint(step), uri)
        release[0].set()
        assert held[1].wait(120), "step 1 is durable and the newest save's upload reaches its publish"
        assert_is_step(gcs_reader().load_checkpoint(uri), 1)
        assert_is_step(plugin.load_checkpoint(uri), newest)
        assert_is_step(proxied().load_checkpoint(uri), newest)  # another reader of the same local tier
    finally:
        for event in release:
            event.set()
    plugin.teardown()
    gcs_proxy.fault = None
    assert_is_step(gcs_reader().load_checkpoint(uri), newest)


def test_parts_go_up_while_the_checksum_is_taken_and_the_publish_waits_for_it(proxied, gcs_proxy, gcs_bucket,
                                                                             tmp_path, monkeypatch):
    checksum_started, checksum_released = threading.Event(), threading.Event()
    take_checksum = tiered.file_crc32c

    def held_checksum(fd: int, size: int, what: str) -> int:
        checksum_started.set()
        checksum_released.wait(120)
        return take_checksum(fd, size, what)

    monkeypatch.setattr(tiered, "file_crc32c", held_checksum)
    requests = []
    gcs_proxy.fault = lambda request, seen: requests.append(request)
    plugin = proxied(upload_mode="composite")
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    try:
        plugin.save_checkpoint(checkpoint(1), uri)
        assert checksum_started.wait(120)
        # Every part but the last, which a writer cuts when it closes, after the checksum is known.
        parts = -(-manifests(tmp_path / "tier")[uri].size // RESUMABLE_CHUNK_MULTIPLE_BYTES) - 1
        assert parts >= 2
        wait_for(lambda: sum(".dataflux-parts" in r.path and r.method == "POST" for r in requests) >= parts,
                 f"{parts} part uploads while the checksum is taken", timeout_s=120)
        time.sleep(0.5)  # a publish that did not wait for the checksum would follow the parts' answers
        assert not any(is_publish(r) for r in requests) and plugin.stats().uploads_pending == 1
        assert manifests(tmp_path / "tier")[uri].crc32c is None and gcs_reader().list_checkpoints(
            f"gs://{gcs_bucket}/run/") == []
    finally:
        checksum_released.set()
    plugin.teardown()
    gcs_proxy.fault = None
    assert any(is_publish(r) for r in requests)
    manifest = manifests(tmp_path / "tier")[uri]
    assert manifest.durable and manifest.crc32c in manifest.uploaded_crc32c
    assert_is_step(gcs_reader().load_checkpoint(uri), 1)


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "delete"])
def test_a_damaged_or_missing_local_copy_is_loaded_from_gcs(proxied, gcs_proxy, gcs_bucket, tmp_path, caplog, damage):
    plugin = proxied()
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    plugin.save_checkpoint(checkpoint(6), uri)
    plugin.teardown()
    path = local_file(tmp_path / "tier", uri)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(data[:-1])
    elif damage == "extend":
        path.write_bytes(data + b"\0")
    else:
        path.unlink()
    before = media_gets(gcs_proxy)
    with caplog.at_level(logging.WARNING, logger=TIERED_LOG):
        assert_is_step(plugin.load_checkpoint(uri), 6)
    assert media_gets(gcs_proxy) > before
    assert f"the local copy of {uri}" in caplog.text and "loading it from GCS" in caplog.text


def test_a_new_node_with_an_empty_local_dir_resumes_from_gcs(make_tiered, gcs_bucket, tmp_path):
    first = make_tiered(tmp_path / "node-a")
    uri = f"gs://{gcs_bucket}/run/last.ckpt"
    first.save_checkpoint(checkpoint(8), uri)
    first.teardown()
    second = make_tiered(tmp_path / "node-b")
    assert_is_step(second.load_checkpoint(uri), 8)
    second.save_checkpoint(checkpoint(9), uri)  # node B trains on; node A's copy is now the older one
    second.teardown()
    assert_is_step(first.load_checkpoint(uri), 9)  # GCS holds a newer version than node A's tier
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        second.load_checkpoint(f"gs://{gcs_bucket}/run/missing.ckpt")


# Budgets: remote_every, keep_local, free space -----------------------------------------------------
def test_remote_every_uploads_every_nth_round_and_a_round_is_one_global_step(make_tiered, gcs_bucket, tmp_path):
    plugin = make_tiered(remote_every=2, keep_local=None)
    run = f"gs://{gcs_bucket}/run"
    for step in range(1, 6):  # as ModelCheckpoint saves: the step's checkpoint, then last.ckpt
        plugin.save_checkpoint(checkpoint(step, 1000), f"{run}/step={step}.ckpt")
        plugin.save_checkpoint(checkpoint(step, 1000), f"{run}/last.ckpt")
    plugin.teardown()
    assert gcs_reader().list_checkpoints(f"{run}/") == [f"{run}/last.ckpt", f"{run}/step=2.ckpt", f"{run}/step=4.ckpt"]
    assert_is_step(gcs_reader().load_checkpoint(f"{run}/last.ckpt"), 4)  # what was uploaded last
    assert_is_step(plugin.load_checkpoint(f"{run}/last.ckpt"), 5)  # the local tier has the newer one
    assert_is_step(plugin.load_checkpoint(f"{run}/step=5.ckpt"), 5)
    durable = {uri: manifest.durable for uri, manifest in manifests(tmp_path / "tier").items()}
    assert durable == {f"{run}/step={step}.ckpt": step % 2 == 0 for step in range(1, 6)} | {f"{run}/last.ckpt": False}


def test_an_upload_a_save_kept_on_the_node_replaced_stays_pending_and_a_restart_finishes_it(
        proxied, make_tiered, gcs_bucket, uploads_blocked, tmp_path, caplog):
    tier = tmp_path / "tier"
    plugin = proxied(remote_every=2, keep_local=None, teardown_timeout_s=1.0)
    uri = f"gs://{gcs_bucket}/run/last.ckpt"
    for step in (1, 2, 3):  # step 2 goes to GCS (and cannot yet), steps 1 and 3 stay on the node
        plugin.save_checkpoint(checkpoint(step), uri)
    assert_is_step(plugin.load_checkpoint(uri), 3)
    (pending,) = tier.glob("*.pending")
    owed = Manifest.from_json(pending.read_bytes())
    assert owed.remote and not owed.durable and len([p for p in tier.iterdir() if "-last.ckpt" in p.name]) == 2
    plugin.teardown()  # gives up on the upload: it stays owed, for the next writer of this tier
    assert pending.exists()
    with pytest.raises(FileNotFoundError):
        gcs_reader().load_checkpoint(uri)

    uploads_blocked.clear()
    restarted = make_tiered(remote_every=2, keep_local=None)  # the same node, after a crash or a teardown
    with caplog.at_level(logging.INFO, logger=TIERED_LOG):
        restarted.preflight([])
        restarted.teardown()
    assert f"finishing the upload of {uri}" in caplog.text
    assert_is_step(gcs_reader().load_checkpoint(uri), 2)
    assert_is_step(restarted.load_checkpoint(uri), 3)  # the newer local copy, as before
    assert not pending.exists()
    assert [p.name for p in tier.iterdir() if "-last.ckpt" in p.name] == [local_file(tier, uri).name]
    assert not manifests(tier)[uri].durable  # step 3 itself never goes to GCS


def test_a_save_that_goes_to_gcs_makes_an_older_pending_upload_moot(proxied, gcs_bucket, uploads_blocked, tmp_path):
    tier = tmp_path / "tier"
    plugin = proxied(remote_every=2, keep_local=None, teardown_timeout_s=1.0)
    uri = f"gs://{gcs_bucket}/run/last.ckpt"
    for step in (1, 2, 3):
        plugin.save_checkpoint(checkpoint(step), uri)
    assert list(tier.glob("*.pending"))
    plugin.save_checkpoint(checkpoint(4), uri)  # goes to GCS itself: step 2 owes nothing any more
    assert not list(tier.glob("*.pending"))
    uploads_blocked.clear()
    plugin.teardown()
    assert_is_step(gcs_reader().load_checkpoint(uri), 4)
    assert [p.name for p in tier.iterdir() if "-last.ckpt" in p.name] == [local_file(tier, uri).name]


def test_keep_local_keeps_the_newest_k_and_older_ones_load_from_gcs(make_tiered, gcs_bucket, tmp_path):
    plugin = make_tiered(keep_local=2)
    uris = [f"gs://{gcs_bucket}/run/step={step}.ckpt" for step in range(5)]
    for step, uri in enumerate(uris[:4]):
        plugin.save_checkpoint(checkpoint(step, 1000), uri)
    plugin.teardown()  # uploads over: the older ones can leave the local tier
    plugin.save_checkpoint(checkpoint(4, 1000), uris[4])  # each save evicts what keep_local no longer keeps
    assert set(manifests(tmp_path / "tier")) == set(uris[3:])
    for step, uri in enumerate(uris):
        assert_is_step(plugin.load_checkpoint(uri), step)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A real 6 MiB filesystem (tmpfs) for the local tier."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_checkpoint_larger_than_the_free_space_is_refused_before_any_write(make_tiered, gcs_bucket, small_disk):
    plugin = make_tiered(small_disk, engine="python")
    before = sorted(os.listdir(small_disk))
    with pytest.raises(LocalTierFullError, match="has .* bytes free, and this checkpoint needs about") as raised:
        plugin.save_checkpoint(checkpoint(1, 2_000_000), f"gs://{gcs_bucket}/run/big.ckpt")  # 8 MB of tensors
    assert raised.value.errno == 28 and str(small_disk) in str(raised.value)
    assert sorted(name for name in os.listdir(small_disk) if name != ".tiered.lock") == before
    assert plugin.stats().saves == 0


def test_min_free_bytes_is_left_free(make_tiered, gcs_bucket, small_disk):
    plugin = make_tiered(small_disk, engine="python", min_free_bytes=5 * 2**20)
    with pytest.raises(LocalTierFullError, match="min_free_bytes=5242880"):
        plugin.save_checkpoint(checkpoint(1, 100_000), f"gs://{gcs_bucket}/run/a.ckpt")  # 400 kB


def test_a_full_local_tier_makes_room_by_evicting_what_keep_local_would_evict(make_tiered, gcs_bucket, small_disk):
    plugin = make_tiered(small_disk, engine="python", keep_local=1)
    first, second = (f"gs://{gcs_bucket}/run/{name}.ckpt" for name in ("first", "second"))
    plugin.save_checkpoint(checkpoint(1, 700_000), first)  # 2.8 MB of a 6 MiB disk
    plugin.teardown()  # durable: it may leave the local tier
    plugin.save_checkpoint(checkpoint(2, 700_000), second)  # fits only once the first has left
    assert [m.uri for m in manifests(small_disk).values()] == [second]
    plugin.teardown()
    assert_is_step(plugin.load_checkpoint(first), 1)  # from GCS


# Removal, teardown and restarts ------------------------------------------------------------------
def test_remove_checkpoint_removes_both_copies(make_tiered, gcs_bucket, tmp_path):
    plugin = make_tiered()
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    plugin.save_checkpoint(checkpoint(1), uri)
    plugin.teardown()
    plugin.remove_checkpoint(uri)
    assert manifests(tmp_path / "tier") == {}
    assert [p for p in (tmp_path / "tier").iterdir() if not p.name.startswith(".")] == []
    assert gcs_reader().list_checkpoints(f"gs://{gcs_bucket}/run/") == []
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(uri)


@pytest.fixture
def uploads_blocked(gcs_proxy: FaultProxy) -> Iterator[threading.Event]:
    """While set, the proxy answers every upload request (POST, PUT) 503."""
    blocked = threading.Event()
    blocked.set()
    gcs_proxy.fault = lambda request, seen: 503 if blocked.is_set() and request.method in ("POST", "PUT") else None
    yield blocked
    gcs_proxy.fault = None


def test_remove_checkpoint_stops_its_pending_upload(proxied, gcs_bucket, uploads_blocked, tmp_path):
    plugin = proxied()
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    plugin.save_checkpoint(checkpoint(1), uri)
    wait_for(lambda: plugin.stats().upload_failures >= 1, "a failed upload attempt", timeout_s=120)
    plugin.remove_checkpoint(uri)
    assert plugin.stats().uploads_pending == 0
    uploads_blocked.clear()
    plugin.teardown()
    assert gcs_reader().list_checkpoints(f"gs://{gcs_bucket}/run/") == []
    assert manifests(tmp_path / "tier") == {}


def test_a_failing_upload_is_retried_with_a_warning_while_saves_go_on(proxied, gcs_bucket, uploads_blocked, caplog):
    plugin = proxied()
    uri = f"gs://{gcs_bucket}/run/last.ckpt"
    with caplog.at_level(logging.WARNING, logger=TIERED_LOG):
        plugin.save_checkpoint(checkpoint(1), uri)
        wait_for(lambda: plugin.stats().upload_failures >= 1, "a failed upload attempt", timeout_s=120)
        plugin.save_checkpoint(checkpoint(2), uri)  # training goes on during the outage
        assert_is_step(plugin.load_checkpoint(uri), 2)
        uploads_blocked.clear()
        plugin.teardown()
    assert f"upload of {uri} to GCS failed" in caplog.text and "trying again in" in caplog.text
    assert_is_step(gcs_reader().load_checkpoint(uri), 2)


def test_a_local_file_changed_after_its_checksum_is_never_uploaded(proxied, gcs_bucket, uploads_blocked, tmp_path,
                                                                   caplog):
    plugin = proxied()
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    with caplog.at_level(logging.WARNING, logger=TIERED_LOG):
        plugin.save_checkpoint(checkpoint(1), uri)
        wait_for(lambda: plugin.stats().upload_failures >= 1, "a failed upload attempt", timeout_s=120)
        with local_file(tmp_path / "tier", uri).open("r+b") as changed:  # in place, as a failing disk would
            changed.seek(-5000, os.SEEK_END)
            byte = changed.read(1)[0]
            changed.seek(-1, os.SEEK_CUR)
            changed.write(bytes([byte ^ 0x10]))
        uploads_blocked.clear()
        plugin.teardown()
    assert f"not uploading {uri}" in caplog.text and "they were written with" in caplog.text
    assert gcs_reader().list_checkpoints(f"gs://{gcs_bucket}/run/") == []


def test_teardown_waits_with_a_deadline_and_a_restart_finishes_the_upload(
        proxied, make_tiered, gcs_bucket, uploads_blocked, tmp_path, caplog):
    plugin = proxied(teardown_timeout_s=1.0)
    uri = f"gs://{gcs_bucket}/run/a.ckpt"
    plugin.save_checkpoint(checkpoint(4), uri)
    with caplog.at_level(logging.INFO, logger=TIERED_LOG):
        start = time.monotonic()
        plugin.teardown()
    assert time.monotonic() - start < 60  # the deadline, and stopping the upload attempt running then
    assert f"waiting up to 1 s for 1 upload(s) to GCS: {uri}" in caplog.text
    assert "did not finish within 1 s" in caplog.text and "the next process writing to it uploads them" in caplog.text
    assert not manifests(tmp_path / "tier")[uri].durable
    with pytest.raises(FileNotFoundError):
        gcs_reader().load_checkpoint(uri)

    caplog.clear()
    blocked = proxied(teardown_timeout_s=1.0)  # a restart on the same node while GCS still refuses uploads
    with caplog.at_level(logging.INFO, logger=TIERED_LOG):
        blocked.preflight([])
        blocked.teardown()
    assert f"waiting up to 1 s for 1 upload(s) to GCS: {uri}" in caplog.text  # the one left pending, by name
    assert f"1 upload(s) to GCS did not finish within 1 s: {uri}" in caplog.text
    uploads_blocked.clear()
    restarted = make_tiered()  # the same local_dir, as a process restarted on the same node
    with caplog.at_level(logging.INFO, logger=TIERED_LOG):
        restarted.preflight([])
        restarted.teardown()
    assert f"finishing the upload of {uri}" in caplog.text
    assert manifests(tmp_path / "tier")[uri].durable
    assert_is_step(gcs_reader().load_checkpoint(uri), 4)


def test_one_writer_per_local_dir(make_tiered, gcs_bucket):
    first, second = make_tiered(), make_tiered()
    first.save_checkpoint(checkpoint(1, 1000), f"gs://{gcs_bucket}/run/a.ckpt")
    with pytest.raises(LocalTierInUseError, match=f"in use by another process \\(pid {os.getpid()}\\)"):
        second.save_checkpoint(checkpoint(1, 1000), f"gs://{gcs_bucket}/run/b.ckpt")
    first.teardown()
    second.save_checkpoint(checkpoint(2, 1000), f"gs://{gcs_bucket}/run/b.ckpt")  # the tier is free again
    assert_is_step(second.load_checkpoint(f"gs://{gcs_bucket}/run/a.ckpt"), 1)  # and the first's checkpoint is there


# Lightning: ckpt_path="last" over both tiers -----------------------------------------------------
class StepModel(BoringModel):
    def on_train_start(self):
        self.start_step = self.trainer.global_step  # where the run resumed


def fit(plugin: TieredCheckpointIO, dirpath: str, max_steps: int, ckpt_path: str | None = None) -> int:
    """Fit to ``max_steps``, saving every step and last.ckpt to ``dirpath``; the step it started at."""
    trainer = Trainer(max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1, plugins=[plugin],
                      callbacks=[DatafluxModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_last=True)])
    model = StepModel()
    trainer.fit(model, ckpt_path=ckpt_path)
    assert trainer.global_step == max_steps
    return model.start_step


@pytest.mark.slow
def test_ckpt_path_last_resumes_from_the_newest_whole_checkpoint_over_both_tiers(make_tiered, gcs_bucket, tmp_path):
    dirpath = f"gs://{gcs_bucket}/run"
    # Rounds 2 and 4 go to GCS: GCS's last.ckpt is step 4, the local tier's is step 5.
    assert fit(make_tiered(tmp_path / "node-a", remote_every=2), dirpath, max_steps=5) == 0
    assert gcs_reader().load_checkpoint(f"{dirpath}/last.ckpt")["global_step"] == 4

    # The same node resumes from its local tier's newer last.ckpt (its rounds count from its start:
    # step 7 is its second, uploaded, step 8 is not); a new node resumes from GCS's.
    assert fit(make_tiered(tmp_path / "node-a", remote_every=2), dirpath, max_steps=8, ckpt_path="last") == 5
    assert fit(make_tiered(tmp_path / "node-b", remote_every=2), dirpath, max_steps=9, ckpt_path="last") == 7


@pytest.mark.slow
def test_ckpt_path_last_finds_a_last_checkpoint_never_uploaded(make_tiered, gcs_bucket, tmp_path):
    dirpath = f"gs://{gcs_bucket}/run"
    fit(make_tiered(remote_every=100), dirpath, max_steps=3)
    assert gcs_reader().list_checkpoints(f"{dirpath}/") == []
    assert fit(make_tiered(remote_every=100), dirpath, max_steps=4, ckpt_path="last") == 3


# The manifest's boundaries -----------------------------------------------------------------------
versions = st.text("0123456789abcdef", min_size=16, max_size=16)
crcs = st.one_of(st.none(), st.binary(min_size=4, max_size=4).map(lambda b: base64.b64encode(b).decode()))
generations = st.one_of(st.none(), st.integers(1, 2**63))
keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs")), min_size=1, max_size=60).filter(
    lambda key: all(segment not in (".", "..") for segment in key.split("/")))


@given(key=keys, version=versions, size=st.integers(0, 2**63), crc=crcs, saved_at=st.floats(0, 4e9),
       remote=st.booleans(), durable=generations,
       uploaded=st.lists(crcs.filter(lambda crc: crc is not None), max_size=UPLOADED_KEPT).map(tuple),
       published=generations)
def test_every_valid_manifest_round_trips(key, version, size, crc, saved_at, remote, durable, uploaded, published):
    manifest = Manifest(f"gs://bucket-a/{key}", version, size, crc, saved_at, remote, durable, uploaded, published)
    assert Manifest.from_json(manifest.to_json()) == manifest


VALID = {"uri": "gs://bucket-a/run/x.ckpt", "version": "0123456789abcdef", "size": 10, "crc32c": "AAAAAA==",
         "saved_at": 1.0, "remote": True, "durable_generation": None, "uploaded_crc32c": (),
         "published_generation": None}


@pytest.mark.parametrize(("field", "value"), [
    ("uri", "s3://bucket-a/x"), ("uri", "gs://b/x"), ("uri", 3), ("version", "0123456789abcde"),
    ("version", "0123456789abcdef0"), ("version", "0123456789ABCDEF"), ("size", -1), ("size", True), ("size", 1.5),
    ("crc32c", "AAAA"), ("crc32c", "AAAAAAA="), ("crc32c", "not base64"), ("saved_at", -1.0),
    ("saved_at", float("inf")), ("remote", 1), ("durable_generation", 0), ("uploaded_crc32c", ["AAAA"]),
    ("uploaded_crc32c", ["AAAAAA=="] * (UPLOADED_KEPT + 1)), ("uploaded_crc32c", "AAAAAA=="),
    ("durable_generation", True), ("published_generation", 0), ("published_generation", 1.5)])
def test_a_manifest_field_out_of_range_is_refused_by_name(field, value):
    with pytest.raises(ManifestError, match=field):
        Manifest(**{**VALID, field: value})


@pytest.mark.parametrize("stored", [b"", b"{", b"[]", b'{"format": 2}', b'{"format": 1}'])
def test_what_is_not_a_manifest_is_refused(stored):
    import json

    with pytest.raises(ManifestError):
        Manifest.from_json(stored)
    with pytest.raises(ManifestError, match="fields"):
        Manifest.from_json(json.dumps({"format": 1, **VALID, "extra": 1}).encode())


@pytest.fixture(scope="module")
def saved_tier(gcs_emulator, tmp_path_factory) -> Iterator[tuple[TieredCheckpointIO, str, Path, bytes]]:
    """One durable checkpoint, its plugin (reading only) and its local file's bytes."""
    gcs_emulator.create_bucket(bucket := "tiered-boundaries")
    local_dir = tmp_path_factory.mktemp("tier")
    uri = f"gs://{bucket}/run/a.ckpt"
    writer = TieredCheckpointIO(local_dir, chunk_size=RESUMABLE_CHUNK_MULTIPLE_BYTES, retry=FAST_RETRY, io_buffer_mb=8)
    writer.save_checkpoint(checkpoint(2, 1000), uri)
    writer.teardown()
    reader = TieredCheckpointIO(local_dir, retry=FAST_RETRY)
    path = local_file(local_dir, uri)
    yield reader, uri, path, path.read_bytes()
    reader.teardown()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_local_copy_is_used_only_when_every_byte_matches_its_manifest(saved_tier, data, caplog):
    plugin, uri, path, original = saved_tier
    change = data.draw(st.sampled_from(["none", "flip", "shorter", "longer"]))
    damaged = bytearray(original)
    if change == "flip":
        at = data.draw(st.integers(0, len(original) - 1))
        damaged[at] ^= 1 << data.draw(st.integers(0, 7))
    elif change == "shorter":
        damaged = damaged[: data.draw(st.integers(0, len(original) - 1))]
    elif change == "longer":
        damaged += bytes(data.draw(st.integers(1, 4096)))
    path.write_bytes(damaged)
    try:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=TIERED_LOG):
            assert_is_step(plugin.load_checkpoint(uri), 2)
        assert ("from the local tier" in caplog.text) == (change == "none")
    finally:
        path.write_bytes(original)


# Options and extras ------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "error"), [
    ("remote_every", 0, ValueError), ("remote_every", True, TypeError), ("keep_local", 0, ValueError),
    ("keep_local", 1.0, TypeError), ("min_free_bytes", -1, ValueError), ("teardown_timeout_s", 0, ValueError),
    ("teardown_timeout_s", float("nan"), ValueError), ("io_buffer_mb", "8", TypeError), ("engine", "fast", ValueError)])
def test_options_are_checked_once_and_named(tmp_path, field, value, error):
    with pytest.raises(error, match=f"TieredOptions.{field}"):
        TieredOptions(local_dir=str(tmp_path), **{field: value})
    with pytest.raises(error, match=f"TieredOptions.{field}"):
        TieredCheckpointIO(tmp_path, **{field: value})


def test_local_dir_must_be_local(tmp_path):
    with pytest.raises(ValueError, match="TieredOptions.local_dir must be a local directory"):
        TieredCheckpointIO("gs://bucket-a/tier")
    assert TieredOptions(local_dir="relative").local_dir == os.path.abspath("relative")
    assert TieredCheckpointIO(tmp_path, chunk_size=2**20).chunk_size == 2**20  # Dataflux's options too


def test_import_dataflux_ckpt_needs_only_gcs_and_the_class_names_the_nvme_extra(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["fastpersist"] = sys.modules["deepspeed"] = None  # as if [nvme] were not installed
        import dataflux_ckpt
        tiered = dataflux_ckpt.TieredCheckpointIO  # the class imports; using it names the extra
        for missing in ("fastpersist", "deepspeed"):
            try:
                tiered({str(tmp_path)!r})
            except ImportError as exc:
                print(missing, "|", exc)
            del sys.modules["fastpersist"]  # FastPersist is back; DeepSpeed is still missing
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["fastpersist", "deepspeed"]
    assert all("needs the [nvme] extra" in line and "lightning-storage-plugins[gcs,nvme]" in line for line in lines)


# A GCS outage during the upload (toxiproxy) ------------------------------------------------------
def set_enabled(toxiproxy, name: str, enabled: bool) -> None:
    """Open or cut a toxiproxy proxy (cut: its connections close and new ones are refused)."""
    import http.client
    import json

    connection = http.client.HTTPConnection(toxiproxy.host, toxiproxy.api_port, timeout=10)
    try:
        connection.request("POST", f"/proxies/{name}", body=json.dumps({"enabled": enabled}),
                           headers={"Content-Type": "application/json"})
        assert connection.getresponse().status == 200
    finally:
        connection.close()


@pytest.mark.slow
def test_a_gcs_outage_during_the_upload_lets_training_go_on_and_the_upload_resumes(
        make_tiered, gcs_emulator, gcs_bucket, caplog):
    from benchmarks.network import Toxiproxy, parse_network
    from tests.support.gcs import client_for

    with Toxiproxy() as toxiproxy:
        # 2 MB/s per connection: a 4 MB checkpoint's upload takes a while, and the outage lands in it.
        url = toxiproxy.proxy("gcs", gcs_emulator.url, parse_network("cloud:2,0"))
        plugin = make_tiered(storage_client=client_for(url))
        uri = f"gs://{gcs_bucket}/run/last.ckpt"
        with caplog.at_level(logging.INFO, logger=TIERED_LOG):
            plugin.save_checkpoint(checkpoint(1, 1_000_000), uri)
            time.sleep(0.5)  # into the upload (it needs about 0.7 s a part)
            set_enabled(toxiproxy, "gcs", False)
            wait_for(lambda: plugin.stats().upload_failures >= 1, "a failed upload attempt during the outage", timeout_s=120)
            for step in (2, 3):  # training goes on: the saves return after their local writes
                plugin.save_checkpoint(checkpoint(step, 1_000_000), uri)
            assert plugin.stats().uploads_done == 0 and plugin.stats().uploads_pending >= 1
            assert_is_step(plugin.load_checkpoint(uri), 3)
            set_enabled(toxiproxy, "gcs", True)
            plugin.teardown()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == TIERED_LOG]
    assert any(f"upload of {uri} to GCS failed" in w and "Training goes on" in w for w in warnings), warnings
    assert any("after" in r.getMessage() and "failed attempt" in r.getMessage() for r in caplog.records)
    assert plugin.stats().uploads_pending == 0
    assert_is_step(gcs_reader().load_checkpoint(uri), 3)
