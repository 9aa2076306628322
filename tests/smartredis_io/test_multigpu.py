"""The multi-GPU family: one copy per GPU, the GPU an offset picks, and the CPU where there is no GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from smartredis_io import Client, Orchestrator
from smartredis_io.error import RedisKeyError, RedisReplyError, RedisRuntimeError
from smartredis_io.worker.devices import model_device
from smartredis_io.worker.supervisor import worker_device
from tests.support.srio_models import torchscript_bytes

X = np.arange(8, dtype=np.float32).reshape(2, 4)
CPU = torch.device("cpu")


class WhereItRan(torch.nn.Module):
    """Returns the index of the CUDA device its input is on (-1 on the CPU), and the input doubled."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((1,), x.get_device()), x * 2


SCRIPT = "def where(x):\n    return torch.full([1], x.get_device())\n"


def test_model_device_follows_the_device_a_model_was_set_for() -> None:
    cuda1 = torch.device("cuda", 1)
    assert model_device("CPU", cuda1, gpus=2) == (CPU, "")
    assert model_device("GPU", cuda1, gpus=2) == (cuda1, "")
    assert model_device("GPU", CPU, gpus=2) == (torch.device("cuda", 0), "")
    assert model_device("GPU:1", CPU, gpus=2) == (cuda1, "")
    device, warning = model_device("GPU:3", torch.device("cuda", 0), gpus=2)
    assert device == torch.device("cuda", 0) and "has 2 GPU(s)" in warning
    for name in ("GPU", "GPU:0", "gpu:1"):
        device, warning = model_device(name, CPU, gpus=0)
        assert device == CPU and "no GPU" in warning


