"""SmartRedisCheckpointIO (save / load / remove / resume / async) and the model publisher."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import threading

import lightning.pytorch as pl
import numpy as np
import pytest
import redis
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from smartredis_io import (
    Client,
    Orchestrator,
    RedisServer,
    SmartRedisCheckpointIO,
    SmartRedisModelCheckpoint,
    SmartRedisModelPublisher,
)
from smartredis_io._client import protocol, wire
from smartredis_io.error import RedisReplyError
from tests.support.srio_models import TinyRegressor

SMALL_CHUNK = 4096


def _trainer(tmp_path, plugins=(), callbacks=(), **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=list(plugins), callbacks=list(callbacks), **kwargs,
    )


@pytest.fixture(params=["standalone", "cluster"])
def ckpt_io(request, redis_server, redis_cluster) -> SmartRedisCheckpointIO:
    cluster = request.param == "cluster"
    io = SmartRedisCheckpointIO(redis_cluster.address if cluster else redis_server.address, chunk_bytes=SMALL_CHUNK)
    yield io
    io.teardown()


def test_save_load_remove(ckpt_io: SmartRedisCheckpointIO, raw, uid: str) -> None:
    state = {"w": torch.randn(100, 50), "step": 7, "nested": {"b": torch.arange(10, dtype=torch.int16)}}
    path = f"ckpts/{uid}/epoch=0.ckpt"
    ckpt_io.save_checkpoint(state, path)
    header = wire.decode_header(raw.getrange(path, 0, wire.HEADER_MAX_BYTES - 1), path)
    assert header.chunks > 1, "a checkpoint larger than chunk_bytes is chunked"
    assert ckpt_io.checkpoint_size(path) == header.payload_bytes > state["w"].nbytes
    loaded = ckpt_io.load_checkpoint(path, map_location="cpu", weights_only=True)
    assert loaded["step"] == 7
    torch.testing.assert_close(loaded["w"], state["w"])
    torch.testing.assert_close(loaded["nested"]["b"], state["nested"]["b"])
    ckpt_io.remove_checkpoint(f"redis://{path}")
    assert not raw.exists(path)
    assert not any(raw.exists(k) for k in header.chunk_keys(path))
    with pytest.raises(FileNotFoundError, match=uid):
        ckpt_io.load_checkpoint(path)
    with pytest.raises(TypeError):
        ckpt_io.save_checkpoint(state, path, storage_options={"x": 1})
    with pytest.raises(ValueError):
        ckpt_io.save_checkpoint(state, "")


class _RunsACommand:
    """A pickle payload: unpickling it runs a shell command (here, one that creates ``marker``)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_checkpoint_runs_no_code_by_default(redis_server, tmp_path, uid: str) -> None:
    marker = tmp_path / "pwned"
    io = SmartRedisCheckpointIO(redis_server.address)
    path = f"{uid}/evil.ckpt"
    io.save_checkpoint({"state_dict": {}, "payload": _RunsACommand(marker)}, path)
    with pytest.raises(pickle.UnpicklingError, match=rf"{uid}/evil.ckpt.*weights_only=False"):
        io.load_checkpoint(path)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        _trainer(tmp_path, [io], max_steps=1, limit_val_batches=0).fit(TinyRegressor.make(), ckpt_path=path)
    assert not marker.exists(), "loading the checkpoint ran the payload"
    io.teardown()


def test_a_checkpoint_that_needs_weights_only_false_says_so(redis_server, uid: str) -> None:
    io = SmartRedisCheckpointIO(redis_server.address)
    state = {"w": torch.ones(2), "hyper_parameters": argparse.Namespace(lr=0.1)}
    io.save_checkpoint(state, f"{uid}.ckpt")
    with pytest.raises(pickle.UnpicklingError, match=r"argparse\.Namespace.*weights_only=False"):
        io.load_checkpoint(f"{uid}.ckpt")
    assert io.load_checkpoint(f"{uid}.ckpt", weights_only=False)["hyper_parameters"].lr == 0.1
    trusting = SmartRedisCheckpointIO(redis_server.address, weights_only=False)
    assert trusting.load_checkpoint(f"{uid}.ckpt")["hyper_parameters"].lr == 0.1
    io.teardown()
    trusting.teardown()


