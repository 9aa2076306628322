"""A save asked for from a signal handler while a sharded strategy, or one of its DCP writers or
readers, is saving or loading on the same thread; on one rank (no process group: DCP saves as one).

Lightning's Slurm requeue handler saves ``hpc_ckpt_N.ckpt`` through the strategy from inside a
signal handler, wherever the training thread is; there it may interrupt a save of the same strategy.
The FSDP and ModelParallel strategies of both plugins (FastPersist's python and aio engines, the aio
ones in a forked child so that an abort fails the test instead of ending pytest, and Dataflux on the
emulator) make that save when the interrupted one ends, before it returns: both checkpoints load
whole, the deferred one right after. The handler is fired from a precise point of the shard's write
(an object the save pickles) and by a real signal sent when the shard's file or first part object
appears. Around it: a load and a removal asked for from the handler, a failure of either save, and
a second signal. At the storage level, a save or load asked of the DCP writer or reader in use is
refused with ``ReentrantOperationError``; one through its own writer lands whole.
"""

from __future__ import annotations

import io
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from lightning_storage_plugins.reentry import DeferredOperationError, ReentrantOperationError
from lightning_storage_plugins.sharded import LIGHTNING_STATE_KEY
from tests.support.dcp_requeue import checkpoint_names, checkpoint_reader, load_items, stored_names
from tests.support.signals import (
    Refuses,
    Tripwire,
    deferral_log,
    handler_ran,
    handling,
    result_in_fork,
    to_main_thread,
)

Result = TypeVar("Result")
MiB = 1 << 20
GS_WRITER_OPTIONS = {"chunk_size": 256 * 1024, "max_workers": 2}


@dataclass
class Sharded:
    """A sharded strategy under test and where it keeps checkpoints."""

    name: str
    storage: str  # "nvme" or "gs"
    make: Callable[[], Any]
    root: str
    forked: bool  # run the check in a forked child (the aio engine: an abort ends only the child)
    model_key: str = "model"  # what the strategy stores the model's state dict under

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def run(self, check: Callable[[], Result]) -> Result:
        return result_in_fork(check) if self.forked else check()


def _make(storage: str, kind: str, engine: str = "python") -> Callable[[], Any]:
    if storage == "gs":
        from dataflux_ckpt import DatafluxFSDPStrategy as FSDP
        from dataflux_ckpt import DatafluxModelParallelStrategy as ModelParallel

        options: dict[str, Any] = {"writer_options": dict(GS_WRITER_OPTIONS)}
    else:
        from fastpersist import FastPersistFSDPStrategy as FSDP
        from fastpersist import FastPersistModelParallelStrategy as ModelParallel

        options = {"writer_options": {"io_buffer_mb": 1, "engine": engine}}
    if kind == "fsdp":
        return lambda: FSDP(state_dict_type="sharded", **options)
    return lambda: ModelParallel(data_parallel_size=1, tensor_parallel_size=1, **options)


def _sharded(name: str, kind: str, request: pytest.FixtureRequest) -> Sharded:
    model_key = "model" if kind == "fsdp" else "state_dict"
    if name == "gs":
        return Sharded(f"gs-{kind}", "gs", _make("gs", kind), request.getfixturevalue("gs_root"), False, model_key)
    engine = name.split("-")[1]
    if engine == "aio":
        from fastpersist.aio import aio_unavailable_reason

        if aio_unavailable_reason() is not None:
            pytest.skip(f"DeepSpeed async_io op unavailable: {aio_unavailable_reason()}")
    root = request.getfixturevalue("nvme_root")
    root.mkdir(parents=True)
    return Sharded(f"{name}-{kind}", "nvme", _make("nvme", kind, engine), str(root), engine == "aio", model_key)


@pytest.fixture(params=["nvme-python", "nvme-aio", "gs"])
def sharded(request: pytest.FixtureRequest) -> Sharded:
    return _sharded(request.param, "fsdp", request)


