"""A save asked for from a signal handler while the same plugin is saving, on the same thread.

Lightning's Slurm requeue handler (``SLURMEnvironment(auto_requeue=True)``) saves ``hpc_ckpt_N.ckpt``
from inside a signal handler, wherever the main thread then is: possibly inside one of the plugin's
saves. The single-file plugins make such a save when the one it interrupted ends, before that one
returns, so both checkpoints land whole. This is checked with every plugin and FastPersist engine,
also behind ``AsyncCheckpointIO``: with a real signal sent at random points of real saves, with a
signal sent from a precise point of a save (an object the save pickles), and with a real ``Trainer``
whose Slurm handler fires inside a ``ModelCheckpoint`` save. The aio engine's cases run in a forked
child, so that a process abort fails the test instead of ending pytest. The rest checks what can
happen around such a save: a second signal during it, a failure of either save, a removal of its
path (from the handler or from another thread), a load or a teardown asked for from the handler,
and another thread saving meanwhile.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pytest
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_storage_plugins.ordering import OrderedCheckpointIO, SaveOrder
from lightning_storage_plugins.reentry import DeferredOperationError, ReentrantOperationError
from tests.support.direct_io import o_direct_dir
from tests.support.signals import (
    DEFERRAL_LOG,
    Refuses,
    Tripwire,
    deferral_log,
    handler_ran,
    handling,
    result_in_fork,
    result_in_new_process,
    signal_later,
    spread,
)

Result = TypeVar("Result")
MiB = 1 << 20


@dataclass
class Storage:
    """A plugin under test, where it keeps checkpoints, and how large a checkpoint makes a save
    that lasts long enough for signals to land at many points of it."""

    name: str
    make: Callable[[], OrderedCheckpointIO[Any]]
    base: str
    mib: int
    forked: bool  # run the check in a forked child (the aio engine: an abort ends only the child)

    def path(self, name: str) -> str:
        return f"{self.base}/{name}"

    def listing(self) -> list[str]:
        """Everything under ``base``, through fsspec as Lightning sees it (a leftover part object,
        chunk or temporary shows up here)."""
        fs, root = fsspec.core.url_to_fs(self.base)
        fs.invalidate_cache()
        if not fs.exists(root):
            return []
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))

    def run(self, check: Callable[[], Result]) -> Result:
        return result_in_fork(check) if self.forked else check()


PLUGINS = ["fastpersist-aio", "fastpersist-python", "dataflux_ckpt", "smartredis_io"]


@pytest.fixture(params=PLUGINS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    run = uuid.uuid4().hex[:10]
    if request.param.startswith("fastpersist"):
        from fastpersist import FastPersistCheckpointIO
        from fastpersist.aio import aio_unavailable_reason

        engine = request.param.split("-")[1]
        if engine == "aio" and aio_unavailable_reason() is not None:
            pytest.skip(f"DeepSpeed async_io op unavailable: {aio_unavailable_reason()}")
        root = o_direct_dir(tmp_path) / run
        root.mkdir()
        return Storage(request.param, lambda: FastPersistCheckpointIO(io_buffer_mb=4, engine=engine), str(root),
                       mib=24, forked=engine == "aio")
    if request.param == "dataflux_ckpt":
        from dataflux_ckpt import DatafluxCheckpointIO

        bucket = request.getfixturevalue("gcs_bucket")
        return Storage(request.param, DatafluxCheckpointIO, f"gs://{bucket}/{run}", mib=8, forked=False)
    from smartredis_io import SmartRedisCheckpointIO

    address = request.getfixturevalue("redis_server").address
    request.getfixturevalue("monkeypatch").setenv("SSDB", address)  # where fsspec's redis:// lists
    return Storage(request.param, lambda: SmartRedisCheckpointIO(address=address), f"redis://{run}", mib=8,
                   forked=False)


def _checkpoint(step: int, mib: int = 1, **extra: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "state_dict": {
            "weight": torch.randn(mib * MiB // 4, generator=generator),
            "bias": torch.randn(333, generator=generator).to(torch.bfloat16),
            "steps": torch.arange(step, dtype=torch.int64),
        },
        "global_step": step,
        "loops": {"fit_loop": {"epoch": step // 10, "lr": [0.1, 0.01]}},
        **extra,
    }


def _assert_whole(plugin: CheckpointIO, path: str, expected: dict[str, Any]) -> None:
    """``path`` loads, through the plugin, with every tensor and the step of ``expected``."""
    loaded = plugin.load_checkpoint(path)
    assert loaded["global_step"] == expected["global_step"], f"{path}: global_step {loaded['global_step']}"
    assert loaded["loops"] == expected["loops"]
    assert loaded["state_dict"].keys() == expected["state_dict"].keys()
    for name, tensor in expected["state_dict"].items():
        got = loaded["state_dict"][name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"{path}: {name} differs"


def _messages(records: list[logging.LogRecord]) -> list[str]:
    return [record.getMessage() for record in records]


# Every plugin and engine -----------------------------------------------------------------------------
def test_a_save_asked_for_by_a_handler_inside_a_save_lands_whole_right_after_it(storage: Storage) -> None:
    last, hpc = storage.path("last.ckpt"), storage.path("hpc_ckpt_1.ckpt")

    def check() -> dict[str, Any]:
        plugin = storage.make()
        returned: list[bool] = []

        def handler(signum: int, frame: Any) -> None:
            plugin.save_checkpoint(_checkpoint(2), hpc)
            returned.append(True)

        try:
            with deferral_log() as records, handling(handler):
                # The signal is sent while the save pickles the tripwire: after "state_dict" is on its way.
                plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), last)
            assert returned == [True]
            _assert_whole(plugin, last, _checkpoint(1))
            _assert_whole(plugin, hpc, _checkpoint(2))
        finally:
            plugin.teardown()
        return {"log": _messages(records), "describe": (plugin._describe(plugin._target(last)),
                                                         plugin._describe(plugin._target(hpc)))}

    outcome = storage.run(check)
    outer, inner = outcome["describe"]
    assert any(re.match(rf"saving {re.escape(inner)} now: it was asked for [\d.]+ s ago while this thread was "
                        rf"saving {re.escape(outer)} \(from a signal handler", line) for line in outcome["log"])
    assert any(line.startswith(f"saving {inner} done") for line in outcome["log"])
    assert storage.listing() == ["hpc_ckpt_1.ckpt", "last.ckpt"]


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "async"])
def test_saves_asked_for_by_signals_at_random_points_of_a_save_land_whole(storage: Storage, wrapped: bool) -> None:
    """A real SIGUSR1 at a random point of each save (one in each slice of the save's measured
    duration), whose handler saves another checkpoint through the same plugin, as Lightning's Slurm
    handler does; behind ``AsyncCheckpointIO`` the signal comes while Lightning's thread saves."""
    rounds = 5

    def check() -> int:
        plugin = storage.make()
        outer, inner = _checkpoint(10, storage.mib), _checkpoint(11, max(1, storage.mib // 4))
        handled = threading.Event()
        try:
            plugin.save_checkpoint(outer, storage.path("warm-up.ckpt"))  # connections and buffers made
            start = time.perf_counter()
            plugin.save_checkpoint(outer, storage.path("warm-up.ckpt"))
            duration = time.perf_counter() - start
            with deferral_log() as records:
                for index, delay in enumerate(spread(duration, rounds, seed=PLUGINS.index(storage.name))):
                    last, hpc = storage.path(f"last-{index}.ckpt"), storage.path(f"hpc_ckpt_{index}.ckpt")

                    # Lightning 2.5's AsyncCheckpointIO cannot be used again after its teardown.
                    checkpoint_io: CheckpointIO = AsyncCheckpointIO(plugin) if wrapped else plugin

                    def handler(signum: int, frame: Any, hpc: str = hpc, checkpoint_io: CheckpointIO = checkpoint_io) -> None:
                        checkpoint_io.save_checkpoint(inner, hpc)
                        handled.set()

                    handled.clear()
                    with handling(handler):
                        try:
                            if wrapped:
                                checkpoint_io.save_checkpoint(outer, last)  # returns once queued
                                sender = signal_later(delay)
                            else:
                                sender = signal_later(delay)
                                checkpoint_io.save_checkpoint(outer, last)
                            assert handler_ran(handled), "the signal was never handled"
                            sender.join()
                        finally:
                            if wrapped:
                                checkpoint_io.teardown()  # waits for both saves
                    _assert_whole(plugin, last, outer)
                    _assert_whole(plugin, hpc, inner)
        finally:
            plugin.teardown()
        return sum(" now: it was asked for " in line for line in _messages(records))

    deferred = storage.run(check)
    if wrapped:  # the handler's save is queued behind the running one on Lightning's thread
        assert deferred == 0
    else:
        assert deferred >= 1, "no signal landed inside a save"
    expected = {"warm-up.ckpt", *(f"last-{i}.ckpt" for i in range(rounds)), *(f"hpc_ckpt_{i}.ckpt" for i in range(rounds))}
    assert set(storage.listing()) == expected


# Around a deferred save (the base class's behaviour, on local files) ------------------------------------
@pytest.fixture
def local(tmp_path: Path) -> Iterator[tuple[OrderedCheckpointIO[Any], Path]]:
    from fastpersist import FastPersistCheckpointIO

    plugin = FastPersistCheckpointIO(io_buffer_mb=1, engine="python")
    try:
        yield plugin, o_direct_dir(tmp_path)
    finally:
        plugin.teardown()


def test_a_second_signal_during_the_deferred_save_is_saved_after_it(local: tuple[OrderedCheckpointIO[Any], Path]) -> None:
    plugin, root = local
    queue = [(root / "hpc_ckpt_1.ckpt", _checkpoint(2, tripwire=Tripwire())), (root / "hpc_ckpt_2.ckpt", _checkpoint(3))]

    def handler(signum: int, frame: Any) -> None:
        path, checkpoint = queue.pop(0)  # the first one's save sends the second signal
        plugin.save_checkpoint(checkpoint, path)

    with deferral_log() as records, handling(handler):
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), root / "last.ckpt")
    assert queue == []
    _assert_whole(plugin, str(root / "last.ckpt"), _checkpoint(1))
    _assert_whole(plugin, str(root / "hpc_ckpt_1.ckpt"), _checkpoint(2))
    _assert_whole(plugin, str(root / "hpc_ckpt_2.ckpt"), _checkpoint(3))
    started = [line.split(" now:")[0] for line in _messages(records) if " now: " in line]
    assert started == [f"saving {root / 'hpc_ckpt_1.ckpt'}", f"saving {root / 'hpc_ckpt_2.ckpt'}"]
    assert all(f"while this thread was saving {root / 'last.ckpt'}" in line
               for line in _messages(records) if " now: " in line)


