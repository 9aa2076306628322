"""Load a file into a GPU tensor with Python file I/O (read to CPU, then copy)."""

import os

from deepnvme_cli import load_args, load_example, py_read, require_cuda

if __name__ == "__main__":
    args = load_args(__doc__)
    require_cuda("py_load_gpu_tensor")
    load_example(
        "py_load_gpu_tensor", args, os.path.getsize(args.input_file), lambda: py_read(args.input_file).cuda()
    )
