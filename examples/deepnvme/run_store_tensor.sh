#!/usr/bin/env bash
# Run every tensor-store example: run_store_tensor.sh NVME_FOLDER [MB_SIZE] [LOOP]
# GPU and GDS examples run only where CUDA is available. PYTHON selects the interpreter.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python}"
nvme_folder="${1:?usage: $0 NVME_FOLDER [MB_SIZE] [LOOP]}"
mb_size="${2:-1024}"
loop="${3:-3}"

examples=(py_store_cpu_tensor aio_store_cpu_tensor)
if "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    examples+=(py_store_gpu_tensor aio_store_gpu_tensor gds_store_gpu_tensor)
else
    echo "CUDA is not available: skipping the GPU and GDS store examples"
fi
for example in "${examples[@]}"; do
    "$python" "$here/$example.py" --nvme_folder "$nvme_folder" --mb_size "$mb_size" --loop "$loop" --validate
done