def _keys(server, pattern: str) -> set[bytes]:
    with redis.Redis(host=server.host, port=server.port, password=server.settings().password) as plain:
        return set(plain.keys(pattern))


@pytest.mark.parametrize("fault", ["unpicklable object", "server out of memory"])
def test_a_failed_save_leaves_the_previous_checkpoint(uid: str, fault: str) -> None:
    with RedisServer(extra_args=("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")) as server:
        io = SmartRedisCheckpointIO(server.address, chunk_bytes=SMALL_CHUNK)
        path = f"{uid}.ckpt"
        io.save_checkpoint({"v": torch.ones(3000)}, path)
        before = _keys(server, "*")
        if fault == "unpicklable object":
            bad, error = {"v": torch.zeros(3000), "lock": threading.Lock()}, TypeError
        else:
            bad, error = {"v": torch.zeros(4 << 20)}, RedisReplyError  # 16 MB into an 8 MB server
        with pytest.raises(error):
            io.save_checkpoint(bad, path)
        assert _keys(server, "*") == before, "the failed save's chunks are gone"
        torch.testing.assert_close(io.load_checkpoint(path)["v"], torch.ones(3000))
        io.teardown()


@pytest.mark.slow
@pytest.mark.parametrize("wrap_async", [False, True])
def test_trainer_saves_and_resumes(redis_server, raw, tmp_path, uid: str, wrap_async: bool) -> None:
    io = SmartRedisCheckpointIO(redis_server.address, chunk_bytes=SMALL_CHUNK)
    plugin = AsyncCheckpointIO(io) if wrap_async else io
    dirpath = tmp_path / uid
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    model = TinyRegressor.make()
    _trainer(tmp_path, [plugin], [checkpoint], max_steps=4, limit_val_batches=0).fit(model)
    keys = sorted(k.decode() for k in raw.keys(f"{dirpath}/*.ckpt"))
    assert [k.rsplit("/", 1)[1] for k in keys] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert not any(dirpath.glob("*.ckpt")), "nothing on the filesystem"

    resumed = TinyRegressor.make(seed=1)
    state = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            state["step"] = trainer.global_step
            state["weight"] = pl_module.net.weight.detach().clone()

    io2 = SmartRedisCheckpointIO(redis_server.address)
    _trainer(tmp_path, [io2], [Capture()], max_steps=6, limit_val_batches=0, enable_checkpointing=False).fit(
        resumed, ckpt_path=keys[-1])
    assert state["step"] == 4
    torch.testing.assert_close(state["weight"], model.net.weight.detach())
    io.teardown()


