"""Tiny TorchScript models and scripts shared by the worker and Lightning tests."""

from __future__ import annotations

import io

import torch

#: why a test of the published client skips: smartredis 0.6.1 has wheels up to Python 3.11, built against numpy 1
PUBLISHED_SKIP = ("the published SmartRedis client (smartredis==0.6.1, in the [test] extra on Python < 3.12 with numpy < 2) "
                  "is not importable here")

SCRIPT = '''
def double(x):
    return x * 2

def add_and_sub(a, b):
    return a + b, a - b

def slow(x):
    # About a second of work: long enough to kill its worker in the middle.
    y = x
    for i in range(50000):
        y = y + 1
    return y - 50000

def spin(x):
    # Runs until its worker is killed: the "worker dies mid-request" case.
    y = x
    for i in range(1000000000):
        y = y + 1
    return y

def forever(x):
    # Never returns: only the request's deadline stops it.
    while True:
        x = x + 1
    return x

def uninitialized(x):
    # Memory nobody wrote: the bytes of an earlier run, unless the worker fills it.
    return torch.empty(x.shape[0])

def seed(x):
    torch.manual_seed(7)
    return x

def draw(x):
    return torch.rand(x.shape[0])
'''


class BatchRows(torch.nn.Module):
    """Returns, for every row, the number of rows in the batch the model actually saw."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], 1), float(x.shape[0])) + x[:, :1] * 0


class Failing(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 7)  # fails for any size that is not a multiple of 7


def linear(seed: int = 0, n_in: int = 4, n_out: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out).eval()


def torchscript_bytes(module: torch.nn.Module, example: torch.Tensor | None = None) -> bytes:
    scripted = torch.jit.trace(module, example) if example is not None else torch.jit.script(module)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    return buffer.getvalue()


class TinyRegressor:
    """Factory of a small LightningModule (imported lazily: Lightning is heavy)."""

    @staticmethod
    def make(seed: int = 0):
        import lightning.pytorch as pl

        class Regressor(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(seed)
                self.net = torch.nn.Linear(4, 2)
                self.example_input_array = torch.zeros(1, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net(x)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.mse_loss(self(x), y)

            def validation_step(self, batch, batch_idx):
                x, y = batch
                self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):
                return _loader()

            def val_dataloader(self):
                return _loader()

        return Regressor()


def _loader():
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(32, 4, generator=generator)
    y = torch.stack([x.sum(1), x[:, 0] - x[:, 1]], dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class MapsAFile(torch.nn.Module):
    """A malicious model: maps ``path`` into a tensor with ``torch.from_file`` and overwrites its bytes."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        data = torch.from_file(self.path, True, 4, dtype=torch.uint8)
        data.fill_(88)
        return x + data.sum()


class WritesWhileLoading(torch.nn.Module):
    """A malicious model whose ``__setstate__`` (run by ``torch.jit.load``) overwrites ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.mapped = torch.zeros(4, dtype=torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.path, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.path = state[0]
        self.training = state[1]
        self.mapped = torch.from_file(self.path, True, 4, dtype=torch.uint8).fill_(88)


#: A malicious script (``.format(path=...)`` first): overwrites the file ``path``.
MAPS_A_FILE_SCRIPT = '''
def touch(x):
    data = torch.from_file("{path}", True, 4, dtype=torch.uint8)
    data.fill_(88)
    return x
'''
