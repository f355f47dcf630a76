#!/usr/bin/env bash
# One device call for the batched step: its GPU tests, then the decode benchmark against earlier
# code paths, side by side in one call.
#
#   git archive 521fd56 sglang_dsv4 | tar -x -C .bench-old && mv .bench-old/sglang_dsv4 .bench-old/sglang_dsv4_old
#   mkdir -p .bench-prev && git archive COMMIT sglang_dsv4 | tar -x -C .bench-prev   # optional
#   run(command="bash scripts/gpu_decode_check.sh", carry=[".whl", ".bench-old", ".srt-site", ".bench-prev", ".inductor-cache"])
#   (.inductor-cache: the compile caches a call brings back, scripts/inductor_cache.sh)
#
# .whl holds the sgl_flash_mla wheel (see gpu_check.sh). .srt-site (scripts/build_srt_site.sh), when
# carried, puts SGLang on the path as in the server, so the tests and the benchmark run the SGLang
# kernels the server runs (kernels/hc_split.py). .bench-prev, when carried, holds an earlier
# commit's package: bench_decode then runs first on it, in its own process with the same path (the
# "before" table; PREV_NO_SRT=1 leaves SGLang off its path, for a package older than hc_split.py),
# then on this tree. .bench-old/sglang_dsv4_old is 521fd56's per-request path
# (bench_decode's `old` rows). BENCH_ARGS go to bench_decode, e.g.
#   BENCH_ARGS='--configs flash8,flash43 --batches 1,16,64,256 --contexts 1024,16384,65536 --weights bf16,fp8'
#   BENCH_ARGS='--configs flash8 --batches 1,64 --contexts 16384 --paths graphs,graphs-det --weights fp8'
#   GENERIC_TOO=1 (then the same benchmark with SGLANG_DSV4_COMPILE=generic, core/compiled.py;
#   its files are decode_env0.md and bench_env0.log)
#   ALSO_ENV='TORCHINDUCTOR_ENABLE_PDL=1;SGLANG_DSV4_COMBO_KERNELS=1' (then the same benchmark once
#   per ';'-separated set of environment assignments, each its own process: switches read at
#   import or compile time, which --switches cannot set per path; ALSO_TIMEOUT each, 300 s;
#   ALSO_ARGS: their bench_decode arguments where they differ from BENCH_ARGS)
# (the deterministic mode's cost; benchmarks/chunk_invariance_gpu.py shows what it buys)
# (the first steps of a process compile the fused ops: allow a minute or two per config; bench_decode
# prints how many graphs it compiled and the seconds it took). SGLANG_DSV4_COMPILE=0 in front runs
# everything with eager ops: a short call's way to the tests and the deterministic mode's cost
# (session 8: GPU tests + flash8 B1/B64 graphs vs graphs-det in 106 s); TEST_COMPILE=0 does it for
# the tests alone. PROFILE_ARGS, when set, run benchmarks/profile_decode.py last (e.g.
# PROFILE_ARGS='--cases flash8:1:16384 --weights fp8 --census 40': launches per call site).
# TESTS_COMPILED: GPU tests run a second time with compilation on (the fused regions' own tests);
# PREV_ARGS: bench_decode's arguments for .bench-prev when they differ from BENCH_ARGS.
# HARNESSES: other benchmark modules with their arguments, ';'-separated, run after the tests.
# INDEX_SWEEP_ARGS: benchmarks/bench_index_scores.py's arguments (e.g. '--batches 64,256'), run after the tests.
# FP8_SWEEP_ARGS: benchmarks/bench_fp8_gemm.py's arguments (the fp8 GEMM's tile configurations), run
# after the tests (e.g. FP8_SWEEP_ARGS='--experts 32,8 --dense-tokens 256').
# NCU_CASES: benchmarks/ncu_kernels.py's cases (e.g. 'dense:wo_b:64,wo_a:64,experts:8:64') under Nsight
# Compute, after the harnesses: its memory, occupancy and stall sections to $OUT/ncu.txt (NCU_TIMEOUT, 240 s).
# NO_BENCH=1 skips both bench_decode runs (a call for the tests, the sweep or the profile alone: without
# it the bench runs its default configs, tiny included, whatever else is asked).
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
source scripts/inductor_cache.sh  # compile caches: restored when carried, saved to $OUT at exit
trap save_compile_caches EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'grouped_mm', hasattr(torch, '_grouped_mm'))"
# MAXFAIL: failures before pytest stops (default 3: a call is too dear to lose every later test to
# the first failure, as session 24's first call did with -x)
SGLANG_DSV4_COMPILE=${TEST_COMPILE:-${SGLANG_DSV4_COMPILE:-1}} timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q --maxfail=${MAXFAIL:-3} -m gpu -p no:cacheprovider ${TESTS:-tests/core/test_step_gpu.py tests/core/test_deterministic_gpu.py tests/srt/test_state_gpu.py tests/kernels/test_flashmla_gpu.py tests/kernels/test_fp8_gpu.py} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
rc=${PIPESTATUS[0]}
if [ -n "${TESTS_COMPILED:-}" ]; then  # tests of the fused regions themselves: compilation on
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q --maxfail=${MAXFAIL:-3} -m gpu -p no:cacheprovider $TESTS_COMPILED 2>&1 \
    | tee "$OUT/pytest_gpu_compiled.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ -n "${FP8_SWEEP_ARGS:-}" ]; then  # the fp8 GEMM's tile configurations (benchmarks/bench_fp8_gemm.py)
  echo "--- bench_fp8_gemm $FP8_SWEEP_ARGS"
  timeout ${FP8_SWEEP_TIMEOUT:-200} python3 -m benchmarks.bench_fp8_gemm $FP8_SWEEP_ARGS 2>&1 | tee "$OUT/fp8_sweep.log" | grep "^|\|copy\|Error"
