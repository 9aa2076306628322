"""A save is never silently skipped after an operation of the plugin ends in an exception.

An operation asked for on a thread that is inside another operation of the plugin (from a signal
handler) is deferred until that one ends. The thread must count as inside the operation exactly as
long as it runs: a thread still marked inside a save that has ended would defer every later save on
it, and none of them would ever run (the caller returns at once, nothing is written). A signal
handler can raise anywhere, also while the plugin handles the end of a failed save (Lightning's
SIGTERM handler raises there when its broadcast meets a dead rank). Every save deferred behind an
operation lands, or an ERROR names it and says why it was not made.

The plugin is FastPersist's (python engine, local files); the signal is sent from precise points of a
save: while it pickles an object, and where the shared base handles its failure.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typing_extensions import override

from fastpersist import FastPersistCheckpointIO
from tests.support.direct_io import o_direct_dir
from tests.support.signals import DEFERRAL_LOG, Refuses, Tripwire, deferral_log, handling

#: What the interrupting handler is sent with (the deferring handler has SIGUSR1, as Slurm sends).
INTERRUPT = signal.SIGUSR2
MiB = 1 << 20


class HandlerError(RuntimeError):
    """What the interrupting handler raises, as Lightning's SIGTERM handler does when its collective fails."""


class HandlerExit(BaseException):
    """What the interrupting handler raises instead in some cases: no ``Exception`` (as ``SystemExit``)."""


class SignalledOnFailure(FastPersistCheckpointIO):
    """FastPersist's plugin, sending :data:`INTERRUPT` to this process, when armed, at one precise point:
    where the shared base, handling an operation that raised, asks whether what was deferred behind it
    may follow. A real signal may be handled there as anywhere else."""

    armed = False

    @override
    def _why_deferred_cannot_follow(self, failure: BaseException) -> str | None:
        if self.armed:
            signal.raise_signal(INTERRUPT)
        return super()._why_deferred_cannot_follow(failure)