@pytest.fixture
def local(request: pytest.FixtureRequest) -> Sharded:
    """FastPersist's FSDP strategy with the python engine: the base's behaviour around a deferred save."""
    return _sharded("nvme-python", "fsdp", request)


def _checkpoint(step: int, mib: int = 1, **extra: Any) -> dict[str, Any]:
    """A checkpoint dict as Lightning dumps it; ``extra`` goes into its state dict (a tripwire there
    is pickled while the shard is being written, as its own item)."""
    generator = torch.Generator().manual_seed(step)
    return {
        "state_dict": {"layer.weight": torch.randn(mib * MiB // 256, 64, generator=generator),
                       "layer.bias": torch.randn(64, generator=generator).to(torch.bfloat16), **extra},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(64, generator=generator)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "global_step": step,
        "epoch": 0,
    }


def _assert_whole(sharded: Sharded, path: str, expected: dict[str, Any]) -> None:
    """``path`` loads, every item whole (on gs://, checked against its crc32c), with the tensors
    and the step of ``expected``."""
    items = load_items(checkpoint_reader(sharded.storage, path))
    for name, tensor in expected["state_dict"].items():
        if isinstance(tensor, torch.Tensor):
            got = items[f"{sharded.model_key}.{name}"]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"{path}: {name} differs"
    assert torch.equal(items["optimizer_0.state.0.exp_avg"], expected["optimizer_states"][0]["state"][0]["exp_avg"])
    rest = torch.load(io.BytesIO(items[LIGHTNING_STATE_KEY]), weights_only=True)
    assert rest["global_step"] == expected["global_step"], f"{path}: global_step {rest['global_step']}"


def _leftovers(sharded: Sharded, checkpoints: list[str]) -> list[str]:
    """What is stored under the root besides ``checkpoints`` (each: its .metadata, the files it names and,
    on gs://, its commit record), and what of them is missing."""
    expected = set(checkpoint_names(sharded.storage, sharded.root, checkpoints))
    return sorted(set(stored_names(sharded.storage, sharded.root)) ^ expected)


@pytest.fixture
def ordering_log() -> Iterator[list[logging.LogRecord]]:
    """The records the deferral logs inside the test (also in a forked child)."""
    with deferral_log() as records:
        yield records


def _lines(records: list[logging.LogRecord]) -> list[str]:
    return [record.getMessage() for record in records]


def _deferred_lines(log: list[str], inner: str, outer: str) -> bool:
    """Whether the log says the save of ``inner`` waited for the one of ``outer``, and landed."""
    waited = any(re.match(rf"saving {re.escape(inner)} now: it was asked for [\d.]+ s ago while this thread was "
                          rf"saving {re.escape(outer)} \(from a signal handler", line) for line in log)
    return waited and any(line.startswith(f"saving {inner} done") for line in log)


# Every storage and strategy ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
@pytest.mark.parametrize("name", ["nvme-python", "nvme-aio", "gs"])
def test_a_save_asked_for_by_a_handler_inside_a_sharded_save_lands_whole_right_after_it(
    name: str, kind: str, request: pytest.FixtureRequest, ordering_log: list[logging.LogRecord]
) -> None:
    sharded = _sharded(name, kind, request)
    last, hpc = sharded.path("last.ckpt"), sharded.path("hpc_ckpt_1.ckpt")

    def check() -> list[str]:
        strategy = sharded.make()
        returned: list[bool] = []

        def handler(signum: int, frame: Any) -> None:
            strategy.save_checkpoint(_checkpoint(2), hpc)
            returned.append(os.path.basename(hpc) in stored_names(sharded.storage, sharded.root))

        with handling(handler):  # sent while the shard is being written, when the tripwire is pickled
            strategy.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), last)
        assert returned == [False]  # the handler's save was not made inside the interrupted one
        return _lines(ordering_log)

    log = sharded.run(check)
    assert _deferred_lines(log, hpc, last), log
    _assert_whole(sharded, last, _checkpoint(1))
    _assert_whole(sharded, hpc, _checkpoint(2))
    assert _leftovers(sharded, ["hpc_ckpt_1.ckpt", "last.ckpt"]) == []


