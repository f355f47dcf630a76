#!/usr/bin/env bash
# One device call for the batched step: its GPU tests, then the decode benchmark against earlier
# code paths, side by side in one call.
#
#   git archive 521fd56 sglang_dsv4 | tar -x -C .bench-old && mv .bench-old/sglang_dsv4 .bench-old/sglang_dsv4_old
#   mkdir -p .bench-prev && git archive COMMIT sglang_dsv4 | tar -x -C .bench-prev   # optional
#   run(command="bash scripts/gpu_decode_check.sh", carry=[".whl", ".bench-old", ".srt-site", ".bench-prev"])
#
# .whl holds the sgl_flash_mla wheel (see gpu_check.sh). .srt-site (scripts/build_srt_site.sh), when
# carried, puts SGLang on the path as in the server, so the tests and the benchmark run the SGLang
# kernels the server runs (kernels/hc_split.py). .bench-prev, when carried, holds an earlier
# commit's package: bench_decode then runs first on it, in its own process without SGLang (the
# "before" table), then on this tree. .bench-old/sglang_dsv4_old is 521fd56's per-request path
# (bench_decode's `old` rows). BENCH_ARGS go to bench_decode, e.g.
#   BENCH_ARGS='--configs flash8,flash43 --batches 1,16,64,256 --contexts 1024,16384,65536 --weights bf16,fp8'
#   BENCH_ARGS='--configs flash8 --batches 1,64 --contexts 16384 --paths graphs,graphs-det --weights fp8'
# (the deterministic mode's cost; benchmarks/chunk_invariance_gpu.py shows what it buys)
# (the first steps of a process compile the fused ops: allow a minute or two per config).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
PATHS=/tmp/site
if [ -f .srt-site/site.tar.xz ]; then
  python3 -c "import tarfile; tarfile.open('.srt-site/site.tar.xz').extractall('/tmp/srt-site', filter='data')" || exit 1
  PATHS=/tmp/site:/tmp/srt-site
fi
export PYTHONPATH=$PATHS:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'grouped_mm', hasattr(torch, '_grouped_mm'))"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -x -m gpu -p no:cacheprovider ${TESTS:-tests/core/test_step_gpu.py tests/core/test_deterministic_gpu.py tests/srt/test_state_gpu.py tests/kernels/test_flashmla_gpu.py tests/kernels/test_fp8_gpu.py} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
rc=${PIPESTATUS[0]}
if [ -d .bench-prev/sglang_dsv4 ]; then
  echo "--- before: .bench-prev's package, no SGLang on the path"
  PYTHONPATH=/tmp/site:$PWD/.bench-prev:$PWD timeout ${PREV_TIMEOUT:-300} python3 -m benchmarks.bench_decode \
    --out "$OUT/decode_prev.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_prev.log" | grep "^|"
fi
old=()
[ -d .bench-old/sglang_dsv4_old ] && old=(--old-root .bench-old)
echo "--- this tree"
timeout ${BENCH_TIMEOUT:-480} python3 -m benchmarks.bench_decode "${old[@]}" --out "$OUT/decode_h200.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log" | grep "^|\|captured\|Error"
echo "--- GPU tests exit status $rc"
exit "$rc"