@pytest.mark.slow
def test_fit_publish_run_model_from_another_process(orchestrator: Orchestrator, tmp_path, uid: str) -> None:
    publisher = SmartRedisModelPublisher(uid, orchestrator.address, every_n_steps=2, on_validation_end=True)
    model = TinyRegressor.make()
    _trainer(tmp_path, callbacks=[publisher], max_steps=6, enable_checkpointing=False,
             limit_val_batches=1, val_check_interval=3).fit(model)
    assert publisher.published[-1] == f"{uid}.v6" and len(publisher.published) == 2
    x = np.random.default_rng(0).random((5, 4), dtype=np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    code = (
        "import json, sys, numpy as np\n"
        "from smartredis_io import Client\n"
        f"c = Client(False, {orchestrator.address!r})\n"
        f"c.put_tensor('{uid}x', np.array(json.loads(sys.argv[1]), dtype=np.float32))\n"
        f"c.run_model({uid!r}, ['{uid}x'], ['{uid}y'])\n"
        f"print(json.dumps(c.get_tensor('{uid}y').tolist()))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, json.dumps(x.tolist())], capture_output=True, text=True,
                            timeout=120, check=True)
    np.testing.assert_allclose(np.array(json.loads(result.stdout.strip().splitlines()[-1])), expected, rtol=1e-5)

    with Client(False, orchestrator.address) as client:
        with redis.Redis(host="127.0.0.1", port=orchestrator.database.port,
                         password=orchestrator.settings().password) as plain:
            alias = json.loads(plain.get(uid))
        assert alias["blob"] == protocol.blob_key(f"{uid}.v6", alias["version"])
        assert not client.model_exists(f"{uid}.v2"), "only the newest versions are kept"
        # New weights reach run_model(alias) without restarting anything.
        with torch.no_grad():
            model.net.weight.mul_(2)
            expected2 = model(torch.from_numpy(x)).numpy()
        publisher.publish(model, 100)
        client.put_tensor(uid + "x", x)
        client.run_model(uid, [uid + "x"], [uid + "y"])
        np.testing.assert_allclose(client.get_tensor(uid + "y"), expected2, rtol=1e-5)


def test_publisher_arguments(redis_server) -> None:
    with pytest.raises(ValueError, match="method"):
        SmartRedisModelPublisher("m", redis_server.address, method="onnx")
    with pytest.raises(ValueError, match="keep"):
        SmartRedisModelPublisher("m", redis_server.address, keep=1)
    with pytest.raises(ValueError, match="address"):
        SmartRedisCheckpointIO()


_RESUME = """
import json, sys
import lightning.pytorch as pl
from smartredis_io import SmartRedisCheckpointIO, SmartRedisModelCheckpoint
from tests.support.srio_models import TinyRegressor

dirpath, ckpt_path = sys.argv[1], sys.argv[2]
seen = {}

class Capture(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        seen["step"] = trainer.global_step

trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     max_steps=6, limit_val_batches=0, plugins=[SmartRedisCheckpointIO()],
                     callbacks=[Capture(), SmartRedisModelCheckpoint(dirpath=dirpath, save_last=True)])
trainer.fit(TinyRegressor.make(seed=1), ckpt_path=ckpt_path)
print(json.dumps(seen))
"""


def _resume_elsewhere(tmp_path, address: str, dirpath: str, ckpt_path: str) -> int:
    """Resume in a fresh process whose working directory is another one; the step it resumed at."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    result = subprocess.run([sys.executable, "-c", _RESUME, dirpath, ckpt_path], cwd=elsewhere, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "SSDB": address})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["step"]


@pytest.mark.slow
def test_redis_url_dirpath_and_ckpt_path_last(redis_server, tmp_path, uid: str, monkeypatch) -> None:
    monkeypatch.setenv("SSDB", redis_server.address)  # how ModelCheckpoint's filesystem finds the database
    io = SmartRedisCheckpointIO()
    checkpoint = ModelCheckpoint(dirpath=f"redis://{uid}run", every_n_train_steps=2, save_top_k=1,
                                 monitor="step", mode="max", save_last=True)
    _trainer(tmp_path, [io], [checkpoint], max_steps=4, limit_val_batches=0).fit(TinyRegressor.make())
    with redis.Redis(host=redis_server.host, port=redis_server.port) as plain:
        keys = sorted(k.decode() for k in plain.keys(f"{uid}run/*"))
    assert keys == [f"{uid}run/epoch=0-step=4.ckpt", f"{uid}run/last.ckpt"], "top-1 removed the older one"
    assert checkpoint.best_model_path == f"redis://{uid}run/epoch=0-step=4.ckpt"
    assert _resume_elsewhere(tmp_path, redis_server.address, f"redis://{uid}run", "last") == 4


@pytest.mark.slow
def test_local_paths_are_keyed_relative_to_the_root_dir(redis_server, tmp_path, uid: str, monkeypatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    io = SmartRedisCheckpointIO(redis_server.address)
    checkpoint = ModelCheckpoint(dirpath=f"runs/{uid}", every_n_train_steps=2, save_top_k=-1)
    _trainer(here, [io], [checkpoint], max_steps=4, limit_val_batches=0).fit(TinyRegressor.make())
    with redis.Redis(host=redis_server.host, port=redis_server.port) as plain:
        assert sorted(k.decode() for k in plain.keys(f"runs/{uid}/*")) == [
            f"runs/{uid}/epoch=0-step=2.ckpt", f"runs/{uid}/epoch=0-step=4.ckpt"]
    assert not (here / "runs").exists(), "nothing on the filesystem"
    step = _resume_elsewhere(tmp_path, redis_server.address, f"redis://{uid}/other", f"runs/{uid}/epoch=0-step=4.ckpt")
    assert step == 4


@pytest.mark.slow
@pytest.mark.parametrize("save_last", [True, "link"])
def test_ckpt_path_last_finds_the_checkpoints_keyed_by_a_local_directory(
    redis_server, tmp_path, uid: str, monkeypatch, save_last: bool | str
) -> None:
    """The checkpoints of a local ``dirpath`` are keys, not files (with ``"link"``, the links lead to
    no file): Lightning alone finds no last checkpoint there and trains from scratch."""
    monkeypatch.setenv("SSDB", redis_server.address)  # how Lightning's check of the found URL connects
    monkeypatch.chdir(tmp_path)
    started: list[int] = []

    class Started(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            started.append(trainer.global_step)

    for max_steps in (4, 6):
        checkpoint = SmartRedisModelCheckpoint(dirpath=f"runs/{uid}", save_last=save_last, every_n_train_steps=2)
        trainer = _trainer(tmp_path, [SmartRedisCheckpointIO()], [Started(), checkpoint], max_steps=max_steps,
                           limit_val_batches=0)
        trainer.fit(TinyRegressor.make(), ckpt_path="last")
    assert started == [0, 4]
    assert trainer.ckpt_path.startswith("redis://runs/")
    assert not any(path.is_file() for path in (tmp_path / "runs").rglob("*")), "nothing but links on the filesystem"


def test_lightning_lists_redis_urls_as_local_paths_without_the_subclass(redis_server, uid: str, monkeypatch) -> None:
    """Why SmartRedisModelCheckpoint exists; fails loudly when Lightning stops mangling remote URLs."""
    monkeypatch.setenv("SSDB", redis_server.address)
    io = SmartRedisCheckpointIO()
    io.save_checkpoint({"w": torch.ones(1)}, f"redis://{uid}/last.ckpt")
    stock = ModelCheckpoint(dirpath=f"redis://{uid}")
    ours = SmartRedisModelCheckpoint(dirpath=f"redis://{uid}")
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    assert ours._find_last_checkpoints(trainer) == {f"redis://{uid}/last.ckpt"}
    assert stock._find_last_checkpoints(trainer) == {f"{uid}/last.ckpt"}, "Lightning changed: drop the subclass?"


def test_stock_torch_checkpoint_io_saves_redis_urls_through_fsspec(redis_server, uid: str, monkeypatch) -> None:
    """Lightning's TorchCheckpointIO writes inside an fsspec transaction: the value is stored when the
    transaction commits, never when it is discarded, and the plugin loads what it stored."""
    import fsspec
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    monkeypatch.setenv("SSDB", redis_server.address)
    state = {"state_dict": {"w": torch.arange(6.0)}, "global_step": 3}
    TorchCheckpointIO().save_checkpoint(state, f"redis://{uid}/last.ckpt")
    assert TorchCheckpointIO().load_checkpoint(f"redis://{uid}/last.ckpt")["global_step"] == 3
    loaded = SmartRedisCheckpointIO().load_checkpoint(f"redis://{uid}/last.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(6.0))

    fs = fsspec.filesystem("redis")
    with pytest.raises(RuntimeError, match="abandoned"):
        with fs.transaction:
            with fs.open(f"redis://{uid}/dropped.ckpt", "wb") as f:
                f.write(b"never stored")
            raise RuntimeError("abandoned")
    assert not fs.exists(f"redis://{uid}/dropped.ckpt")


def test_the_plugin_pickles_and_keys_paths_portably(redis_server, tmp_path, uid: str) -> None:
    io = SmartRedisCheckpointIO(redis_server.address, root_dir=tmp_path)
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / uid / "a.ckpt")
    copy = pickle.loads(pickle.dumps(io))
    torch.testing.assert_close(copy.load_checkpoint(f"redis://{uid}/a.ckpt")["w"], torch.ones(2))
    assert io.key(tmp_path / uid / "a.ckpt") == f"{uid}/a.ckpt" == io.key(f"redis://{uid}/a.ckpt")
    assert io.key("/elsewhere/b.ckpt") == "/elsewhere/b.ckpt"  # outside the root: its absolute path
    with pytest.raises(ValueError, match="gs://"):
        io.save_checkpoint({}, "gs://bucket/c.ckpt")
    copy.teardown()
    io.teardown()