def test_workers_spread_over_the_gpus() -> None:
    assert [worker_device("cuda", i, gpus=2) for i in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert worker_device("cuda", 3, gpus=0) == "cpu"
    assert worker_device("cuda:1", 3, gpus=2) == "cuda:1"


def _double(x):
    return x * 2


def _ran_on(client: Client, uid: str) -> tuple[int, np.ndarray]:
    return int(client.get_tensor(uid + "where")[0]), client.get_tensor(uid + "y")


def test_models_set_for_gpus_run_on_the_cpu_here(orchestrator: Orchestrator, orch_client: Client, uid: str) -> None:
    """On a machine without GPUs every copy runs, on the CPU (the workers log a warning)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_multigpu_on_gpus covers it")
    blob = torchscript_bytes(WhereItRan())
    orch_client.set_model_multigpu(uid, blob, "TORCH", 1, 2)
    assert orch_client.get_model(uid) == blob
    for key in (uid, f"{uid}.GPU:1", f"{uid}.GPU:2"):
        assert orch_client.model_exists(key)
    assert not orch_client.model_exists(f"{uid}.GPU:0")
    orch_client.put_tensor(uid + "x", X)
    for offset in range(4):
        orch_client.run_model_multigpu(uid, offset, 1, 2, [uid + "x"], [uid + "where", uid + "y"])
        where, y = _ran_on(orch_client, uid)
        assert where == -1
        np.testing.assert_array_equal(y, X * 2)
    address = [orchestrator.address]
    calls = [int(orch_client.get_ai_info(address, f"{uid}.GPU:{gpu}")[0]["calls"]) for gpu in (1, 2)]
    assert calls == [2, 2], "offsets 0..3 alternate between the two copies"
    orch_client.delete_model_multigpu(uid, 1, 2)
    for key in (uid, f"{uid}.GPU:1", f"{uid}.GPU:2"):
        assert not orch_client.model_exists(key)
    with pytest.raises(RedisRuntimeError, match="do not exist"):
        orch_client.delete_model_multigpu(uid, 1, 2)


def test_scripts_and_functions_per_gpu(orch_client: Client, uid: str) -> None:
    orch_client.set_script_multigpu(uid, SCRIPT, 0, 2)
    assert orch_client.get_script(uid) == SCRIPT
    orch_client.put_tensor(uid + "x", X)
    orch_client.run_script_multigpu(uid, "where", uid + "x", uid + "where", 5, 0, 2)
    assert orch_client.get_tensor(uid + "where").shape == (1,)
    with pytest.raises(RedisReplyError, match="GPU:1"):
        orch_client.run_script_multigpu(uid, "missing", uid + "x", uid + "where", 5, 0, 2)
    orch_client.delete_script_multigpu(uid, 0, 2)
    assert not orch_client.model_exists(uid) and not orch_client.model_exists(f"{uid}.GPU:0")

    orch_client.set_function_multigpu(uid, _double, 0, 1)
    orch_client.run_script_multigpu(uid, "_double", [uid + "x"], [uid + "y"], 7, 0, 1)
    np.testing.assert_array_equal(orch_client.get_tensor(uid + "y"), X * 2)


def test_multigpu_bad_input(standalone: Client, uid: str) -> None:
    blob = torchscript_bytes(WhereItRan())
    for call in (
        lambda: standalone.set_model_multigpu(uid, blob, "TORCH", -1, 1),
        lambda: standalone.set_model_multigpu(uid, blob, "TORCH", 0, 0),
        lambda: standalone.run_model_multigpu(uid, 0, -1, 1),
        lambda: standalone.run_model_multigpu(uid, 0, 0, 0),
        lambda: standalone.delete_model_multigpu(uid, 0, 0),
        lambda: standalone.set_script_multigpu(uid, SCRIPT, -1, 1),
        lambda: standalone.run_script_multigpu(uid, "f", "x", "y", 0, 0, 0),
        lambda: standalone.delete_script_multigpu(uid, -1, 1),
        lambda: standalone.set_function_multigpu(uid, _double, 0, 0),
    ):
        with pytest.raises(ValueError):
            call()
    for call in (
        lambda: standalone.set_model_multigpu(42, blob, "TORCH", 0, 1),
        lambda: standalone.set_model_multigpu(uid, blob, "PYTORCH", 0, 1),
        lambda: standalone.set_model_multigpu(uid, blob, "TORCH", "0", 1),
        lambda: standalone.set_model_multigpu(uid, blob, "TORCH", 0, 1, tag=42),
        lambda: standalone.set_model_from_file_multigpu(uid, "no-such-file", "TORCH", 0, "1"),
        lambda: standalone.run_model_multigpu(uid, "0", 0, 1),
        lambda: standalone.run_script_multigpu(uid, "f", 42, "y", 0, 0, 1),
        lambda: standalone.set_function_multigpu(uid, "not a function", 0, 1),
        lambda: standalone.delete_script_multigpu(uid, 0, "1"),
    ):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(RedisRuntimeError, match="batch_size must be non-zero"):
        standalone.set_model_multigpu(uid, blob, "TORCH", 0, 1, min_batch_size=1)
    with pytest.raises(FileNotFoundError):
        standalone.set_model_from_file_multigpu(uid, "no-such-file", "TORCH", 0, 1)
    with pytest.raises(RedisKeyError):
        standalone.get_model(uid)


@pytest.mark.gpu
def test_multigpu_on_gpus(uid: str) -> None:
    """Each offset runs on GPU first_gpu + offset % num_gpus."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gpus = torch.cuda.device_count()
    with Orchestrator(shards=1, workers=2, device="cuda") as orchestrator, \
            Client(False, orchestrator.address) as client:
        client.set_model_multigpu(uid, torchscript_bytes(WhereItRan()), "TORCH", 0, gpus)
        client.put_tensor(uid + "x", X)
        for offset in range(2 * gpus):
            client.run_model_multigpu(uid, offset, 0, gpus, [uid + "x"], [uid + "where", uid + "y"])
            where, y = _ran_on(client, uid)
            assert where == offset % gpus
            np.testing.assert_array_equal(y, X * 2)
        client.set_model(uid + "gpu", torchscript_bytes(WhereItRan()), "TORCH", "GPU")
        client.run_model(uid + "gpu", [uid + "x"], [uid + "where", uid + "y"])
        assert _ran_on(client, uid)[0] >= 0
        client.set_model(uid + "cpu", torchscript_bytes(WhereItRan()), "TORCH", "CPU")
        client.run_model(uid + "cpu", [uid + "x"], [uid + "where", uid + "y"])
        assert _ran_on(client, uid)[0] == -1
