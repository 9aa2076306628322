"""Counting calls into torch's per-tensor save and load functions, which the fast paths replace."""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch._utils
import torch.serialization


def _nested(function: Any, name: str) -> types.CodeType:
    """The code of the function ``name`` defined inside ``function``."""
    return next(const for const in function.__code__.co_consts
                if isinstance(const, types.CodeType) and const.co_name == name)


def per_tensor_functions() -> dict[types.CodeType, str]:
    """torch's functions that torch.save and torch.load call once per tensor."""
    return {
        torch.Tensor._reduce_ex_internal.__code__: "Tensor._reduce_ex_internal",
        _nested(torch.serialization._load, "load_tensor"): "serialization.load_tensor",
        _nested(torch.serialization._load, "persistent_load"): "serialization.persistent_load",
        torch._utils._rebuild_tensor_v2.__code__: "_utils._rebuild_tensor_v2",
        torch._utils._rebuild_tensor_v3.__code__: "_utils._rebuild_tensor_v3",
    }


@contextlib.contextmanager
def per_tensor_torch_calls() -> Iterator[collections.Counter[str]]:
    """Count, in every thread, the calls into :func:`per_tensor_functions` made inside the block."""
    watched = per_tensor_functions()
    calls: collections.Counter[str] = collections.Counter()

    active = True

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if not active:  # a thread started inside the block, called after it: stop watching it
            sys.setprofile(None)
        elif event == "call" and frame.f_code in watched:
            calls[watched[frame.f_code]] += 1

    # Python 3.12 sets and clears the hook of every thread at once (threads the block started too).
    every_thread = getattr(threading, "setprofile_all_threads", None)
    if every_thread is not None:
        every_thread(profile)
    else:
        sys.setprofile(profile)
        threading.setprofile(profile)
    try:
        yield calls
    finally:
        active = False
        if every_thread is not None:
            every_thread(None)
        else:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
