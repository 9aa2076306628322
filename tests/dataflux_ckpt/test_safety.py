"""Saves under concurrency, stalls and crashes, driven by real threads, processes and signals."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from dataflux_ckpt import (
    ConcurrentWriteError,
    DatafluxCheckpointIO,
    Deadline,
    DeadlineExceededError,
    Gcs,
    TransferError,
)
from dataflux_ckpt.checkpoint_io import RESUMABLE_CHUNK_MULTIPLE_BYTES as C
from dataflux_ckpt.testing import FakeGcsServer
from dataflux_ckpt.upload import PART_OBJECT_SUFFIX, PARTS_SUFFIX
from tests.support.gcs import FAST_RETRY, client_for, object_names, uploads_in_progress

# Upload paths and the plugin options that select them (parts are C bytes; checkpoints ~6 C).
UPLOAD_PATHS = {
    "single": {"chunk_size": 64 * C},
    "composite": {"upload_mode": "composite"},
    "xml": {"upload_mode": "xml"},
    "stream": {"use_transfer_manager": False},
}
# The upload paths whose publish carries a generation precondition (the local stack checks them as GCS
# does); XML multipart completions take none, on GCS as here.
PRECONDITIONS_ENFORCED = {"single", "composite", "stream"}


def _state(tag: int) -> dict:
    return {"tag": tag, "w": torch.full((6 * C // 4,), float(tag))}


def _plugin(url: str, **options: object) -> DatafluxCheckpointIO:
    merged = {"chunk_size": C, "stream_chunk_size": C, "max_workers": 3, "retry": FAST_RETRY, **options}
    return DatafluxCheckpointIO(storage_client=client_for(url), **merged)


def _server_url(name: str, gcs_emulator: FakeGcsServer, gcs_xml_server) -> str:
    return gcs_xml_server.url if name == "xml-server" else gcs_emulator.url


CASES = [(server, path) for server in ("emulator", "xml-server") for path in UPLOAD_PATHS
         if not (server == "emulator" and path == "xml")]


@pytest.mark.parametrize(("server", "upload_path"), CASES)
def test_two_writers_to_one_path_leave_exactly_one_whole_checkpoint(server, upload_path, gcs_emulator,
                                                                    gcs_xml_server, gcs_bucket):
    url = _server_url(server, gcs_emulator, gcs_xml_server)
    path = f"gs://{gcs_bucket}/race/last.ckpt"
    plugins = [_plugin(url, **UPLOAD_PATHS[upload_path]) for _ in range(2)]
    for round_ in range(4):
        barrier = threading.Barrier(2)
        outcomes: list[BaseException | None] = [None, None]

        def save(index: int, round_: int = round_, outcomes: list = outcomes, barrier=barrier) -> None:
            barrier.wait()
            try:
                plugins[index].save_checkpoint(_state(10 * round_ + index), path)
            except BaseException as failure:  # the test inspects every outcome
                outcomes[index] = failure

        threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        failed = [exc for exc in outcomes if exc is not None]
        assert all(isinstance(exc, ConcurrentWriteError) for exc in failed), failed
        assert len(failed) < 2
        loaded = plugins[0].load_checkpoint(path)
        winners = {10 * round_ + i for i in range(2) if outcomes[i] is None}
        assert loaded["tag"] in winners
        assert torch.equal(loaded["w"], _state(loaded["tag"])["w"])
    for plugin in plugins:
        plugin.teardown()
    assert object_names(url, gcs_bucket) == ["race/last.ckpt"]
    if server == "xml-server":
        assert uploads_in_progress(url, gcs_bucket) == []


@pytest.mark.parametrize(("server", "upload_path"), CASES)
def test_a_writer_overtaken_by_another_publishes_nothing_where_gcs_has_preconditions(
        server, upload_path, gcs_emulator, gcs_xml_server, gcs_bucket):
    url = _server_url(server, gcs_emulator, gcs_xml_server)
    path = f"gs://{gcs_bucket}/overtaken.ckpt"
    slow, fast = (_plugin(url, **UPLOAD_PATHS[upload_path]) for _ in range(2))
    slow.save_checkpoint(_state(0), path)
    stream = slow.writer(path)  # found generation 1 of ``path``
    torch.save(_state(1), stream)
    fast.save_checkpoint(_state(2), path)  # generation 2 appears meanwhile
    if upload_path in PRECONDITIONS_ENFORCED:
        with pytest.raises(ConcurrentWriteError, match=path):
            stream.close()
        assert fast.load_checkpoint(path)["tag"] == 2
    else:  # the last publish wins, whole
        stream.close()
        assert slow.load_checkpoint(path)["tag"] == 1
    for plugin in (slow, fast):
        plugin.teardown()
    assert object_names(url, gcs_bucket) == ["overtaken.ckpt"]


WRITER_PROCESS = textwrap.dedent(
    """
    import sys
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from dataflux_ckpt import ConcurrentWriteError, Gcs, ObjectWriter, parse_gcs_path

    url, path, tag, chunk = sys.argv[1], parse_gcs_path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    client = storage.Client(project="p", credentials=AnonymousCredentials(), client_options={"api_endpoint": url})
    gcs = Gcs(client)
    for round_ in range(6):
        try:
            with ObjectWriter(gcs, path, chunk_size=chunk, max_workers=3, mode="composite") as stream:
                stream.write(bytes([tag, round_]) * (3 * chunk))
        except ConcurrentWriteError:
            print("overtaken", flush=True)
    gcs.close(30)
    """
)


@pytest.mark.parametrize("server", ["emulator", "xml-server"])
def test_two_writer_processes_to_one_path(server, gcs_emulator, gcs_xml_server, gcs_bucket):
    url = _server_url(server, gcs_emulator, gcs_xml_server)
    path = f"gs://{gcs_bucket}/processes/last.bin"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER_PROCESS, url, path, str(tag), str(C)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tag in (1, 2)]
    for writer in writers:
        _, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err[-2000:]
    with _plugin(url).reader(path) as stream:
        data = stream.read()
    assert data == data[:2] * (3 * C) and data[0] in (1, 2)  # one writer's bytes, whole
    assert object_names(url, gcs_bucket, "processes/") == ["processes/last.bin"]


# Stalls: a SIGSTOPped fake-gcs-server accepts connections and never answers.

DEADLINE_S, CLEANUP_S = 2.0, 1.0
SLACK_S = 3.0


@contextmanager
def _stopped(server: FakeGcsServer) -> Iterator[None]:
    os.kill(server.emulator_pid, signal.SIGSTOP)
    try:
        _wait_for(lambda: _all_threads_stopped(server.emulator_pid))
        yield
    finally:
        os.kill(server.emulator_pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            states.append(stat.read().rpartition(")")[2].split()[0])
    return all(state in ("T", "t") for state in states)


@pytest.fixture
def private_emulator() -> Iterator[FakeGcsServer]:
    """An emulator of this test's own, to stop and start."""
    with FakeGcsServer() as server:
        server.create_bucket("stall")
        yield server


