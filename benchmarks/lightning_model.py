"""The model, data and Trainer of the Lightning checkpoint benchmark, shared by its worker processes.

Lightning's demo Transformer with ``num_encoder_layers = num_decoder_layers = LAYERS``, trained for one
step on WikiText2-shaped tokens, as the Dataflux Lightning benchmark does. Weights and data come from a
fixed seed, so every process that builds them saves the same checkpoint. This module imports no storage
plugin: the peer's worker runs it in an environment with other GCS client releases.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 33278  # WikiText2's vocabulary, as in Lightning's demo
BLOCK_SIZE = 35
SYNTHETIC_TOKENS = 64 * BLOCK_SIZE
SEED = 0
# Lightning's informational console lines (accelerator summary, logger tips): the benchmark's console
# shows its own progress and tables only.
QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")


class SyntheticTokens(Dataset):
    """Random token blocks shaped like ``lightning.pytorch.demos.WikiText2`` items (offline stand-in)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, block_size: int = BLOCK_SIZE, seed: int = SEED) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (SYNTHETIC_TOKENS + 1,), generator=generator)
        self.block_size = block_size
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        return self.data[start : start + self.block_size], self.data[start + 1 : start + 1 + self.block_size]


def make_dataset(wikitext2_dir: str | None) -> Dataset:
    """WikiText2 from a local copy when given (the Dataflux Lightning benchmark's data), synthetic tokens otherwise."""
    if wikitext2_dir:
        from lightning.pytorch.demos import WikiText2

        return WikiText2(data_dir=Path(wikitext2_dir), download=False)
    return SyntheticTokens()


def make_model(layers: int, vocab_size: int) -> Any:
    """Lightning's demo Transformer with ``layers`` encoder and decoder layers (weights from :data:`SEED`)."""
    from lightning.pytorch.demos import LightningTransformer, Transformer

    class BenchmarkLightningTransformer(LightningTransformer):
        def __init__(self) -> None:
            super().__init__(vocab_size=vocab_size)
            self.model = Transformer(vocab_size=vocab_size, nlayers=layers)

        def prepare_data(self) -> None:
            """Data comes from the DataLoader passed to ``fit``; the demo's download is skipped."""

    torch.manual_seed(SEED)
    return BenchmarkLightningTransformer()


def quiet_lightning() -> None:
    """Keep Lightning's informational lines, its DataLoader worker hint and a torch deprecation notice
    about Lightning's code off the console."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning's pytree helper builds a LeafSpec, which newer torch releases deprecate.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def fitted_trainer(layers: int, wikitext2_dir: str | None, root_dir: str) -> Any:
    """A Trainer that has trained the benchmark's model for one step, ready to ``save_checkpoint``.

    Rows set ``trainer.strategy.checkpoint_io`` to their plugin before they save: every row
    checkpoints the same Trainer, model and optimizer.
    """
    from lightning.pytorch import Trainer

    quiet_lightning()
    dataset = make_dataset(wikitext2_dir)
    model = make_model(layers, dataset.vocab_size)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root_dir,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=1))
    # Checkpoints hold no gradients: freeing them halves the model's memory (2.6 GB at LAYERS=1000).
    model.zero_grad(set_to_none=True)
    return trainer


def save(trainer: Any, checkpoint_io: Any, path: str) -> None:
    """``trainer.save_checkpoint(path)`` through ``checkpoint_io``: the full checkpoint (weights,
    optimizer and loop state), as Lightning saves it by default."""
    trainer.strategy.checkpoint_io = checkpoint_io
    trainer.save_checkpoint(path, weights_only=False)
