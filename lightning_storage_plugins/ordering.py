"""The ordered-save base of the single-file CheckpointIOs, and the order it keeps.

Lightning's ``AsyncCheckpointIO`` queues saves on a worker thread but passes removals straight
through on the training thread. ``ModelCheckpoint`` therefore can remove a checkpoint whose save
has not been written yet; that save would publish it afterwards and it would never go away (a
``save_top_k=1`` run then fills the disk or bucket). :class:`OrderedCheckpointIO` keeps one
:class:`SaveOrder` and asks it before and after every save and before every removal; the three
single-file plugins (``DatafluxCheckpointIO``, ``FastPersistCheckpointIO``, ``SmartRedisCheckpointIO``)
derive from it and supply only their storage's parsing, writing, reading and deletion.

A signal handler runs on the main thread in the middle of whatever that thread was doing: Lightning's
Slurm requeue handler saves ``hpc_ckpt_N.ckpt`` from there, possibly while the same plugin is saving
another checkpoint on that thread, its buffers and connections in use. A save, removal or teardown
asked for on a thread that is already inside an operation of the plugin is therefore recorded and
run when that operation ends, before it returns to its caller (the checkpoint's tensors cannot
change meanwhile: the thread that would change them is the one held in the operation); a load,
whose caller needs its result now, is refused with
:class:`~lightning_storage_plugins.reentry.ReentrantOperationError`. Other threads go on as before:
each storage lets them in or makes them wait its turn. :class:`DeferringOperations` holds this
deferral; the sharded-checkpoint strategies (:mod:`lightning_storage_plugins.sharded`) derive from
it too.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from lightning_storage_plugins import release
from lightning_storage_plugins.collector import collector_paused
from lightning_storage_plugins.messages import plain_text
from lightning_storage_plugins.reentry import DeferredOperationError, ReentrantOperationError

__all__ = ["CheckpointDir", "DeferringOperations", "OrderedCheckpointIO", "QueuedSave", "SaveOrder", "WeightsOnlyError",
           "check_weights_only", "live_plugins", "remove_local"]

log = logging.getLogger(__name__)

Target = TypeVar("Target", bound=Hashable)
Result = TypeVar("Result")


class QueuedSave:
    """A save of ``key`` recorded to begin later (see :meth:`SaveOrder.queue`); ``turn`` is when it
    was asked for (see :meth:`SaveOrder.turn`)."""

    __slots__ = ("cancelled", "key", "turn")

    def __init__(self, key: Hashable, turn: int) -> None:
        self.key = key
        self.turn = turn
        self.cancelled = False  # a removal of ``key`` came before the save began


class SaveOrder:
    """Cancels saves that a removal of the same path has overtaken.

    A removal of a path whose save is running or queued (:meth:`queue`), or, once saves have been
    seen on another thread than the remover's, of a path that does not exist yet, cancels that
    save: a save that has not started is skipped, a running one is removed as soon as it has landed.

    Args:
        exists: whether a checkpoint is stored at a path now (asked only while saves run on
            another thread).
    """

    def __init__(self, exists: Callable[[Any], bool]) -> None:
        self._exists = exists
        self._lock = threading.Lock()
        self._saving: dict[Hashable, int] = {}
        self._cancelled: set[Hashable] = set()
        self._save_threads: set[int] = set()
        self._queued: deque[QueuedSave] = deque()
        self._turns = itertools.count()

    def turn(self) -> int:
        """A number larger than that of every save queued so far: a removal asked for now and made
        later (:meth:`removing`'s ``queued_before``) cancels only the saves queued before it.

        Takes no lock (one step under the interpreter's lock): safe in a signal handler.
        """
        return next(self._turns)

    def queue(self, key: Hashable) -> QueuedSave:
        """Record a save of ``key`` that begins later (:meth:`begin_save` is given what this returns),
        so that a removal of ``key`` meanwhile skips it.

        Takes no lock: a signal handler may call it while the thread it interrupted holds this
        object's lock.
        """
        queued = QueuedSave(key, self.turn())
        self._queued.append(queued)  # one step under the interpreter's lock, like the other deque calls here
        return queued

    def discard(self, queued: QueuedSave) -> None:
        """Forget a queued save that will not begin."""
        with self._lock:
            self._unqueue(queued)

    def _unqueue(self, queued: QueuedSave) -> None:
        try:
            self._queued.remove(queued)  # compared by identity
        except ValueError:
            pass

    def begin_save(self, key: Hashable, queued: QueuedSave | None = None) -> bool:
        """Whether to go on with a save of ``key`` (``False``: it was removed before it could run).

        Args:
            key: what is saved.
            queued: what :meth:`queue` returned, when the save was queued.
        """
        with self._lock:
            if queued is not None:
                self._unqueue(queued)
                if queued.cancelled:
                    return False
            elif key in self._cancelled and key not in self._saving:
                self._cancelled.discard(key)
                return False
            self._saving[key] = self._saving.get(key, 0) + 1
            self._save_threads.add(threading.get_ident())
            return True

    def end_save(self, key: Hashable) -> bool:
        """Whether the checkpoint just saved at ``key`` must be removed (a removal came while it ran)."""
        with self._lock:
            count = self._saving.pop(key) - 1
            if count:
                self._saving[key] = count
                return False
            if key in self._cancelled:
                self._cancelled.discard(key)
                return True
            return False

    def removing(self, key: Hashable, queued_before: int | None = None) -> None:
        """Record a removal of ``key``, cancelling a save of it that is running or still queued.

        Args:
            key: what is removed.
            queued_before: the :meth:`turn` at which the removal was asked for, when it is made
                later: saves queued after that were asked for after it, and are kept.
        """
        with self._lock:
            overtaken = False
            for queued in list(self._queued):  # a copy: a signal handler may queue another meanwhile
                if queued.key == key and (queued_before is None or queued.turn < queued_before):
                    queued.cancelled = overtaken = True
            if key in self._saving:
                self._cancelled.add(key)
                return
            if overtaken:  # the save this removal overtook was found: no need to guess at one
                return
            saves_elsewhere = bool(self._save_threads - {threading.get_ident()})
        if saves_elsewhere and not self._exists(key):
            with self._lock:
                self._cancelled.add(key)

    def reset(self) -> None:
        """Forget cancelled saves and the threads seen (at teardown: the next run starts clean)."""
        with self._lock:
            self._cancelled.clear()
            self._save_threads.clear()


class WeightsOnlyError(pickle.UnpicklingError):
    """``weights_only`` loading (torch's default) refused something in a checkpoint.

    The message names the checkpoint and the refused object, in plain text, and says how to load
    it when its writers are trusted.
    """


def check_weights_only(value: object) -> bool | None:
    """``value`` if it is ``True``, ``False`` or ``None``, as ``torch.load`` takes it.

    Raises:
        TypeError: anything else (``"yes"``, ``1``): torch would take it as truthy.
    """
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"weights_only must be True, False or None, not {value!r}")


def _is_weights_only_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's weights-only unpickler refusing an object (torch says so in its text)."""
    text = plain_text(str(exc))
    return "Weights only load failed" in text or "weights-only load" in text


def _refused_object(exc: BaseException) -> str:
    """The line of a weights-only refusal that names what was refused, as plain text."""
    lines = [line.strip() for line in plain_text(str(exc)).splitlines() if line.strip()]
    detail = next((line for line in lines if "WeightsUnpickler error:" in line),
                  next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(exc).__name__))
    return detail.split("WeightsUnpickler error:", 1)[-1].strip().rstrip(".")


def remove_local(path: str) -> bool:
    """Remove the local file or directory at ``path``; a link is removed itself, never what it points to.

    Removals of one path may race (behind ``AsyncCheckpointIO`` the training thread removes a
    checkpoint while the save thread removes the save it overtook): whatever another removal took
    first is not an error.

    Returns:
        Whether there was something to remove (``False`` when nothing was there, or another removal
        took it first).
    """
    try:
        if os.path.islink(path):
            os.unlink(path)
        elif os.path.isdir(path):
            _remove_tree(path)
        elif os.path.lexists(path):
            with release.freed_later(path):  # its blocks are freed after this call returns
                os.remove(path)
        else:
            return False
    except FileNotFoundError:
        return False
    return True


def _remove_tree(path: str) -> None:
    """``shutil.rmtree`` (which does not follow links inside the directory), passing over entries
    another removal took first."""
    def gone_already(function: Callable[..., Any], entry: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=gone_already)
    else:  # ``onerror`` is deprecated from 3.12; before it there is no ``onexc``
        shutil.rmtree(path, onerror=lambda function, entry, info: gone_already(function, entry, info[1]))


_live: weakref.WeakSet[DeferringOperations[Any]] = weakref.WeakSet()


def live_plugins() -> list[DeferringOperations[Any]]:
    """The single-file plugins and sharded-checkpoint strategies made in this process that still exist."""
    return list(_live)


class CheckpointDir(NamedTuple):
    """Where a ``ModelCheckpoint`` of the starting run saves: its directory, and whether its ``last``
    checkpoints are links (``save_last="link"``: Lightning makes them in the local filesystem)."""

    dirpath: str
    links: bool


class DeferringOperations(ABC, Generic[Target]):
    """Operations asked for on a thread that is already inside one of them wait for it to end.

    The base of the single-file plugins (:class:`OrderedCheckpointIO`) and of the sharded-checkpoint
    strategies (:mod:`lightning_storage_plugins.sharded`). Each public operation runs through
    :meth:`_saving`, :meth:`_removing`, :meth:`_tearing_down` or :meth:`_loading`: on a thread that
    is inside none of them it runs at once (and then what was asked for meanwhile); on a thread
    that is inside one (from a signal handler, such as Lightning's Slurm requeue handler, or from a
    callback of the operation) a save, removal or teardown is recorded and made when that operation
    ends, before it returns, and a load raises
    :class:`~lightning_storage_plugins.reentry.ReentrantOperationError`. Saves and removals of one
    target are kept in order by a :class:`SaveOrder`.

    A subclass calls :meth:`_start_deferrals` when it is made (and in a pickled copy), and supplies
    how a target is written, deleted and looked up.
    """

    #: What a deferred operation raises when it fails (it is then logged and raised by the operation
    #: it waited for, as DeferredOperationError); anything else (KeyboardInterrupt) drops the rest.
    _failures: ClassVar[tuple[type[BaseException], ...]] = (Exception,)
    _order: SaveOrder
    _threads: threading.local

    def _start_deferrals(self) -> None:
        """Make this process' record of saves and of each thread's operation, and make this object
        known to :mod:`lightning_storage_plugins.preflight` (see :func:`live_plugins`)."""
        self._order = SaveOrder(self._stored)
        self._threads = threading.local()  # each thread's _ThreadOperations
        _live.add(self)

    # When training starts ----------------------------------------------------------------------
    def preflight(self, checkpoint_dirs: Sequence[CheckpointDir]) -> None:
        """Check, when training starts, that checkpoints can be saved where ``ModelCheckpoint``
        will put them, and remove what killed saves left there (called on global rank zero by
        :mod:`lightning_storage_plugins.preflight`).

        Raises:
            ValueError: a directory is not a place this storage can save to.
        """

    def node_preflight(self) -> None:
        """What only this process' node can check or clean when training starts (its node-local
        storage), called on every rank before :meth:`preflight`; it raises nothing, as the ranks
        would part ways: what fails is logged."""

    # What a subclass supplies -------------------------------------------------------------------
    @abstractmethod
    def _write(self, checkpoint: Any, target: Target) -> None:
        """Save ``checkpoint`` at ``target``, atomically: all of it appears, or the previous one stays."""

    @abstractmethod
    def _delete(self, target: Target) -> None:
        """Remove the checkpoint at ``target`` if there is one; a link is removed, never its target."""

    @abstractmethod
    def _stored(self, target: Target) -> bool:
        """Whether a checkpoint (or a link) is stored at ``target`` now."""

    def _describe(self, target: Target) -> str:
        """``target`` as messages name it."""
        return str(target)

    def _tear_down(self) -> None:
        """Forget the saves seen (a deferred teardown runs this)."""
        self._order.reset()

    def _why_deferred_cannot_follow(self, failure: BaseException) -> str | None:
        """Why the operations deferred behind one that raised ``failure`` must not run (they are
        logged and dropped), or ``None`` to run them: by default they run."""
        return None

    # Operations -----------------------------------------------------------------------------------
    def _saving(self, checkpoint: Any, target: Target) -> None:
        """Save ``checkpoint`` at ``target`` now, or, on a thread inside an operation of this object,
        when that operation ends."""
        thread = self._this_thread()
        if thread.current is not None:
            thread.defer(_Deferred("saving", target, checkpoint, self._order.queue(target)))
            return
        self._outermost(thread, f"saving {self._describe(target)}", lambda: self._save(checkpoint, target))

    def _removing(self, target: Target) -> None:
        """Remove the checkpoint at ``target`` now, or, on a thread inside an operation of this
        object, when that operation ends (skipping the saves of ``target`` deferred before it)."""
        thread = self._this_thread()
        if thread.current is not None:
            thread.cancel_saves(target)
            thread.defer(_Deferred("removing", target, turn=self._order.turn()))
            return
        self._outermost(thread, f"removing {self._describe(target)}", lambda: self._remove(target))

    def _tearing_down(self) -> None:
        """Tear down now, or, on a thread inside an operation of this object, when that operation ends."""
        thread = self._this_thread()
        if thread.current is not None:
            thread.defer(_Deferred("tearing down", None))
            return
        self._outermost(thread, f"tearing down {type(self).__name__}", self._tear_down)

    def _loading(self, target: Target, load: Callable[[], Result]) -> Result:
        """``load()``, refused on a thread inside an operation of this object (its caller needs the
        result now, so it cannot wait for that operation to end).

        Raises:
            ReentrantOperationError: this thread is inside an operation of this object.
        """
        thread = self._this_thread()
        loading = f"loading {self._describe(target)}"
        if thread.current is not None:
            raise ReentrantOperationError(
                thread.current, loading, "a load cannot wait for that operation to end, as a save does; load "
                "after it has returned, or with another plugin instance")
        return self._outermost(thread, loading, load)

    def _save(self, checkpoint: Any, target: Target, queued: QueuedSave | None = None) -> bool:
        """Save now; ``False`` where a removal came first and nothing was saved."""
        if not self._order.begin_save(target, queued):
            log.debug("not saving %s: it was removed before its save ran", self._describe(target))
            return False
        try:
            with collector_paused():
                self._write(checkpoint, target)
        finally:
            remove = self._order.end_save(target)
        if remove:
            self._delete(target)
        return True

    def _remove(self, target: Target, queued_before: int | None = None) -> None:
        self._order.removing(target, queued_before)
        self._delete(target)

    # Operations on one thread ------------------------------------------------------------------
    # Nothing from the point where a thread is marked inside an operation to the point where it
    # is marked out again takes a lock a signal handler would take: a handler that interrupts that
    # span only appends to the thread's deque (and to SaveOrder's, lock-free). A handler landing
    # just before the mark, or just after it is cleared, runs its operation on the spot, which is
    # safe: the interrupted operation has not begun, or has ended.
    def _this_thread(self) -> _ThreadOperations:
        thread: _ThreadOperations | None = getattr(self._threads, "operations", None)
        if thread is None:
            thread = self._threads.operations = _ThreadOperations()
        return thread

    def _outermost(self, thread: _ThreadOperations, operation: str, run: Callable[[], Result]) -> Result:
        """Run ``operation`` on this thread, then what was asked for during it (see the class)."""
        thread.current = operation
        try:
            result = run()
        except BaseException as exc:
            reason = self._why_deferred_cannot_follow(exc)
            if reason is not None:
                for dropped in self._drop_deferred(thread, operation, f"that failed ({reason})"):
                    _note(exc, dropped)
                raise
            for failure in self._run_deferred(thread, operation):
                _note(exc, str(failure))
            raise
        else:
            failures = self._run_deferred(thread, operation)
        finally:
            if thread.current is not None:
                # An exception left the lines above between two of their steps, before they marked the
                # thread out of the operation: a signal handler raised there (Lightning's SIGTERM handler
                # does when its broadcast meets a dead rank). A thread left marked would defer every
                # later operation to an end that never comes: its saves would return having saved nothing.
                thread.current = None
                for dropped in self._drop_deferred(thread, operation, "an exception ended it"):
                    _note(sys.exc_info()[1], dropped)
        if failures:
            raise failures[0] from failures[0].__cause__
        return result

    def _run_deferred(self, thread: _ThreadOperations, during: str) -> list[DeferredOperationError]:
        """Run, in order, what was asked for on this thread during ``during`` (also what is asked for
        while these run), then mark the thread out of its operation. Each one is attempted; the
        failures are logged and returned."""
        failures: list[DeferredOperationError] = []
        try:
            while True:
                while thread.deferred:
                    failure = self._run_one(thread.deferred.popleft(), during)
                    if failure is not None:
                        failures.append(failure)
                thread.current = None
                if not thread.deferred:
                    return failures
                thread.current = during  # a handler deferred one after the last check, before the line above
        except BaseException as exc:  # KeyboardInterrupt and the like in a deferred operation: the rest are dropped
            for dropped in self._drop_deferred(thread, during, "that was interrupted"):
                _note(exc, dropped)
            raise

    def _drop_deferred(self, thread: _ThreadOperations, during: str, why: str) -> list[str]:
        """Mark the thread out of its operation and forget what was deferred behind it: an ERROR for
        each save (a checkpoint its caller asked for is not made), a warning for anything else.
        Returns what each log line says."""
        thread.current = None
        said: list[str] = []
        while thread.deferred:
            dropped = thread.deferred.popleft()
            if dropped.queued is not None:
                self._order.discard(dropped.queued)
            said.append(f"{self._name(dropped)} was not done: it was asked for while this thread was {during}, "
                        f"and was still waiting when {why}")
            log.log(logging.ERROR if dropped.kind == "saving" else logging.WARNING, "%s", said[-1])
        return said

    def _name(self, deferred: _Deferred) -> str:
        if deferred.target is None:
            return f"{deferred.kind} {type(self).__name__}"
        return f"{deferred.kind} {self._describe(deferred.target)}"

    def _run_one(self, deferred: _Deferred, during: str) -> DeferredOperationError | None:
        name = self._name(deferred)
        log.info("%s now: it was asked for %.3f s ago while this thread was %s (from a signal handler or a "
                 "callback), and waited for that to end", name, time.monotonic() - deferred.asked_at, during)
        try:
            if deferred.kind == "saving":
                if not self._save(deferred.checkpoint, deferred.target, deferred.queued):
                    log.info("%s skipped: a removal of it came first", name)
                    return None
            elif deferred.kind == "removing":
                self._remove(deferred.target, deferred.turn)
            else:
                self._tear_down()
        except self._failures as exc:
            log.error("%s failed (it was asked for while this thread was %s)", name, during, exc_info=True)
            failure = DeferredOperationError(name, during, f"{type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            return failure
        except BaseException as exc:  # KeyboardInterrupt and the like: raised on, ending the rest
            log.error("%s did not end: %s was raised in it (it was asked for while this thread was %s)",
                      name, type(exc).__name__, during)
            raise
        log.info("%s done, %.3f s after it was asked for", name, time.monotonic() - deferred.asked_at)
        return None


class OrderedCheckpointIO(CheckpointIO, DeferringOperations[Target]):
    """The skeleton of a single-file ``CheckpointIO``: saves and removals of one path kept in order.

    A subclass parses a path once into its storage's target (:meth:`_target`) and writes, reads,
    deletes and looks up targets; this class refuses ``storage_options``, checks ``weights_only``,
    cancels saves a removal overtook (:class:`SaveOrder`), types weights-only refusals as
    :class:`WeightsOnlyError`, and makes pickled copies (as spawn-based strategies make) start with
    this process' state left behind.

    A save, removal or teardown asked for on a thread that is inside an operation of this plugin
    (from a signal handler, such as Lightning's Slurm requeue handler, or from a callback of the
    operation) runs when that operation ends, before it returns; a load asked for there raises
    :class:`~lightning_storage_plugins.reentry.ReentrantOperationError`.

    Args:
        weights_only: what :meth:`load_checkpoint` passes to the loader when its caller passes
            ``None`` (Lightning before 2.6 always does): ``None`` is torch's default (``True``
            since torch 2.6: loading runs no code).

    Raises:
        TypeError: ``weights_only`` is not ``True``, ``False`` or ``None``.
    """

    #: Attributes that belong to this process (connections, handles, locks): a pickled copy gets
    #: ``None`` for each, then :meth:`_start_process_state`.
    _process_local: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, weights_only: bool | None = None) -> None:
        super().__init__()
        self.weights_only = check_weights_only(weights_only)
        self._start_process_state()

    def _start_process_state(self) -> None:
        """Make this process' own state (at construction, and in a pickled copy)."""
        self._start_deferrals()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in (*self._process_local, "_order", "_threads"):
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_process_state()  # a copy starts with no saves in flight

    # What a storage supplies -----------------------------------------------------------------
    @abstractmethod
    def _target(self, path: str | os.PathLike[str]) -> Target:
        """``path`` parsed into this storage's target (hashable; saves and removals are ordered by it).

        Raises:
            ValueError: ``path`` is not a path of this storage.
        """

    @abstractmethod
    def _read(self, target: Target, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """Load the checkpoint at ``target``.

        Raises:
            FileNotFoundError: nothing is stored there.
        """

    def _close(self) -> None:
        """Release this process' connections or buffers (the next use makes new ones)."""

    # CheckpointIO ----------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path``; the previous checkpoint there is replaced only once this
        one is whole, and a failed save leaves it as it was.

        Asked for on a thread that is inside another operation of this plugin (from a signal
        handler, or a callback of that operation), the save is made when that operation ends,
        before it returns to its caller, and this call returns at once.

        Args:
            checkpoint: the state to save.
            path: where to save it (a path or URL of this plugin's storage).
            storage_options: not supported; must be ``None``.

        Raises:
            TypeError: ``storage_options`` was given.
            ValueError: ``path`` is not a path of this storage.
            OSError: the storage failed (each plugin's class documents its own errors).
            DeferredOperationError: a save or removal asked for during this one (see above) failed;
                this checkpoint was saved.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not support `storage_options`, got {storage_options!r}")
        self._saving(checkpoint, self._target(path))

    @override
    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint at ``path``.

        Args:
            path: the checkpoint's path or URL.
            map_location: as for ``torch.load``.
            weights_only: as for ``torch.load``; ``None`` takes this plugin's ``weights_only``, and
                when that is ``None`` too, torch's default (``True`` since torch 2.6: no code in the
                checkpoint runs). Pass ``False`` only for checkpoints whose writers you trust.

        Raises:
            TypeError: ``weights_only`` is not ``True``, ``False`` or ``None``.
            ValueError: ``path`` is not a path of this storage.
            FileNotFoundError: no checkpoint at ``path``.
            WeightsOnlyError: weights-only loading refused an object in the checkpoint (the
                message names the checkpoint and the object).
            ReentrantOperationError: asked for on a thread that is inside another operation of
                this plugin (from a signal handler or a callback); that operation goes on.
            DeferredOperationError: a save or removal asked for during this load failed.
        """
        weights_only = check_weights_only(weights_only)
        target = self._target(path)
        if weights_only is None:
            weights_only = self.weights_only
        return self._loading(target, lambda: self._load(target, map_location, weights_only))

    def _load(self, target: Target, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        try:
            with collector_paused():
                return self._read(target, map_location, weights_only)
        except pickle.UnpicklingError as exc:
            if weights_only is False or not _is_weights_only_refusal(exc):
                raise
            raise WeightsOnlyError(
                f"Weights only load of checkpoint {self._describe(target)} refused (weights_only=True, torch's "
                f"default, under which loading runs no code): {_refused_object(exc)}. If you trust everyone who "
                "could write it, load it with weights_only=False (Trainer.fit(..., weights_only=False), "
                f"{type(self).__name__}(weights_only=False) or load_checkpoint(path, weights_only=False)), "
                "or allow that type with torch.serialization.add_safe_globals."
            ) from None

    @override
    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` if there is one, and cancel a save of it not yet written.

        A link at ``path`` is removed itself; what it points to stays. Asked for on a thread that
        is inside another operation of this plugin, the removal is made when that operation ends
        (a save of ``path`` asked for before it, and not yet begun, is then skipped).

        Raises:
            ValueError: ``path`` is not a path of this storage.
            DeferredOperationError: a save or removal asked for during this one failed.
        """
        self._removing(self._target(path))

    @override
    def teardown(self) -> None:
        """Forget the saves seen and release this process' connections or buffers (the next use
        makes new ones). Asked for on a thread inside another operation of this plugin, it is done
        when that operation ends.

        Raises:
            DeferredOperationError: a save or removal asked for during the teardown failed.
        """
        self._tearing_down()

    @override
    def _tear_down(self) -> None:
        super()._tear_down()
        self._close()


def _note(exc: BaseException | None, text: str) -> None:
    """Add ``text`` to what ``exc`` says where Python can (3.11+); the same is logged in every version."""
    if exc is not None and hasattr(exc, "add_note"):
        exc.add_note(text)


class _Deferred:
    """A save, removal or teardown asked for on a thread inside another operation of the plugin."""

    __slots__ = ("asked_at", "checkpoint", "kind", "queued", "target", "turn")

    def __init__(self, kind: str, target: Any, checkpoint: Any = None,
                 queued: QueuedSave | None = None, turn: int | None = None) -> None:
        self.kind = kind  # "saving", "removing" or "tearing down", as log lines say it
        self.target = target
        self.checkpoint = checkpoint  # what the save writes (given to _save)
        self.queued = queued
        self.turn = turn  # a removal's SaveOrder.turn(): it cancels the saves queued before it
        self.asked_at = time.monotonic()


class _ThreadOperations:
    """The operation of one plugin that one thread is inside (``None``: none), and what was asked
    for on that thread meanwhile."""

    __slots__ = ("current", "deferred")

    def __init__(self) -> None:
        self.current: str | None = None
        self.deferred: deque[_Deferred] = deque()

    def defer(self, deferred: _Deferred) -> None:
        self.deferred.append(deferred)

    def cancel_saves(self, target: Any) -> None:
        """Skip the saves of ``target`` deferred so far (a removal of it was asked for after them).

        Only this thread begins them. One it was beginning when the handler asking for the removal
        interrupted it is saved, then removed by the removal, deferred after it."""
        for deferred in list(self.deferred):
            if deferred.queued is not None and deferred.target == target:
                deferred.queued.cancelled = True
