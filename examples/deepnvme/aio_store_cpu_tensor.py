"""Store a page-locked CPU tensor to a file with DeepNVMe (aio, O_DIRECT)."""

from deepnvme_cli import aio_handle, completed, random_bytes, store_args, store_example

if __name__ == "__main__":
    args = store_args(__doc__)
    handle = aio_handle()
    tensor = random_bytes(args.mb_size)
    buffer = handle.new_cpu_locked_tensor(tensor.numel(), tensor)
    buffer.copy_(tensor)
    store_example(
        "aio_store_cpu_tensor",
        args,
        tensor,
        lambda path: completed(handle.sync_pwrite(buffer, path), "aio write"),
    )
    handle.free_cpu_locked_tensor(buffer)
