"""Errors of operations asked for on a thread that is inside another operation of the same plugin.

A Python signal handler runs on the main thread between two bytecodes of whatever that thread was
doing. Lightning's Slurm requeue handler (``SLURMEnvironment(auto_requeue=True)``) saves a
checkpoint from there, so a plugin may be asked to save while the same thread is in the middle of
one of its saves, with its buffers, handles and connections in use. The single-file plugins
(:class:`~lightning_storage_plugins.ordering.OrderedCheckpointIO`) run such a save when the
operation in progress ends; what cannot wait (a load, whose caller needs its result) is refused
with :class:`ReentrantOperationError`, as is any re-entry of a ``fastpersist.FastPersistContext``.

This module imports nothing beyond the standard library, so that ``fastpersist`` can raise these
errors without importing Lightning.
"""

from __future__ import annotations

__all__ = ["DeferredOperationError", "ReentrantOperationError"]


class ReentrantOperationError(RuntimeError):
    """An operation was asked for on a thread that is inside another one it cannot run within (from
    a signal handler, or a callback of that operation); it was refused, before it touched anything,
    and the operation in progress goes on unharmed.

    Attributes:
        busy: what the thread was doing, e.g. ``"saving /ckpt/last.ckpt"``.
        refused: what was refused, e.g. ``"loading /ckpt/hpc_ckpt_1.ckpt"``.
    """

    def __init__(self, busy: str, refused: str, advice: str = "") -> None:
        super().__init__(busy, refused, advice)  # the arguments, so that a pickled copy is the same
        self.busy = busy
        self.refused = refused
        self.advice = advice

    def __str__(self) -> str:
        text = (f"{self.refused} was refused: it was asked for on a thread that is {self.busy} (from a "
                "signal handler or a callback that runs inside that operation)")
        return f"{text}; {self.advice}" if self.advice else text


class DeferredOperationError(RuntimeError):
    """An operation that was asked for while the same thread was inside another operation of the
    same plugin, and so ran when that one ended, failed. It is raised by the operation it waited
    for, whose own work succeeded (its own failure is raised instead, with this one logged).

    Attributes:
        operation: the deferred operation, e.g. ``"saving /ckpt/hpc_ckpt_1.ckpt"``.
        during: the operation it waited for, e.g. ``"saving /ckpt/last.ckpt"``.
    """

    def __init__(self, operation: str, during: str, reason: str) -> None:
        super().__init__(operation, during, reason)
        self.operation = operation
        self.during = during
        self.reason = reason

    def __str__(self) -> str:
        return (f"{self.operation} failed: {self.reason} (it was asked for while this thread was "
                f"{self.during}, and ran once that had ended, successfully)")
