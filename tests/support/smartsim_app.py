"""What a SmartSim application does with its database, through the published SmartRedis client:
tensors, a TorchScript model, a torch.export program and a TorchScript script, each run on the
database's execution workers. The SmartSim tests call :func:`exercise` from the test process, and
run this file as a colocated application (``python smartsim_app.py PREFIX``, database from ``SSDB``).
"""

from __future__ import annotations

import io
import sys
import warnings

import numpy as np
import torch

SCRIPT = "def shift(x):\n    return x + 1.0\n"


def _models() -> tuple[torch.nn.Module, bytes, bytes]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).eval()
    example = torch.zeros(3, 4)
    scripted = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated; it is one format SmartSim uses
        torch.jit.save(torch.jit.trace(model, example), scripted)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    exported = io.BytesIO()
    torch.export.save(program, exported)
    return model, scripted.getvalue(), exported.getvalue()


def exercise(client, prefix: str) -> None:
    """Put/get, set_model + run_model (TorchScript and torch.export), set_script + run_script; raises
    AssertionError on a wrong result."""
    x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
    client.put_tensor(f"{prefix}.x", x)
    np.testing.assert_array_equal(client.get_tensor(f"{prefix}.x"), x)
    model, scripted, exported = _models()
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    for form, blob in (("torchscript", scripted), ("export", exported)):
        client.set_model(f"{prefix}.{form}", blob, "TORCH", "CPU")
        client.run_model(f"{prefix}.{form}", [f"{prefix}.x"], [f"{prefix}.{form}.y"])
        np.testing.assert_allclose(client.get_tensor(f"{prefix}.{form}.y"), expected, rtol=1e-5, atol=1e-6)
    client.set_script(f"{prefix}.script", SCRIPT, "CPU")
    client.run_script(f"{prefix}.script", "shift", [f"{prefix}.x"], [f"{prefix}.shifted"])
    np.testing.assert_array_equal(client.get_tensor(f"{prefix}.shifted"), x + 1.0)


def main(prefix: str) -> int:
    """Exercise the colocated database (``SSDB``) and say so on stdout."""
    from smartredis import Client

    exercise(Client(cluster=False), prefix)
    sys.stdout.write(f"exercised {prefix}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
