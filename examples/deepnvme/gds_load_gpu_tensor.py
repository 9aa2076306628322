"""Load a file straight into a GPU tensor with DeepNVMe GPUDirect Storage."""

import os

import torch
from deepnvme_cli import completed, direct_io_size, gds_handle, load_args, load_example, require_cuda

if __name__ == "__main__":
    args = load_args(__doc__)
    require_cuda("gds_load_gpu_tensor", gds_folder=os.path.dirname(os.path.abspath(args.input_file)))
    num_bytes = direct_io_size(args.input_file)
    handle = gds_handle()
    target = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    handle.pin_device_tensor(target)

    def load() -> torch.Tensor:
        completed(handle.sync_pread(target, args.input_file), "gds read")
        return target

    load_example("gds_load_gpu_tensor", args, num_bytes, load)
    handle.unpin_device_tensor(target)