def _stall_plugin(server: FakeGcsServer, **options: object) -> DatafluxCheckpointIO:
    return _plugin(server.url, deadline_s=DEADLINE_S, cleanup_timeout_s=CLEANUP_S, **options)


def _settled(plugin: DatafluxCheckpointIO, path: str) -> dict:
    """The checkpoint at ``path`` once the server has finished what was in flight when it stopped."""
    _wait_for(lambda: _same_object_twice(plugin, path))
    return plugin.load_checkpoint(path)


def _same_object_twice(plugin: DatafluxCheckpointIO, path: str) -> bool:
    first = plugin.list_checkpoints(path)
    time.sleep(0.3)
    try:
        with plugin.reader(path) as stream:
            stream.read()
    except FileNotFoundError:
        return False
    return first == plugin.list_checkpoints(path)


@pytest.mark.parametrize("upload_path", ["single", "composite", "stream"])
def test_save_to_a_stalled_server_fails_within_its_deadline(private_emulator, upload_path):
    plugin = _stall_plugin(private_emulator, **UPLOAD_PATHS[upload_path])
    path = "gs://stall/run/last.ckpt"
    plugin.save_checkpoint(_state(1), path)
    serialized = io.BytesIO()
    torch.save(_state(2), serialized)
    data = serialized.getvalue()
    started = time.monotonic()
    stream = plugin.writer(path)
    stream.write(data[: 2 * C + 1])  # parts on their way (composite), a request sent (stream)
    with _stopped(private_emulator):
        with pytest.raises(DeadlineExceededError, match=rf"^save of {path} did not finish within") as caught, stream:
            stream.write(data[2 * C + 1 :])
        elapsed = time.monotonic() - started
    assert caught.value.operation == "save" and caught.value.target == path
    assert elapsed < DEADLINE_S + CLEANUP_S + SLACK_S
    # A publishing request the server had received whole may still complete once it runs again:
    # the path holds the previous checkpoint or the new one, each whole, never a part of one.
    loaded = _settled(plugin, path)
    assert loaded["tag"] in (1, 2) and torch.equal(loaded["w"], _state(loaded["tag"])["w"])
    plugin.teardown()