def _signal_when_writing(sharded: Sharded, stop: threading.Event) -> threading.Thread:
    """A thread that sends SIGUSR1 to the main thread once, when a shard of a save in progress appears
    under the root: FastPersist's temporary shard file, or a part object of a Dataflux upload."""
    writing = re.compile(r"\.distcp\..*\.fastpersist\.tmp$|\.distcp\.dataflux-parts/")

    def watch() -> None:
        client = None
        if sharded.storage == "gs":
            from google.cloud import storage as gcs

            client = gcs.Client()
        while not stop.is_set():
            try:
                names = stored_names(sharded.storage, sharded.root, client)
            except FileNotFoundError:  # a directory went while it was listed
                names = []
            if any(writing.search(name) for name in names):
                to_main_thread()
                return
            stop.wait(0.001)  # a listing: there is nothing to wait on

    thread = threading.Thread(target=watch, name="requeue-signal", daemon=True)
    thread.start()
    return thread


def test_a_signal_sent_when_the_shard_appears_saves_through_the_strategy_right_after_the_save(
    sharded: Sharded, ordering_log: list[logging.LogRecord]
) -> None:
    last, hpc = sharded.path("last.ckpt"), sharded.path("hpc_ckpt_1.ckpt")

    def check() -> list[str]:
        strategy = sharded.make()
        handled = threading.Event()

        def handler(signum: int, frame: Any) -> None:
            strategy.save_checkpoint(_checkpoint(2), hpc)
            handled.set()

        stop = threading.Event()
        with handling(handler):
            watcher = _signal_when_writing(sharded, stop)
            try:
                strategy.save_checkpoint(_checkpoint(1, mib=24), last)
                assert handler_ran(handled), "the shard was never seen being written, or the signal never handled"
            finally:
                stop.set()
                watcher.join()
        return _lines(ordering_log)

    log = sharded.run(check)
    assert _deferred_lines(log, hpc, last), log
    _assert_whole(sharded, last, _checkpoint(1, mib=24))
    _assert_whole(sharded, hpc, _checkpoint(2))
    assert _leftovers(sharded, ["hpc_ckpt_1.ckpt", "last.ckpt"]) == []


# Around a deferred save (the shared base's behaviour, on NVMe) ---------------------------------------------
def test_a_load_asked_for_by_the_handler_is_refused_and_the_save_goes_on(local: Sharded) -> None:
    strategy = local.make()
    strategy.save_checkpoint(_checkpoint(0), local.path("old.ckpt"))
    refused: list[ReentrantOperationError] = []

    def handler(signum: int, frame: Any) -> None:
        with pytest.raises(ReentrantOperationError) as caught:
            strategy.load_checkpoint(local.path("old.ckpt"))
        refused.append(caught.value)

    with handling(handler):
        strategy.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), local.path("last.ckpt"))
    assert [(e.busy, e.refused) for e in refused] == [(f"saving {local.path('last.ckpt')}",
                                                       f"loading {local.path('old.ckpt')}")]
    _assert_whole(local, local.path("last.ckpt"), _checkpoint(1))


def test_a_removal_asked_for_by_the_handler_skips_the_save_it_deferred_before(
    local: Sharded, ordering_log: list[logging.LogRecord]
) -> None:
    strategy = local.make()
    strategy.save_checkpoint(_checkpoint(0), local.path("old.ckpt"))
    hpc = local.path("hpc_ckpt_1.ckpt")

    def handler(signum: int, frame: Any) -> None:
        strategy.save_checkpoint(_checkpoint(2), hpc)
        strategy.remove_checkpoint(hpc)
        strategy.remove_checkpoint(local.path("old.ckpt"))  # it is there: removed once the save has ended

    with handling(handler):
        strategy.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), local.path("last.ckpt"))
    assert sorted(os.listdir(local.root)) == ["last.ckpt"]
    assert f"saving {hpc} skipped: a removal of it came first" in _lines(ordering_log)
    assert any(line.startswith(f"removing {local.path('old.ckpt')} done") for line in _lines(ordering_log))


