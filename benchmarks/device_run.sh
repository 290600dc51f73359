#!/usr/bin/env bash
# One device call: GPU tests, then a decode sweep. Usage: bash benchmarks/device_run.sh "<pytest args>" "<sweep args>"
# The device machine runs a copy of the tree, not a git checkout: pass the commit measured for the result files,
# e.g. MOEBIUS_COMMIT=<git rev-parse HEAD here> bash benchmarks/device_run.sh ... (else they record "unknown").
# Other benchmarks run the same way: python3 benchmarks/<sub>/<name>.py ... (index: benchmarks/README.md).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
if [ -n "${1:-}" ]; then
  timeout 400 python3 -m pytest -m gpu -q -x -p no:cacheprovider $1 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
fi
if [ -n "${2:-}" ]; then
  timeout 900 python3 -m moebius.entrypoints.cli bench sweep $2 2>&1 | tee "$OUT/sweep.log" | grep -v "^INFO" | tail -60
  cp benchmarks/results/*sweep*.json benchmarks/results/*sweep*.png "$OUT/" 2>/dev/null
fi
