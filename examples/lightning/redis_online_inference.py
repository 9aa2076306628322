"""Train a model with Lightning and serve it from Redis while it trains.

The publisher callback stores the traced model under a new version at each validation end and moves
the alias ``regressor`` to it; any SmartRedis client then runs it with ``run_model``.
"""

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from smartredis_io import Client, Orchestrator, SmartRedisCheckpointIO, SmartRedisModelPublisher


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.example_input_array = torch.zeros(1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    x = torch.randn(256, 4)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    with Orchestrator(shards=1, workers=1) as db:
        trainer = Trainer(
            plugins=[SmartRedisCheckpointIO(address=db.address)],
            callbacks=[SmartRedisModelPublisher("regressor", address=db.address)],
            default_root_dir="redis-example", max_epochs=3, logger=False, enable_progress_bar=False,
        )
        trainer.fit(Regressor(), DataLoader(data, batch_size=32), DataLoader(data, batch_size=64))

        client = Client(cluster=False, address=db.address)
        client.put_tensor("query", np.ones((1, 4), dtype=np.float32))
        client.run_model("regressor", inputs=["query"], outputs=["answer"])
        answer = np.empty((1, 1), dtype=np.float32)
        client.unpack_tensor("answer", answer)
        print("model served from Redis: f([1, 1, 1, 1]) =", float(answer[0, 0]), "(target 4.0)")


if __name__ == "__main__":
    main()