def test_a_failed_deferred_save_is_raised_by_the_save_it_waited_for(local: Sharded) -> None:
    strategy = local.make()
    hpc = local.path("hpc_ckpt_1.ckpt")

    def handler(signum: int, frame: Any) -> None:
        strategy.save_checkpoint(_checkpoint(2, refuses=Refuses()), hpc)

    with handling(handler), pytest.raises(DeferredOperationError) as caught:
        strategy.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), local.path("last.ckpt"))
    assert caught.value.operation == f"saving {hpc}" and caught.value.during == f"saving {local.path('last.ckpt')}"
    assert isinstance(caught.value.__cause__, CheckpointException)  # DCP's, raised on every rank alike
    _assert_whole(local, local.path("last.ckpt"), _checkpoint(1))
    assert _leftovers(local, ["last.ckpt"]) == []


def test_a_save_that_dcp_failed_on_every_rank_still_makes_the_save_deferred_behind_it(local: Sharded) -> None:
    strategy = local.make()
    strategy.save_checkpoint(_checkpoint(0), local.path("last.ckpt"))

    def handler(signum: int, frame: Any) -> None:
        strategy.save_checkpoint(_checkpoint(2), local.path("hpc_ckpt_1.ckpt"))

    with handling(handler), pytest.raises(CheckpointException):
        strategy.save_checkpoint(_checkpoint(1, tripwire=Tripwire(), refuses=Refuses()), local.path("last.ckpt"))
    _assert_whole(local, local.path("last.ckpt"), _checkpoint(0))  # the failed save left the previous one
    _assert_whole(local, local.path("hpc_ckpt_1.ckpt"), _checkpoint(2))
    assert _leftovers(local, ["hpc_ckpt_1.ckpt", "last.ckpt"]) == []


def test_a_save_that_failed_on_this_rank_alone_drops_the_collective_save_deferred_behind_it(
    local: Sharded, ordering_log: list[logging.LogRecord]
) -> None:
    """A failure before DCP's save (here, pickling Lightning's own state) is this rank's: the other
    ranks may be inside DCP's collectives, which a deferred save could not meet."""
    strategy = local.make()
    hpc = local.path("hpc_ckpt_1.ckpt")

    def handler(signum: int, frame: Any) -> None:
        strategy.save_checkpoint(_checkpoint(2), hpc)

    outer = {**_checkpoint(1), "callbacks": {"tripwire": Tripwire(), "refuses": Refuses()}}
    with handling(handler), pytest.raises(RuntimeError, match="refuses to be pickled"):
        strategy.save_checkpoint(outer, local.path("last.ckpt"))
    assert not os.path.exists(hpc) and not os.path.exists(local.path("last.ckpt"))
    assert any(line.startswith(f"saving {hpc} was not done: it was asked for while this thread was saving "
                               f"{local.path('last.ckpt')}, and was still waiting when that failed") for line in _lines(ordering_log))


def test_a_second_signal_during_the_deferred_save_is_saved_after_it(local: Sharded, ordering_log: list[logging.LogRecord]) -> None:
    strategy = local.make()
    queue = [(local.path("hpc_ckpt_1.ckpt"), _checkpoint(2, tripwire=Tripwire())),
             (local.path("hpc_ckpt_2.ckpt"), _checkpoint(3))]

    def handler(signum: int, frame: Any) -> None:
        path, checkpoint = queue.pop(0)  # the first one's save sends the second signal
        strategy.save_checkpoint(checkpoint, path)

    with handling(handler):
        strategy.save_checkpoint(_checkpoint(1, tripwire=Tripwire()), local.path("last.ckpt"))
    assert queue == []
    started = [line.split(" now:")[0] for line in _lines(ordering_log) if " now: " in line]
    assert started == [f"saving {local.path('hpc_ckpt_1.ckpt')}", f"saving {local.path('hpc_ckpt_2.ckpt')}"]
    _assert_whole(local, local.path("hpc_ckpt_1.ckpt"), _checkpoint(2))
    _assert_whole(local, local.path("hpc_ckpt_2.ckpt"), _checkpoint(3))
    _assert_whole(local, local.path("last.ckpt"), _checkpoint(1))


