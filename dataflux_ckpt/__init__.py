"""Google Cloud Storage checkpointing for PyTorch Lightning (``gs://`` paths)."""

from dataflux_ckpt.emulator import FakeGcsServer

__all__ = ["FakeGcsServer"]