def test_a_failed_save_still_makes_the_save_deferred_behind_it_and_raises_its_own_error(
    local: tuple[OrderedCheckpointIO[Any], Path],
) -> None:
    plugin, root = local
    plugin.save_checkpoint(_checkpoint(0), root / "last.ckpt")

    def handler(signum: int, frame: Any) -> None:
        plugin.save_checkpoint(_checkpoint(2), root / "hpc_ckpt_1.ckpt")

    with handling(handler), pytest.raises(RuntimeError, match="refuses to be pickled"):
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire(), refuses=Refuses()), root / "last.ckpt")
    _assert_whole(plugin, str(root / "last.ckpt"), _checkpoint(0))  # the failed save left the previous one
    _assert_whole(plugin, str(root / "hpc_ckpt_1.ckpt"), _checkpoint(2))
    assert sorted(os.listdir(root)) == ["hpc_ckpt_1.ckpt", "last.ckpt"]


def test_a_failed_deferred_save_is_raised_by_the_save_it_waited_for(
    local: tuple[OrderedCheckpointIO[Any], Path], caplog: pytest.LogCaptureFixture,
) -> None:
    plugin, root = local
    hpc = root / "hpc_ckpt_1.ckpt"

    def handler(signum: int, frame: Any) -> None:
        plugin.save_checkpoint(_checkpoint(2, refuses=Refuses()), hpc)

    with handling(handler), pytest.raises(DeferredOperationError) as caught:
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), root / "last.ckpt")
    assert caught.value.operation == f"saving {hpc}" and caught.value.during == f"saving {root / 'last.ckpt'}"
    assert isinstance(caught.value.__cause__, RuntimeError) and "refuses to be pickled" in str(caught.value)
    _assert_whole(plugin, str(root / "last.ckpt"), _checkpoint(1))
    assert not hpc.exists()

    # Both fail: the interrupted save's own error is raised; the deferred one's is logged, and noted on it.
    caplog.set_level(logging.ERROR, DEFERRAL_LOG)
    with handling(handler), pytest.raises(RuntimeError, match="refuses to be pickled") as both:
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire(), refuses=Refuses()), root / "other.ckpt")
    assert not isinstance(both.value, DeferredOperationError)
    assert any(r.levelno == logging.ERROR and f"saving {hpc} failed" in r.getMessage() for r in caplog.records)
    if hasattr(both.value, "__notes__"):
        assert any(f"saving {hpc} failed" in note for note in both.value.__notes__)
    assert sorted(os.listdir(root)) == ["last.ckpt"]