# The DCP writers and readers ------------------------------------------------------------------------------
@pytest.fixture(params=["nvme", "gs"])
def storage_root(request: pytest.FixtureRequest) -> tuple[str, str]:
    if request.param == "gs":
        return "gs", request.getfixturevalue("gs_root")
    root = request.getfixturevalue("nvme_root")
    root.mkdir(parents=True)
    return "nvme", str(root)


def _writer(storage: str, path: str) -> Any:
    if storage == "gs":
        from dataflux_ckpt import DatafluxStorageWriter

        return DatafluxStorageWriter(path, **GS_WRITER_OPTIONS)
    from fastpersist import FastPersistStorageWriter

    return FastPersistStorageWriter(path, io_buffer_mb=1, engine="python")


def _state(seed: int, **extra: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(4096, 64, generator=generator), "step": seed, **extra}


def _load(reader: Any) -> dict[str, Any]:
    state = {"weight": torch.zeros(4096, 64), "step": -1}
    dcp.load(state, storage_reader=reader)
    return state


def _saved(state: dict[str, Any], seed: int) -> bool:
    want = _state(seed)
    return torch.equal(state["weight"], want["weight"]) and state["step"] == seed


def test_a_save_asked_of_the_writer_in_use_is_refused_and_one_through_its_own_writer_lands(
    storage_root: tuple[str, str],
) -> None:
    storage, root = storage_root
    writer = _writer(storage, f"{root}/last")
    outcomes: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        try:
            dcp.save(_state(2), storage_writer=writer, checkpoint_id=f"{root}/hpc")
            outcomes.append("saved")
        except ReentrantOperationError as exc:
            outcomes.append(f"refused: {exc.busy} / {exc.refused}")
        own = _writer(storage, f"{root}/own")  # a writer of its own shares nothing with the save in progress
        dcp.save(_state(3), storage_writer=own)
        outcomes.append("own saved")

    with handling(handler):
        dcp.save(_state(1, tripwire=Tripwire()), storage_writer=writer)
    last = writer.checkpoint_id
    assert outcomes == [f"refused: saving {last} / saving {root}/hpc", "own saved"]
    assert _saved(_load(checkpoint_reader(storage, f"{root}/last")), 1)
    assert _saved(_load(checkpoint_reader(storage, f"{root}/own")), 3)
    assert sorted({name.split("/")[0] for name in stored_names(storage, root)}) == ["last", "own"]


def test_a_load_asked_of_the_reader_in_use_is_refused_and_the_load_goes_on(storage_root: tuple[str, str]) -> None:
    storage, root = storage_root
    dcp.save(_state(1, tripwire=Tripwire(on_load=True)), storage_writer=_writer(storage, f"{root}/last"))
    dcp.save(_state(2), storage_writer=_writer(storage, f"{root}/other"))
    reader = checkpoint_reader(storage, f"{root}/last")
    reader.weights_only = False  # trusted: its tripwire sends the signal as it is unpickled
    refused: list[ReentrantOperationError] = []

    def handler(signum: int, frame: Any) -> None:
        with pytest.raises(ReentrantOperationError) as caught:
            dcp.load({"weight": torch.zeros(4096, 64), "step": -1}, storage_reader=reader,
                     checkpoint_id=f"{root}/other")
        refused.append(caught.value)

    state = {"weight": torch.zeros(4096, 64), "step": -1, "tripwire": -1}
    with handling(handler):
        dcp.load(state, storage_reader=reader)
    assert [(e.busy.split(" ")[0], e.refused.split(" ")[0]) for e in refused] == [("loading", "loading")]
    assert _saved(state, 1) and reader.checkpoint_id == checkpoint_reader(storage, f"{root}/last").checkpoint_id

