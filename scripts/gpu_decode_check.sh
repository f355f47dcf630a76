#!/usr/bin/env bash
# One device call for the batched step: its GPU tests, then the decode benchmark against an
# earlier commit's code path, side by side in one process.
#
#   git archive 521fd56 sglang_dsv4 | tar -x -C .bench-old && mv .bench-old/sglang_dsv4 .bench-old/sglang_dsv4_old
#   run(command="bash scripts/gpu_decode_check.sh", carry=[".whl", ".bench-old"])
#
# .whl holds the sgl_flash_mla wheel (see gpu_check.sh). BENCH_ARGS go to bench_decode, e.g.
#   BENCH_ARGS='--configs flash8,flash43 --batches 1,16,64,256 --contexts 1024,16384,65536 --weights bf16,fp8'
#   BENCH_ARGS='--configs flash8 --batches 1,64 --contexts 16384 --paths graphs,graphs-det --weights fp8'
# (the deterministic mode's cost; benchmarks/chunk_invariance_gpu.py shows what it buys)
# (the first steps of a process compile the fused ops: allow a minute or two per config).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'grouped_mm', hasattr(torch, '_grouped_mm'))"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -x -m gpu -p no:cacheprovider ${TESTS:-tests/core/test_step_gpu.py tests/core/test_deterministic_gpu.py tests/srt/test_state_gpu.py tests/kernels/test_flashmla_gpu.py tests/kernels/test_fp8_gpu.py} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
rc=${PIPESTATUS[0]}
old=()
[ -d .bench-old/sglang_dsv4_old ] && old=(--old-root .bench-old)
python3 -m benchmarks.bench_decode "${old[@]}" --out "$OUT/decode_h200.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log"
echo "--- GPU tests exit status $rc"
exit "$rc"