def _checkpoint(step: int, **extra: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {"state_dict": {"weight": torch.randn(MiB // 16, generator=generator)}, "global_step": step, **extra}


def _whole(plugin: FastPersistCheckpointIO, path: Path, step: int) -> bool:
    """Whether ``path`` loads, with the tensor and step of ``_checkpoint(step)``."""
    if not path.exists():
        return False
    loaded = plugin.load_checkpoint(path)
    return loaded["global_step"] == step and torch.equal(loaded["state_dict"]["weight"],
                                                         _checkpoint(step)["state_dict"]["weight"])


def _errors_naming(records: list[logging.LogRecord], path: Path) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR and f"saving {path} " in r.getMessage()]


POINTS = ["nowhere", "in_the_save", "at_its_failure", "in_a_deferred_save"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return o_direct_dir(tmp_path_factory.mktemp("deferral-failures"))


# The case a ModelParallel run showed after another rank was killed: the save failed, the SIGTERM
# handler raised while its failure was handled, and the OnExceptionCheckpoint save then did nothing.
@example(deferred=1, point="at_its_failure", fails=True, exit_kind=False)
@example(deferred=2, point="in_a_deferred_save", fails=False, exit_kind=True)
@given(deferred=st.integers(0, 2), point=st.sampled_from(POINTS), fails=st.booleans(), exit_kind=st.booleans())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_save_lands_or_is_named_in_an_error_wherever_a_handler_raises(
    base: Path, deferred: int, point: str, fails: bool, exit_kind: bool
) -> None:
    """A save interrupted at ``point`` by a handler raising ``HandlerExit`` or ``HandlerError``, with
    ``deferred`` saves asked for from another handler during it, and failing on its own if ``fails``:
    afterwards the thread saves again at once, the previous checkpoint stays whole unless the save
    returned, and each deferred save is whole or named by an ERROR, never made later."""
    root = base / uuid.uuid4().hex[:8]
    root.mkdir()
    plugin = SignalledOnFailure(io_buffer_mb=1, engine="python")
    last, after = root / "last.ckpt", root / "after.ckpt"
    hpc = [root / f"hpc_ckpt_{index}.ckpt" for index in range(deferred)]
    plugin.save_checkpoint(_checkpoint(0), last)
    fails = fails or point == "at_its_failure"  # that point is reached only by a failure
    raised = HandlerExit if exit_kind else HandlerError

    def defer(signum: int, frame: Any) -> None:
        for index, path in enumerate(hpc):
            interrupts = {"interrupts": Tripwire(signum=INTERRUPT)} if point == "in_a_deferred_save" and not index else {}
            plugin.save_checkpoint(_checkpoint(10 + index, **interrupts), path)

    def interrupt(signum: int, frame: Any) -> None:
        raise raised(f"handler of signal {signum}")

    outer = _checkpoint(1, tripwire=Tripwire(), **({"interrupts": Tripwire(signum=INTERRUPT)}
                                                   if point == "in_the_save" else {}),
                        **({"refuses": Refuses()} if fails else {}))
    plugin.armed = point == "at_its_failure"
    returned = False
    try:
        with deferral_log() as records, handling(defer), handling(interrupt, INTERRUPT):
            try:
                plugin.save_checkpoint(outer, last)
                returned = True
            except (Exception, HandlerExit):
                pass
            plugin.armed = False
            landed = [_whole(plugin, path, 10 + index) for index, path in enumerate(hpc)]

            plugin.save_checkpoint(_checkpoint(3), after)  # the thread is out of the failed save: this saves
            assert _whole(plugin, after, 3), f"the save after the interrupted one did nothing ({point})"
    finally:
        plugin.teardown()
    lands = not fails and point in ("nowhere", "in_a_deferred_save")  # the save's own write succeeds
    assert _whole(plugin, last, 1 if lands else 0), f"{last}: not the checkpoint of the save that {lands=}"
    assert returned == (lands and (point == "nowhere" or deferred == 0)), "the save returned, but did not save"
    for index, path in enumerate(hpc):
        if landed[index]:
            continue
        assert _errors_naming(records, path), f"{path} was not saved, and no ERROR says so: {records}"
        assert not path.exists(), f"{path} was saved later, after the save it was deferred behind had ended"
    assert set(os.listdir(root)) <= {"last.ckpt", "after.ckpt", *(path.name for path in hpc)}


def test_a_deferred_save_dropped_after_a_failure_is_an_error_naming_it(base: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A failure that forbids running what was deferred behind it (the sharded strategies' rule for a
    failure DCP did not report to every rank) logs each dropped save at ERROR, with the reason."""

    class Forbidding(FastPersistCheckpointIO):
        @override
        def _why_deferred_cannot_follow(self, failure: BaseException) -> str | None:
            return "the other ranks could not make it"

    root = base / uuid.uuid4().hex[:8]
    root.mkdir()
    plugin = Forbidding(io_buffer_mb=1, engine="python")
    hpc = root / "hpc_ckpt_1.ckpt"
    caplog.set_level(logging.INFO, DEFERRAL_LOG)

    def defer(signum: int, frame: Any) -> None:
        plugin.save_checkpoint(_checkpoint(2), hpc)

    with handling(defer), pytest.raises(RuntimeError, match="refuses to be pickled") as caught:
        plugin.save_checkpoint(_checkpoint(1, tripwire=Tripwire(), refuses=Refuses()), root / "last.ckpt")
    plugin.teardown()
    [error] = _errors_naming(caplog.records, hpc)
    assert "was not done" in error and "the other ranks could not make it" in error
    if hasattr(caught.value, "__notes__"):  # Python 3.11+: the caller's exception names it too
        assert any(f"saving {hpc} was not done" in note for note in caught.value.__notes__)
    assert os.listdir(root) == []
