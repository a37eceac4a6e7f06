#!/usr/bin/env bash
# On the GPU machine: install carried wheels, run GPU tests and benchmarks, keep results.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LMCACHE_TRACK_USAGE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, lmcache; print(torch.__version__, torch.cuda.get_device_name(0))'
step() { echo "=== $*"; local t0=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t0)) s"; }
case "${1:-all}" in
  tests|all)
    step python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -20 ;;&
  forward|all)
    step python3 -m benchmarks.model_forward --model v41-bench --device cuda --dtype bfloat16 \
      --prompt-len 4096 --decode-steps 32 --batch 1 16 --name model_forward_h200 ;;&
  transfer|all)
    step python3 -m benchmarks.transfer --device cuda --chunks 1 4 16 28 --repeats 10 ;;&
  serving|all)
    step python3 -m benchmarks.serving --preset gpu ;;&
esac
cp benchmarks/results/*h200* "$OUT"/ 2>/dev/null
ls -la "$OUT"
