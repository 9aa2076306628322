"""Store a CPU tensor to a file with Python file I/O."""

from deepnvme_cli import py_write, random_bytes, store_args, store_example

if __name__ == "__main__":
    args = store_args(__doc__)
    tensor = random_bytes(args.mb_size)
    store_example("py_store_cpu_tensor", args, tensor, lambda path: py_write(path, tensor))
