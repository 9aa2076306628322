"""FastPersist: no-patch NVMe checkpoint writer (torch.load-compatible files via async O_DIRECT I/O)."""

__all__: list[str] = []
