"""A ``FastPersistContext`` serves one save or load at a time, also against a signal handler.

A handler runs on the thread it interrupts, so a save it asks of the context that thread is saving
with would reuse the aio handle and staging buffer in use: DeepSpeed aborted the process
(``_num_pending_ops > 0``), or the interrupted save reported success over a corrupt file. Such a save
or load is refused with ``ContextInUseError`` (naming both files) before it touches anything, and the
interrupted operation lands whole; the DCP storages and the DeepSpeed checkpoint engine, which keep a
context across saves, are covered the same way. The aio engine's cases run in a forked child, so that
an abort fails the test instead of ending pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fastpersist import (
    ContextInUseError,
    FastPersistContext,
    FastPersistStorageReader,
    FastPersistStorageWriter,
    ReentrantOperationError,
    fastpersist_load,
    fastpersist_save,
)
from fastpersist.writer import TEMP_SUFFIX
from tests.support.signals import Tripwire, handler_ran, handling, result_in_fork, signal_later, spread

Result = TypeVar("Result")
MiB = 1 << 20


def _in_engine(engine: str, check: Callable[[], Result]) -> Result:
    """``check()``, in a forked child for the aio engine (a DeepSpeed abort ends only the child)."""
    return result_in_fork(check) if engine == "aio" else check()


def _state(step: int, mib: int = 4) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "weight": torch.randn(mib * MiB // 4, generator=generator),
        "bias": torch.randn(1000, generator=generator).to(torch.bfloat16),
        "global_step": step,
    }


def _assert_whole(path: Path, expected: dict[str, Any]) -> None:
    loaded = torch.load(path, weights_only=True)
    assert loaded["global_step"] == expected["global_step"]
    for name in ("weight", "bias"):
        assert torch.equal(loaded[name], expected[name]), f"{path}: {name} differs"


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(TEMP_SUFFIX))


def _saving_with(context: FastPersistContext, path: Path, refused: list[ContextInUseError]) -> Callable[[int, Any], None]:
    """A signal handler that saves a checkpoint at ``path`` with ``context``, recording a refusal."""
    def handler(signum: int, frame: Any) -> None:
        try:
            fastpersist_save(_state(2), path, context=context)
        except ContextInUseError as exc:
            refused.append(exc)

    return handler


def test_a_save_asked_for_inside_a_save_with_its_context_is_refused_and_both_files_stay_whole(
    engine: str, ckpt_dir: Path
) -> None:
    def check() -> dict[str, Any]:
        refused: list[ContextInUseError] = []
        with FastPersistContext(io_buffer_mb=1, engine=engine) as context:
            outer = {**_state(1), "tripwire": Tripwire()}  # the signal lands after "weight" was staged
            with handling(_saving_with(context, ckpt_dir / "hpc.ckpt", refused)):
                fastpersist_save(outer, ckpt_dir / "last.ckpt", context=context)
            _assert_whole(ckpt_dir / "last.ckpt", _state(1))
            fastpersist_save(_state(2), ckpt_dir / "hpc.ckpt", context=context)  # the context is free again
            _assert_whole(ckpt_dir / "hpc.ckpt", _state(2))
        return {"refused": [(e.busy, e.refused, str(e)) for e in refused], "left": _temporaries(ckpt_dir)}

    outcome = _in_engine(engine, check)
    assert len(outcome["refused"]) == 1
    busy, refused, message = outcome["refused"][0]
    assert busy == f"saving {ckpt_dir / 'last.ckpt'}" and refused == f"saving {ckpt_dir / 'hpc.ckpt'}"
    assert str(ckpt_dir / "last.ckpt") in message and str(ckpt_dir / "hpc.ckpt") in message
    assert outcome["left"] == []


def test_saves_asked_for_by_signals_at_random_points_of_a_save_never_damage_it(engine: str, ckpt_dir: Path) -> None:
    """A real signal, sent from another thread at a random point of each save (one in each slice of
    the save's measured duration), whose handler saves with the same context."""
    rounds = 8

    def check() -> dict[str, Any]:
        outcomes: list[str] = []
        with FastPersistContext(io_buffer_mb=4, engine=engine) as context:
            outer, inner = _state(1, mib=24), _state(2, mib=4)
            fastpersist_save(outer, ckpt_dir / "warm-up.ckpt", context=context)
            duration = fastpersist_save(outer, ckpt_dir / "warm-up.ckpt", context=context).seconds
            handled = threading.Event()
            for index, delay in enumerate(spread(duration, rounds, seed=41)):
                hpc = ckpt_dir / f"hpc-{index}.ckpt"

                def handler(signum: int, frame: Any, hpc: Path = hpc) -> None:
                    try:
                        fastpersist_save(inner, hpc, context=context)
                        outcomes.append("saved")
                    except ContextInUseError:
                        outcomes.append("refused")
                    handled.set()

                handled.clear()
                with handling(handler):
                    sender = signal_later(delay)
                    fastpersist_save(outer, ckpt_dir / f"last-{index}.ckpt", context=context)
                    assert handler_ran(handled), "the signal was never handled"
                    sender.join()
                _assert_whole(ckpt_dir / f"last-{index}.ckpt", outer)
                if outcomes[-1] == "saved":
                    _assert_whole(hpc, inner)
                else:
                    assert not hpc.exists()
        return {"outcomes": outcomes, "left": _temporaries(ckpt_dir)}

    outcome = _in_engine(engine, check)
    assert len(outcome["outcomes"]) == rounds
    assert "refused" in outcome["outcomes"], f"no signal landed inside a save: {outcome['outcomes']}"
    assert outcome["left"] == []


def test_a_load_asked_for_inside_a_save_with_its_context_is_refused(ckpt_dir: Path) -> None:
    fastpersist_save(_state(2), ckpt_dir / "hpc.ckpt")
    refused: list[ReentrantOperationError] = []
    with FastPersistContext(io_buffer_mb=1, engine="python") as context:
        def handler(signum: int, frame: Any) -> None:
            with pytest.raises(ContextInUseError) as caught:
                fastpersist_load(ckpt_dir / "hpc.ckpt", weights_only=True, context=context)
            refused.append(caught.value)

        with handling(handler):
            fastpersist_save({**_state(1), "tripwire": Tripwire()}, ckpt_dir / "last.ckpt", context=context)
    assert [e.refused for e in refused] == [f"loading {ckpt_dir / 'hpc.ckpt'}"]
    _assert_whole(ckpt_dir / "last.ckpt", _state(1))


def test_a_save_asked_for_inside_a_load_with_its_context_is_refused_and_the_load_is_whole(
    engine: str, ckpt_dir: Path
) -> None:
    def check() -> list[str]:
        fastpersist_save({**_state(1), "tripwire": Tripwire(on_load=True)}, ckpt_dir / "last.ckpt")
        refused: list[ContextInUseError] = []
        with FastPersistContext(io_buffer_mb=1, engine=engine) as context:
            # A trusted checkpoint, whose unpickling sends the signal.
            with handling(_saving_with(context, ckpt_dir / "hpc.ckpt", refused)):
                loaded = fastpersist_load(ckpt_dir / "last.ckpt", weights_only=False, context=context)
        expected = _state(1)
        assert loaded["global_step"] == 1 and loaded["tripwire"] is None
        assert torch.equal(loaded["weight"], expected["weight"]) and torch.equal(loaded["bias"], expected["bias"])
        return [exc.busy for exc in refused]

    assert _in_engine(engine, check) == [f"loading {ckpt_dir / 'last.ckpt'}"]
    assert not (ckpt_dir / "hpc.ckpt").exists()


def test_closing_a_context_inside_its_save_is_refused(ckpt_dir: Path) -> None:
    refused: list[str] = []
    with FastPersistContext(io_buffer_mb=1, engine="python") as context:
        def handler(signum: int, frame: Any) -> None:
            with pytest.raises(ContextInUseError) as caught:
                context.close()
            refused.append(caught.value.refused)

        with handling(handler):
            fastpersist_save({**_state(1), "tripwire": Tripwire()}, ckpt_dir / "last.ckpt", context=context)
    assert refused == ["closing the context"]
    _assert_whole(ckpt_dir / "last.ckpt", _state(1))


def test_another_thread_saving_with_the_context_waits_its_turn(ckpt_dir: Path) -> None:
    with FastPersistContext(io_buffer_mb=1, engine="python") as context:
        errors: list[BaseException] = []

        def save_beside() -> None:
            try:
                fastpersist_save(_state(2, mib=8), ckpt_dir / "beside.ckpt", context=context)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        beside = threading.Thread(target=save_beside)
        beside.start()
        fastpersist_save(_state(1, mib=8), ckpt_dir / "main.ckpt", context=context)
        beside.join()
    assert errors == []
    _assert_whole(ckpt_dir / "main.ckpt", _state(1, mib=8))
    _assert_whole(ckpt_dir / "beside.ckpt", _state(2, mib=8))


def test_dcp_saves_and_loads_keeping_a_context_refuse_a_save_asked_for_inside_them(ckpt_dir: Path) -> None:
    """The DCP writer and reader hold their context for each file they write or read; a handler's
    save with that context inside either is refused, and the checkpoint saves and loads whole."""
    refused: list[ContextInUseError] = []
    with FastPersistContext(io_buffer_mb=1, engine="python") as context:
        state = {"weight": _state(1)["weight"], "extra": {"tripwire": Tripwire(on_load=True), "lr": 0.1}}
        with handling(_saving_with(context, ckpt_dir / "hpc.ckpt", refused)):
            # Saving: the item holding the tripwire is pickled while the shard file is being written.
            saved = {**state, "extra": {"tripwire": Tripwire(), "lr": 0.1}}
            dcp.save(saved, storage_writer=FastPersistStorageWriter(ckpt_dir / "dcp", context=context))
            # Loading: the same item, saved to send the signal when it is unpickled, in the file's read.
            dcp.save(state, storage_writer=FastPersistStorageWriter(ckpt_dir / "dcp-load", context=context))
            loaded = {"weight": torch.zeros_like(state["weight"]), "extra": {"tripwire": -1, "lr": -1.0}}
            reader = FastPersistStorageReader(ckpt_dir / "dcp-load", context=context, weights_only=False)
            dcp.load(loaded, storage_reader=reader)
    assert [exc.busy.split(" ")[0] for exc in refused] == ["saving", "loading"]
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["extra"] == {"tripwire": None, "lr": 0.1}
    check = {"weight": torch.zeros_like(state["weight"]), "extra": {"tripwire": -1, "lr": -1.0}}
    dcp.load(check, storage_reader=FastPersistStorageReader(ckpt_dir / "dcp", weights_only=False))
    assert torch.equal(check["weight"], state["weight"]) and check["extra"] == {"tripwire": {}, "lr": 0.1}
    assert not (ckpt_dir / "hpc.ckpt").exists()


def test_the_deepspeed_checkpoint_engine_refuses_a_save_asked_for_inside_its_save(aio_engine: str, ckpt_dir: Path) -> None:
    pytest.importorskip("deepspeed")
    from fastpersist import FastPersistCheckpointEngine

    def check() -> list[str]:
        engine = FastPersistCheckpointEngine({"checkpoint": {"writer": {"type": "fast", "io_buffer_size": MiB}}})
        refused: list[ContextInUseError] = []
        try:
            assert engine.context.engine == aio_engine
            with handling(_saving_with(engine.context, ckpt_dir / "hpc.pt", refused)):
                engine.save({**_state(1), "tripwire": Tripwire()}, str(ckpt_dir / "mp_rank_00_model_states.pt"))
            loaded = engine.load(str(ckpt_dir / "mp_rank_00_model_states.pt"))
            assert loaded["global_step"] == 1 and torch.equal(loaded["weight"], _state(1)["weight"])
        finally:
            engine.cleanup()
        return [exc.refused for exc in refused]

    assert result_in_fork(check) == [f"saving {ckpt_dir / 'hpc.pt'}"]
    assert not (ckpt_dir / "hpc.pt").exists() and _temporaries(ckpt_dir) == []


def test_a_burst_of_signals_from_another_process_during_aio_saves_neither_aborts_nor_damages_them(
    aio_engine: str, ckpt_dir: Path
) -> None:
    """Signals sent to the process land on whichever of its threads does not block them: DeepSpeed's
    I/O threads, waiting in ``io_getevents``, must not be among them (a signal there aborts the process)."""

    def check() -> tuple[int, list[int]]:
        handled = [0]

        def count(signum: int, frame: Any) -> None:
            handled[0] += 1

        sender = (f"import os, signal, time\nwhile True:\n    for _ in range(50): os.kill({os.getpid()}, "
                  "signal.SIGUSR1)\n    time.sleep(0.0005)\n")
        with handling(count), FastPersistContext(engine="aio") as context:
            fastpersist_save(_state(0), ckpt_dir / "warm.pt", context=context)  # the handle and its threads
            process = subprocess.Popen([sys.executable, "-c", sender])
            try:
                for step in range(12):
                    fastpersist_save(_state(step, mib=32), ckpt_dir / f"{step % 2}.pt", context=context)
            finally:
                process.kill()
                process.wait()
            received = handled[0]
        return received, [fastpersist_load(ckpt_dir / f"{index}.pt")["global_step"] for index in (0, 1)]

    received, steps = result_in_fork(check)
    assert received > 100, f"only {received} signals landed during the saves"
    assert steps == [10, 11]
