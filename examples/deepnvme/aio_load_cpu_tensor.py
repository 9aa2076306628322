"""Load a file into a page-locked CPU tensor with DeepNVMe (aio, O_DIRECT)."""

import torch
from deepnvme_cli import aio_handle, completed, direct_io_size, load_args, load_example

if __name__ == "__main__":
    args = load_args(__doc__)
    num_bytes = direct_io_size(args.input_file)
    handle = aio_handle()
    buffer = handle.new_cpu_locked_tensor(num_bytes, torch.empty(0, dtype=torch.uint8))

    def load() -> torch.Tensor:
        completed(handle.sync_pread(buffer, args.input_file), "aio read")
        return buffer

    load_example("aio_load_cpu_tensor", args, num_bytes, load)
    handle.free_cpu_locked_tensor(buffer)
