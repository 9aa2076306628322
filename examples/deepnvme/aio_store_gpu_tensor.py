"""Store a GPU tensor to a file with DeepNVMe (copy into page-locked memory, then aio write)."""

import torch
from deepnvme_cli import aio_handle, completed, random_bytes, require_cuda, store_args, store_example

if __name__ == "__main__":
    args = store_args(__doc__)
    require_cuda("aio_store_gpu_tensor")
    handle = aio_handle()
    tensor = random_bytes(args.mb_size, device="cuda")
    bounce = torch.empty(tensor.numel(), dtype=torch.uint8).pin_memory()

    def store(path: str) -> None:
        bounce.copy_(tensor)
        completed(handle.sync_pwrite(bounce, path), "aio write")

    store_example("aio_store_gpu_tensor", args, tensor, store)
