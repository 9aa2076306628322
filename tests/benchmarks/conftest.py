"""Fixtures for the benchmark runners' tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _runner_logging_undone() -> Iterator[None]:
    """A runner's ``main()`` called in this process configures logging as its command does: a plain
    ``StreamHandler`` on the root logger, bound to the stderr of that moment (pytest's capture of the
    test, closed when the test ends), and levels. Later tests' records would go to that closed
    stream; pytest's own handlers (subclasses, added and removed around each phase) are left alone."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)}
    yield
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and handler not in before:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            logger.setLevel(levels.get(name, logging.NOTSET))
