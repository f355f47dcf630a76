#!/usr/bin/env bash
# One device call: install the carried FlashMLA wheel, run the GPU tests, run the attention benchmark.
#
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"])   # the device tool; $OUT comes back
#
# .whl holds sgl_flash_mla-1.0.0-cp310-abi3-manylinux2014_x86_64.whl (pip download, see
# /work/.library/device/README.md); the device has torch, pytest, hypothesis and safetensors.
# Extra arguments go to the benchmark (e.g. --quick). Exit status: the GPU tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DSV4_GPU_REPORT=$OUT/gpu_numbers.jsonl
rm -f "$DSV4_GPU_REPORT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/srt/test_state_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
rc=${PIPESTATUS[0]}
python3 benchmarks/bench_attention.py --out "$OUT/attention_h200.md" "$@" 2>&1 | tee "$OUT/bench.log"
echo "--- GPU test numbers"
cat "$DSV4_GPU_REPORT" 2>/dev/null
echo "--- GPU tests exit status $rc"
exit "$rc"