def test_a_removal_asked_for_by_the_handler_skips_the_save_it_deferred_before(
    local: tuple[OrderedCheckpointIO[Any], Path],
) -> None:
    plugin, root = local
    plugin.save_checkpoint(_checkpoint(0), root / "old.ckpt")

    def handler(signum: int, frame: Any) -> None:
        plugin.save_checkpoint(_checkpoint(2), root / "hpc_ckpt_1.ckpt")
        plugin.remove_checkpoint(root / "hpc_ckpt_1.ckpt")
        plugin.remove_checkpoint(root / "old.ckpt")
        plugin.save_checkpoint(_checkpoint(3), root / "old.ckpt")  # asked for after its removal: kept

    with deferral_log() as records, handling(handler):
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), root / "last.ckpt")
    assert sorted(os.listdir(root)) == ["last.ckpt", "old.ckpt"]
    _assert_whole(plugin, str(root / "old.ckpt"), _checkpoint(3))
    assert f"saving {root / 'hpc_ckpt_1.ckpt'} skipped: a removal of it came first" in _messages(records)


def test_a_removal_from_another_thread_skips_a_deferred_save(local: tuple[OrderedCheckpointIO[Any], Path]) -> None:
    plugin, root = local
    hpc = root / "hpc_ckpt_1.ckpt"

    def handler(signum: int, frame: Any) -> None:
        plugin.save_checkpoint(_checkpoint(2), hpc)
        remover = threading.Thread(target=plugin.remove_checkpoint, args=(hpc,))
        remover.start()  # as AsyncCheckpointIO's thread or a callback's would, while the save waits
        remover.join()

    with handling(handler):
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), root / "last.ckpt")
    assert sorted(os.listdir(root)) == ["last.ckpt"]
    plugin.save_checkpoint(_checkpoint(2), hpc)  # a later save of the path is not skipped
    _assert_whole(plugin, str(hpc), _checkpoint(2))


