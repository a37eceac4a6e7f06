#!/usr/bin/env bash
# On the GPU machine: install carried wheels, run GPU tests and benchmarks, keep results.
# Usage: bash benchmarks/gpu/run.sh STEP...   (steps: tests tier forward transfer serving)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LMCACHE_TRACK_USAGE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@"; echo "=== rc=$? in $((SECONDS - t0)) s"; }
for s in "$@"; do
  case "$s" in
    tests) step 150 python3 -m pytest -x -q -p no:cacheprovider tests/gpu -k "not tier" ;;
    tier) step 150 python3 -m pytest -x -q -p no:cacheprovider tests/gpu -k tier ;;
    forward) step 200 python3 -m benchmarks.model_forward --model v41-bench --device cuda \
      --dtype bfloat16 --prompt-len 2048 --decode-steps 16 --batch 1 8 \
      --name model_forward_h200 ;;
    transfer) step 150 python3 -m benchmarks.transfer --device cuda --chunks 1 4 16 28 \
      --repeats 5 ;;
    serving) step 400 python3 -m benchmarks.serving --preset gpu ;;
    train) step 400 python3 -m tools.train_recall --minutes ${TRAIN_MINUTES:-6} --out "$OUT/v41-recall" ;;
  esac
done
cp benchmarks/results/*h200* "$OUT"/ 2>/dev/null
ls "$OUT"
