"""Helpers shared by the test suite: process signalling, model fixtures for workers, state-dict comparison.

Imported as ``tests.support``: pytest puts the checkout's root on ``sys.path`` (``pythonpath`` in
pyproject.toml), and child processes that import these modules get it through ``PYTHONPATH``.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