@pytest.mark.parametrize("operation", ["load", "remove", "listing", "new save"])
def test_other_operations_on_a_stalled_server_fail_within_their_deadline(private_emulator, operation):
    plugin = _stall_plugin(private_emulator)
    path = "gs://stall/run/last.ckpt"
    plugin.save_checkpoint(_state(1), path)
    calls = {
        "load": lambda: plugin.load_checkpoint(path),
        "remove": lambda: plugin.remove_checkpoint(path),
        "listing": lambda: plugin.list_checkpoints("gs://stall/run/"),
        "new save": lambda: plugin.save_checkpoint(_state(2), path),
    }
    target = "gs://stall/run/" if operation == "listing" else path
    name = "save" if operation == "new save" else operation
    with _stopped(private_emulator):
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=rf"^{name} of {target} did not finish within its deadline of 2 s"):
            calls[operation]()
        assert time.monotonic() - started < DEADLINE_S + CLEANUP_S + SLACK_S
    if operation == "load":
        assert _settled(plugin, path)["tag"] == 1
    plugin.teardown()


def test_download_stalled_midway_fails_within_its_deadline(private_emulator):
    plugin = _stall_plugin(private_emulator)
    path = "gs://stall/big.ckpt"
    plugin.save_checkpoint({"w": torch.zeros(40 * C // 4)}, path)
    stream = plugin.reader(path)  # the object was found; the ranges are on their way
    with _stopped(private_emulator):
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=rf"^load of {path}"), stream:
            stream.read()
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
    plugin.teardown()


def test_failed_download_during_torch_load_raises_the_downloads_own_error(gcs_proxy, gcs_bucket):
    """torch's zip reader reports a failed read as a missing ``read`` attribute; the load says what failed."""
    plugin = _plugin(gcs_proxy.url)
    path = f"gs://{gcs_bucket}/failing.ckpt"
    plugin.save_checkpoint({"w": torch.zeros(10 * C // 4)}, path)
    # The first and last ranges arrive (torch reads the zip's ends first); one in the middle fails.
    gcs_proxy.fault = lambda r, seen: 503 if r.headers.get("Range", "").startswith(f"bytes={4 * C}-") else None
    with pytest.raises(TransferError, match=rf"download of bytes .* of {path}"):
        plugin.load_checkpoint(path)
    plugin.teardown()


# Crashes: what a killed writer leaves is removed by a later save, never a live writer's parts.

CHILD_WRITER = textwrap.dedent(
    """
    import sys, time
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from dataflux_ckpt import ObjectWriter, parse_gcs_path
    from dataflux_ckpt.gcs import Gcs

    url, path, chunk = sys.argv[1], parse_gcs_path(sys.argv[2]), int(sys.argv[3])
    client = storage.Client(project="p", credentials=AnonymousCredentials(), client_options={"api_endpoint": url})
    gcs = Gcs(client)
    stream = ObjectWriter(gcs, path, chunk_size=chunk, max_workers=2, mode="composite",
                          deadline_s=1.5, cleanup_timeout_s=0.5)
    stream.write(b"d" * (5 * chunk))
    print("writing", flush=True)
    time.sleep(120)
    """
)


def _part_uploads(url: str, bucket: str, key: str) -> dict[str, int]:
    """Part objects under ``key``, counted per upload."""
    counts: dict[str, int] = {}
    for name in object_names(url, bucket, key + PARTS_SUFFIX):
        upload = name[len(key + PARTS_SUFFIX):].partition("/")[0]
        counts[upload] = counts.get(upload, 0) + 1
    return counts


def _kill_a_writer_mid_upload(url: str, bucket: str, key: str) -> None:
    """Start a writer process, and SIGKILL it once some of its part objects are stored."""
    child = subprocess.Popen([sys.executable, "-c", CHILD_WRITER, url, f"gs://{bucket}/{key}", str(C)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        _wait_for(lambda: sum(_part_uploads(url, bucket, key).values()) >= 3)
    finally:
        child.kill()
        child.wait(10)


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


def test_parts_of_a_killed_writer_are_removed_by_the_next_save_but_not_a_live_writers(gcs_emulator, gcs_bucket):
    url, key = gcs_emulator.url, "crash/last.ckpt"
    path = f"gs://{gcs_bucket}/{key}"
    _kill_a_writer_mid_upload(url, gcs_bucket, key)
    (dead_upload,) = _part_uploads(url, gcs_bucket, key)
    # What a bucket lifecycle rule (matchesSuffix) finds.
    assert all(name.endswith(PART_OBJECT_SUFFIX) for name in object_names(url, gcs_bucket, key + PARTS_SUFFIX))

    live_plugin = _plugin(url, upload_mode="composite")
    live = live_plugin.writer(path)  # a live writer, with the default (long) deadline
    live.write(b"l" * (3 * C + 1))
    _wait_for(lambda: len(_part_uploads(url, gcs_bucket, key)) == 2)
    time.sleep(3.2)  # the dead writer's lease (1.5 s + 0.5 s) runs out by the server's clock (1 s steps)

    saver = _plugin(url, upload_mode="composite")
    saver.save_checkpoint(_state(7), path)
    saver.teardown()
    remaining = _part_uploads(url, gcs_bucket, key)
    assert dead_upload not in remaining
    assert len(remaining) == 1  # the live writer's parts are untouched
    with pytest.raises(ConcurrentWriteError, match=key):  # overtaken by the save: it publishes nothing
        live.close()
    live_plugin.teardown()
    assert object_names(url, gcs_bucket, "crash/") == [key]


def test_remove_checkpoint_removes_a_dead_writers_parts(gcs_emulator, gcs_bucket):
    url, key = gcs_emulator.url, "crash2/last.ckpt"
    path = f"gs://{gcs_bucket}/{key}"
    _kill_a_writer_mid_upload(url, gcs_bucket, key)
    time.sleep(3.2)
    _plugin(url).remove_checkpoint(path)
    assert object_names(url, gcs_bucket, "crash2/") == []


def test_listing_reports_creation_times_on_the_servers_clock(gcs_emulator, gcs_bucket):
    """Leases are counted on the server's clock: its listing must give both times, readable."""
    client = client_for(gcs_emulator.url)
    client.bucket(gcs_bucket).blob("clock/a").upload_from_string(b"a")
    objects, now = Gcs(client).list_objects(gcs_bucket, "clock/", Deadline(10, "listing", f"gs://{gcs_bucket}/clock/"))
    assert [o.name for o in objects] == ["clock/a"]
    assert now is not None and abs(now - time.time()) < 60
    assert now - 2 <= objects[0].created <= now + 2
