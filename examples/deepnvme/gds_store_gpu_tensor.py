"""Store a GPU tensor straight to a file with DeepNVMe GPUDirect Storage."""

from deepnvme_cli import completed, gds_handle, random_bytes, require_cuda, store_args, store_example

if __name__ == "__main__":
    args = store_args(__doc__)
    require_cuda("gds_store_gpu_tensor", gds_folder=args.nvme_folder)
    handle = gds_handle()
    tensor = random_bytes(args.mb_size, device="cuda")
    handle.pin_device_tensor(tensor)
    store_example(
        "gds_store_gpu_tensor",
        args,
        tensor,
        lambda path: completed(handle.sync_pwrite(tensor, path), "gds write"),
    )
    handle.unpin_device_tensor(tensor)
