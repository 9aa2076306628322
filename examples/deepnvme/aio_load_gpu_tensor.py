"""Load a file into a GPU tensor with DeepNVMe (aio into page-locked memory, then copy)."""

import torch
from deepnvme_cli import aio_handle, completed, direct_io_size, load_args, load_example, require_cuda

if __name__ == "__main__":
    args = load_args(__doc__)
    require_cuda("aio_load_gpu_tensor")
    num_bytes = direct_io_size(args.input_file)
    handle = aio_handle()
    bounce = torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")

    def load() -> torch.Tensor:
        completed(handle.sync_pread(bounce, args.input_file), "aio read")
        return target.copy_(bounce)

    load_example("aio_load_gpu_tensor", args, num_bytes, load)
