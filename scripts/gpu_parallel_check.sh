#!/usr/bin/env bash
# One device call on 2 GPUs: the sharded core (TP=2, EP=2, TP=2+EP=2 and data-parallel attention
# DP=2+EP=2, over NCCL; DP's row counts over a gloo group) against TP=1 on the
# tiny FlashMLA-shaped preset, decode step times, then the gpu-marked parallel test and FlashMLA's
# kernel tests at 32 (padded), 64 and 128 heads.
#
#   run(command="bash scripts/gpu_parallel_check.sh", carry=[".whl"], kind="nvidia-h200-x2")
#
# The markdown report lands in $OUT/parallel_h200x2.md (copy it to benchmarks/results/). Extra
# arguments go to the check (e.g. --time 1,8). Exit status: the check's, else the test's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# NVLink multicast stays off: on a shared host it can take the GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
timeout 320 python3 -m sglang_dsv4.parallel_check --preset tiny --device cuda --time 1,8,32,64 \
    --out "$OUT/parallel_h200x2.md" "$@" 2>&1 | tee "$OUT/parallel_check.log"
rc=${PIPESTATUS[0]}
# the gpu-marked parallel test, and FlashMLA with fewer than 64 heads (a TP rank's share, padded)
export DSV4_GPU_REPORT=$OUT/gpu_numbers.jsonl
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_parallel.py \
    tests/kernels/test_flashmla_gpu.py -k "parallel or padded or matches_reference" 2>&1 | tee "$OUT/pytest_gpu.log"
rc_test=${PIPESTATUS[0]}
grep -h '"padded_heads"\|"heads": 32' "$DSV4_GPU_REPORT" 2>/dev/null
echo "--- check exit status $rc, gpu test exit status $rc_test"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$rc_test"
