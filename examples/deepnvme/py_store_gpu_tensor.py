"""Store a GPU tensor to a file with Python file I/O (copy to CPU, then write)."""

from deepnvme_cli import py_write, random_bytes, require_cuda, store_args, store_example

if __name__ == "__main__":
    args = store_args(__doc__)
    require_cuda("py_store_gpu_tensor")
    tensor = random_bytes(args.mb_size, device="cuda")
    store_example("py_store_gpu_tensor", args, tensor, lambda path: py_write(path, tensor.cpu()))