def test_a_load_asked_for_by_the_handler_is_refused_and_the_save_goes_on(
    local: tuple[OrderedCheckpointIO[Any], Path],
) -> None:
    plugin, root = local
    plugin.save_checkpoint(_checkpoint(0), root / "old.ckpt")
    refused: list[ReentrantOperationError] = []

    def handler(signum: int, frame: Any) -> None:
        with pytest.raises(ReentrantOperationError) as caught:
            plugin.load_checkpoint(root / "old.ckpt")
        refused.append(caught.value)

    with handling(handler):
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), root / "last.ckpt")
    assert [(e.busy, e.refused) for e in refused] == [(f"saving {root / 'last.ckpt'}", f"loading {root / 'old.ckpt'}")]
    assert str(root / "old.ckpt") in str(refused[0]) and str(root / "last.ckpt") in str(refused[0])
    _assert_whole(plugin, str(root / "last.ckpt"), _checkpoint(1))


def test_a_save_asked_for_during_a_load_lands_before_the_load_returns(
    local: tuple[OrderedCheckpointIO[Any], Path],
) -> None:
    plugin, root = local
    plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire(on_load=True)), root / "last.ckpt")
    hpc = root / "hpc_ckpt_1.ckpt"
    seen: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        plugin.save_checkpoint(_checkpoint(2), hpc)
        seen.append(hpc.exists())

    with handling(handler):  # a trusted checkpoint whose unpickling sends the signal
        loaded = plugin.load_checkpoint(root / "last.ckpt", weights_only=False)
        assert hpc.exists()
    assert seen == [False] and loaded["global_step"] == 1
    _assert_whole(plugin, str(hpc), _checkpoint(2))


