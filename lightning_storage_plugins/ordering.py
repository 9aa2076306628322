"""The ordered-save base of the single-file CheckpointIOs, and the order it keeps.

Lightning's ``AsyncCheckpointIO`` queues saves on a worker thread but passes removals straight
through on the training thread. ``ModelCheckpoint`` therefore can remove a checkpoint whose save
has not been written yet; that save would publish it afterwards and it would never go away (a
``save_top_k=1`` run then fills the disk or bucket). :class:`OrderedCheckpointIO` keeps one
:class:`SaveOrder` and asks it before and after every save and before every removal; the three
single-file plugins (``DatafluxCheckpointIO``, ``FastPersistCheckpointIO``, ``SmartRedisCheckpointIO``)
derive from it and supply only their storage's parsing, writing, reading and deletion.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sys
import threading
import weakref
from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from lightning_storage_plugins import release
from lightning_storage_plugins.collector import collector_paused
from lightning_storage_plugins.messages import plain_text

__all__ = ["CheckpointDir", "OrderedCheckpointIO", "SaveOrder", "WeightsOnlyError", "check_weights_only",
           "live_plugins", "remove_local"]

log = logging.getLogger(__name__)

Target = TypeVar("Target", bound=Hashable)


class SaveOrder:
    """Cancels saves that a removal of the same path has overtaken.

    A removal of a path whose save is running, or, once saves have been seen on another thread
    than the remover's, of a path that does not exist yet, cancels that save: a save that has not
    started is skipped, a running one is removed as soon as it has landed.

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

    def begin_save(self, key: Hashable) -> bool:
        """Whether to go on with a save of ``key`` (``False``: it was removed before it could run)."""
        with self._lock:
            if key in self._cancelled and key not in self._saving:
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

    def removing(self, key: Hashable) -> None:
        """Record a removal of ``key``, cancelling a save of it that is running or still queued."""
        with self._lock:
            if key in self._saving:
                self._cancelled.add(key)
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


_live: weakref.WeakSet[OrderedCheckpointIO[Any]] = weakref.WeakSet()


def live_plugins() -> list[OrderedCheckpointIO[Any]]:
    """The single-file plugins made in this process that still exist."""
    return list(_live)


class CheckpointDir(NamedTuple):
    """Where a ``ModelCheckpoint`` of the starting run saves: its directory, and whether its ``last``
    checkpoints are links (``save_last="link"``: Lightning makes them in the local filesystem)."""

    dirpath: str
    links: bool


class OrderedCheckpointIO(CheckpointIO, Generic[Target]):
    """The skeleton of a single-file ``CheckpointIO``: saves and removals of one path kept in order.

    A subclass parses a path once into its storage's target (:meth:`_target`) and writes, reads,
    deletes and looks up targets; this class refuses ``storage_options``, checks ``weights_only``,
    cancels saves a removal overtook (:class:`SaveOrder`), types weights-only refusals as
    :class:`WeightsOnlyError`, and makes pickled copies (as spawn-based strategies make) start with
    this process' state left behind.

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
        _live.add(self)

    def _start_process_state(self) -> None:
        """Make this process' own state (at construction, and in a pickled copy)."""
        self._order = SaveOrder(self._stored)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in (*self._process_local, "_order"):
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
    def _write(self, checkpoint: dict[str, Any], target: Target) -> None:
        """Save ``checkpoint`` at ``target``, atomically: all of it appears, or the previous one stays."""

    @abstractmethod
    def _read(self, target: Target, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
        """Load the checkpoint at ``target``.

        Raises:
            FileNotFoundError: nothing is stored there.
        """

    @abstractmethod
    def _delete(self, target: Target) -> None:
        """Remove the checkpoint at ``target`` if there is one; a link is removed, never its target."""

    @abstractmethod
    def _stored(self, target: Target) -> bool:
        """Whether a checkpoint (or a link) is stored at ``target`` now."""

    def _describe(self, target: Target) -> str:
        """``target`` as messages name it."""
        return str(target)

    def _close(self) -> None:
        """Release this process' connections or buffers (the next use makes new ones)."""

    def preflight(self, checkpoint_dirs: Sequence[CheckpointDir]) -> None:
        """Check, when training starts, that checkpoints can be saved where ``ModelCheckpoint``
        will put them (called on global rank zero by :mod:`lightning_storage_plugins.preflight`).

        Raises:
            ValueError: a directory is not a place this storage can save to.
        """

    # CheckpointIO ----------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` at ``path``; the previous checkpoint there is replaced only once this
        one is whole, and a failed save leaves it as it was.

        Args:
            checkpoint: the state to save.
            path: where to save it (a path or URL of this plugin's storage).
            storage_options: not supported; must be ``None``.

        Raises:
            TypeError: ``storage_options`` was given.
            ValueError: ``path`` is not a path of this storage.
            OSError: the storage failed (each plugin's class documents its own errors).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not support `storage_options`, got {storage_options!r}")
        target = self._target(path)
        if not self._order.begin_save(target):
            log.debug("not saving %s: it was removed before its save ran", target)
            return
        try:
            with collector_paused():
                self._write(checkpoint, target)
        finally:
            remove = self._order.end_save(target)
        if remove:
            self._delete(target)

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
        """
        weights_only = check_weights_only(weights_only)
        target = self._target(path)
        if weights_only is None:
            weights_only = self.weights_only
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

        A link at ``path`` is removed itself; what it points to stays.

        Raises:
            ValueError: ``path`` is not a path of this storage.
        """
        target = self._target(path)
        self._order.removing(target)
        self._delete(target)

    @override
    def teardown(self) -> None:
        """Forget the saves seen and release this process' connections or buffers (the next use
        makes new ones)."""
        self._order.reset()
        self._close()