fi
if [ -n "${HARNESSES:-}" ]; then  # other harnesses, ';'-separated 'module args' (e.g. 'benchmarks.bench_topk --batches 1,256')
  IFS=';' read -ra harness <<< "$HARNESSES"
  for h in "${harness[@]}"; do
    echo "--- $h"
    timeout ${HARNESS_TIMEOUT:-150} python3 -m $h 2>&1 | tee -a "$OUT/harnesses.log" | grep "^|\|copy\|Error"
  done
fi
if [ -n "${NCU_CASES:-}" ]; then  # what keeps decode-sized kernels from their bytes (benchmarks/ncu_kernels.py)
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  echo "--- ncu $NCU_CASES (${ncu:-no ncu found})"
  [ -n "$ncu" ] && timeout ${NCU_TIMEOUT:-240} "$ncu" --clock-control none --nvtx --nvtx-include "ncu/" \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 -m benchmarks.ncu_kernels --cases "$NCU_CASES" > "$OUT/ncu.txt" 2>&1
  grep "^case \|  [a-z_0-9]*kernel\|Duration\|DRAM Throughput\|Registers Per\|Achieved Occupancy\|L2 Hit" "$OUT/ncu.txt" | head -80
fi
if [ -n "${INDEX_SWEEP_ARGS:-}" ]; then  # the indexer-score kernel's tilings (benchmarks/bench_index_scores.py)
  echo "--- bench_index_scores $INDEX_SWEEP_ARGS"
  timeout ${INDEX_SWEEP_TIMEOUT:-200} python3 -m benchmarks.bench_index_scores $INDEX_SWEEP_ARGS 2>&1 | tee "$OUT/index_sweep.log" | grep "^|\|copy\|Error"
fi
if [ -d .bench-prev/sglang_dsv4 ] && [ -z "${NO_BENCH:-}" ]; then
  prev_paths=$PATHS
  [ -n "${PREV_NO_SRT:-}" ] && prev_paths=/tmp/site
  echo "--- before: .bench-prev's package (path $prev_paths)"
  # -P: `python -m` puts the current directory (this tree, with its own sglang_dsv4) ahead of
  # PYTHONPATH, so without it the "before" run measured this tree (sessions 7-12's side-by-sides)
  PYTHONPATH=$prev_paths:$PWD/.bench-prev:$PWD timeout ${PREV_TIMEOUT:-300} python3 -P -m benchmarks.bench_decode \
    --out "$OUT/decode_prev.md" ${PREV_ARGS:-${BENCH_ARGS:-}} 2>&1 | tee "$OUT/bench_prev.log" | grep "^|\|^package"
fi
old=()
[ -d .bench-old/sglang_dsv4_old ] && old=(--old-root .bench-old)
if [ -z "${NO_BENCH:-}" ]; then
  echo "--- this tree"
  timeout ${BENCH_TIMEOUT:-480} python3 -m benchmarks.bench_decode "${old[@]}" --out "$OUT/decode_h200.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log" | grep "^|\|^package\|captured\|compiled graphs\|Error"
fi
# GENERIC_TOO: the opt-in shape-generic compilation (core/compiled.py) as one more such process, with
# a compile cache of its own: cold compile time (prefill s) and decode speed beside the default's
if [ -n "${GENERIC_TOO:-}" ]; then
  ALSO_ENV="SGLANG_DSV4_COMPILE=generic TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-generic TRITON_CACHE_DIR=/tmp/inductor-generic/triton${ALSO_ENV:+;$ALSO_ENV}"
fi
if [ -n "${ALSO_ENV:-}" ]; then
  IFS=';' read -ra envsets <<< "$ALSO_ENV"
  for i in "${!envsets[@]}"; do
    echo "--- this tree, ${envsets[$i]}"
    env ${envsets[$i]} timeout ${ALSO_TIMEOUT:-300} python3 -m benchmarks.bench_decode --out "$OUT/decode_env$i.md" \
      ${ALSO_ARGS:-${BENCH_ARGS:-}} 2>&1 | tee "$OUT/bench_env$i.log" | grep "^|\|captured\|compiled graphs\|Error"
  done
fi
if [ -n "${PROFILE_ARGS:-}" ]; then
  echo "--- profile_decode $PROFILE_ARGS"
  timeout ${PROFILE_TIMEOUT:-300} python3 -m benchmarks.profile_decode $PROFILE_ARGS 2>&1 | tee "$OUT/profile.log" | tail -80
fi
echo "--- GPU tests exit status $rc"
exit "$rc"
