"""Load a file into a CPU tensor with Python file I/O."""

import os

from deepnvme_cli import load_args, load_example, py_read

if __name__ == "__main__":
    args = load_args(__doc__)
    load_example(
        "py_load_cpu_tensor", args, os.path.getsize(args.input_file), lambda: py_read(args.input_file)
    )
