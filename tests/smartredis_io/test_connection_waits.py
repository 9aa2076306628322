"""Waiting for a database that is not there: said at the start, ended at SR_CONN_TIMEOUT, typed.

A SmartRedis program, or a Lightning run with ``SmartRedisCheckpointIO``, started before its database
logs what it waits for and until when, gives up when ``SR_CONN_TIMEOUT`` says (to half a second),
and fails with ``RedisConnectionError`` naming the address and ``SSDB``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_storage_plugins.services import free_port
from smartredis_io import Client, SmartRedisCheckpointIO
from smartredis_io.error import RedisConnectionError


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port whose listener accepts connections (the kernel does) and never answers,
    as a stopped or overloaded server behaves."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


@pytest.mark.parametrize(("timeout_s", "interval_ms"), [(1, 1000), (2, 700), (3, 1000)])
def test_client_without_a_server_says_what_it_waits_for_and_ends_at_sr_conn_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, timeout_s: int, interval_ms: int) -> None:
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("SSDB", address)
    monkeypatch.setenv("SR_CONN_TIMEOUT", str(timeout_s))
    monkeypatch.setenv("SR_CONN_INTERVAL", str(interval_ms))
    start = time.time()
    with caplog.at_level(logging.INFO, logger="smartredis_io"), pytest.raises(RedisConnectionError) as failed:
        Client()
    elapsed = time.time() - start
    assert abs(elapsed - timeout_s) <= 0.5, elapsed
    assert f"{address} (SSDB) within {timeout_s} s (SR_CONN_TIMEOUT)" in str(failed.value)
    waits = [r for r in caplog.records if r.levelno == logging.WARNING and address in r.getMessage()]
    assert len(waits) == 1, caplog.records
    assert waits[0].created - start < 0.5, "the wait was not announced at its start"
    assert f"until {timeout_s} s have passed (SR_CONN_TIMEOUT)" in waits[0].getMessage()


def test_a_server_that_never_answers_is_announced_early_and_given_up_at_sr_conn_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, silent_port: int) -> None:
    monkeypatch.setenv("SR_CONN_TIMEOUT", "4")
    start = time.time()
    with caplog.at_level(logging.INFO, logger="smartredis_io"), \
            pytest.raises(RedisConnectionError, match=rf"127\.0\.0\.1:{silent_port}\b.* within 4 s \(SR_CONN_TIMEOUT\)"):
        Client(False, f"127.0.0.1:{silent_port}")
    assert abs(time.time() - start - 4) <= 0.5
    waits = [r for r in caplog.records if r.levelno == logging.WARNING and str(silent_port) in r.getMessage()]
    assert len(waits) == 1 and waits[0].created - start < 1.5, caplog.records


class _CountSteps(Callback):
    steps = 0

    def on_train_batch_start(self, *args: object) -> None:
        self.steps += 1


@pytest.mark.parametrize("dirpath", ["local", "redis://run"])
def test_a_missing_database_in_a_lightning_run_is_the_typed_error_naming_ssdb_before_the_first_step(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dirpath: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("SSDB", address)
    monkeypatch.setenv("SR_CONN_TIMEOUT", "1")
    monkeypatch.chdir(tmp_path)
    steps = _CountSteps()
    trainer = Trainer(max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                      plugins=[SmartRedisCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath=str(tmp_path / dirpath) if dirpath == "local" else dirpath,
                                                 every_n_train_steps=1), steps])
    start = time.monotonic()
    with pytest.raises(Exception) as failed:
        trainer.fit(BoringModel())
    assert isinstance(failed.value, RedisConnectionError), repr(failed.value)
    assert not isinstance(failed.value, redis.exceptions.RedisError)
    assert f"{address} (SSDB)" in str(failed.value) and "SR_CONN_TIMEOUT" in str(failed.value)
    assert steps.steps == 0, "the missing database was found only at the first save"
    assert time.monotonic() - start < 10