def test_a_teardown_asked_for_by_the_handler_waits_for_the_save(local: tuple[OrderedCheckpointIO[Any], Path]) -> None:
    plugin, root = local

    def handler(signum: int, frame: Any) -> None:
        plugin.save_checkpoint(_checkpoint(2), root / "hpc_ckpt_1.ckpt")
        plugin.teardown()  # the buffers in use are freed after the save, then the deferred save makes new ones

    with deferral_log() as records, handling(handler):
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), root / "last.ckpt")
    _assert_whole(plugin, str(root / "last.ckpt"), _checkpoint(1))
    _assert_whole(plugin, str(root / "hpc_ckpt_1.ckpt"), _checkpoint(2))
    started = [line.split(" now:")[0] for line in _messages(records) if " now: " in line]
    assert started == [f"saving {root / 'hpc_ckpt_1.ckpt'}", "tearing down FastPersistCheckpointIO"]


def test_a_save_from_another_thread_during_a_save_lands_too(storage: Storage) -> None:
    def check() -> list[str]:
        plugin = storage.make()
        errors: list[BaseException] = []

        def save_beside() -> None:
            try:
                plugin.save_checkpoint(_checkpoint(2, mib=2), storage.path("beside.ckpt"))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        try:
            with deferral_log() as records:
                beside = threading.Thread(target=save_beside)
                beside.start()
                plugin.save_checkpoint(_checkpoint(1, mib=2), storage.path("main.ckpt"))
                beside.join()
            assert errors == []
            _assert_whole(plugin, storage.path("main.ckpt"), _checkpoint(1, mib=2))
            _assert_whole(plugin, storage.path("beside.ckpt"), _checkpoint(2, mib=2))
        finally:
            plugin.teardown()
        return _messages(records)

    assert not any(" now: " in line for line in storage.run(check))  # only a save re-entering its own thread is deferred
    assert storage.listing() == ["beside.ckpt", "main.ckpt"]


# SaveOrder's queued saves ------------------------------------------------------------------------------
def test_a_removal_skips_a_queued_save_and_only_that_one() -> None:
    stored: set[str] = set()
    order = SaveOrder(lambda key: key in stored)
    queued, other = order.queue("a"), order.queue("b")
    order.removing("a")
    assert order.begin_save("a", queued) is False
    assert order.begin_save("b", other) is True and order.end_save("b") is False
    assert order.begin_save("a") is True and order.end_save("a") is False  # asked for after the removal
    kept = order.queue("c")
    order.discard(kept)  # a queued save that will not begin is forgotten: a removal finds nothing
    order.removing("c")
    assert order.begin_save("c") is True


def test_a_removal_during_a_queued_saves_run_removes_it_once_landed() -> None:
    order = SaveOrder(lambda key: False)
    queued = order.queue("a")
    assert order.begin_save("a", queued) is True
    order.removing("a")
    assert order.end_save("a") is True


