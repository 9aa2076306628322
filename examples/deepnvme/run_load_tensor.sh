#!/usr/bin/env bash
# Run every tensor-load example on one input file: run_load_tensor.sh INPUT_FILE [LOOP]
# GPU and GDS examples run only where CUDA is available. PYTHON selects the interpreter.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python}"
input_file="${1:?usage: $0 INPUT_FILE [LOOP]}"
loop="${2:-3}"

examples=(py_load_cpu_tensor aio_load_cpu_tensor)
if "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    examples+=(py_load_gpu_tensor aio_load_gpu_tensor gds_load_gpu_tensor)
else
    echo "CUDA is not available: skipping the GPU and GDS load examples"
fi
for example in "${examples[@]}"; do
    "$python" "$here/$example.py" --input_file "$input_file" --loop "$loop" --validate
done