def test_a_removal_made_later_keeps_the_saves_queued_after_it_was_asked_for() -> None:
    order = SaveOrder(lambda key: False)
    before = order.queue("a")
    asked = order.turn()  # the removal is asked for here and made below
    after = order.queue("a")
    order.removing("a", queued_before=asked)
    assert order.begin_save("a", before) is False
    assert order.begin_save("a", after) is True and order.end_save("a") is False


# Lightning's Slurm requeue handler ---------------------------------------------------------------------
def _large_model() -> Any:
    """A BoringModel with 32 MiB more parameters, so that a save lasts long enough for the signal,
    sent when its temporary file appears, to land inside it."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class LargeModel(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.large = torch.nn.Parameter(torch.randn(8 * MiB))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LargeModel()


def _signal_when_a_save_starts(directory: Path, stop: threading.Event) -> threading.Thread:
    """A thread that sends SIGUSR1 to this process once, when a FastPersist temporary file (a save
    in progress) appears in ``directory``."""
    def watch() -> None:
        while not stop.is_set():
            if directory.is_dir() and any(name.endswith(".fastpersist.tmp") for name in os.listdir(directory)):
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            stop.wait(0.001)  # polling a directory: there is nothing to wait on

    thread = threading.Thread(target=watch, name="slurm-signal", daemon=True)
    thread.start()
    return thread


def _fit_under_slurms_requeue_handler(root: Path, dirpath: Path, engine: str) -> dict[str, Any]:
    """Train 3 steps with Lightning's SLURMEnvironment(auto_requeue=True) and FastPersist, a checkpoint
    each step, SIGUSR1 sent when the first save starts; what the deferral logged."""
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fastpersist import FastPersistCheckpointIO

    stop = threading.Event()
    trainer = Trainer(
        default_root_dir=root, max_steps=3, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
        plugins=[SLURMEnvironment(auto_requeue=True), FastPersistCheckpointIO(io_buffer_mb=4, engine=engine)],
        callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)],
    )
    with deferral_log() as records:
        watcher = _signal_when_a_save_starts(dirpath, stop)
        try:
            trainer.fit(_large_model())
        finally:
            stop.set()
            watcher.join()
    return {"log": _messages(records)}


@pytest.mark.parametrize("engine", ["aio", "python"])
def test_lightnings_slurm_handler_firing_inside_a_model_checkpoint_save_leaves_both_checkpoints_whole(
    engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastpersist.aio import aio_unavailable_reason

    if engine == "aio" and aio_unavailable_reason() is not None:
        pytest.skip(f"DeepSpeed async_io op unavailable: {aio_unavailable_reason()}")
    root = o_direct_dir(tmp_path)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # Slurm itself is not needed to see what the handler asks of it
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {root / "scontrol.log"}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train"}.items():
        monkeypatch.setenv(name, value)
    dirpath = root / "checkpoints"

    # Lightning's handlers and MASTER_PORT stay in the child, a new process (it trains)
    outcome = result_in_new_process(_fit_under_slurms_requeue_handler, root, dirpath, engine)
    hpc = root / "hpc_ckpt_1.ckpt"
    deferred = [line for line in outcome["log"] if line.startswith(f"saving {hpc} now: ")]
    assert len(deferred) == 1, outcome["log"]
    outer = Path(re.search(r"while this thread was saving (\S+) ", deferred[0]).group(1))
    assert outer.parent == dirpath
    assert (root / "scontrol.log").read_text().split() == ["requeue", "4242"]
    hpc_state, outer_state = torch.load(hpc, weights_only=True), torch.load(outer, weights_only=True)
    assert hpc_state["global_step"] == outer_state["global_step"] == int(re.search(r"step=(\d+)", outer.name).group(1))
    assert hpc_state["state_dict"].keys() == outer_state["state_dict"].keys()
    for name, tensor in outer_state["state_dict"].items():  # the same moment of training, whole in both
        assert torch.equal(hpc_state["state_dict"][name], tensor), name
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
