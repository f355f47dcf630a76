#!/usr/bin/env bash
# One device call: the same server twice, without (--disable-overlap-schedule) and then with SGLang's
# overlap scheduler (its default), each through gpu_server_check.sh's checks and its SWEEP; then the
# two servers' greedy outputs of those checks compared (same kernels, same batches: the same bits).
#
#   run(command="PRESET=flash8 SWEEP='--concurrency 1,8,64 --input-len 512 --output-len 64' bash scripts/gpu_overlap_ab.sh",
#       carry=[".whl", ".srt-site", ".inductor-cache"])   (compile caches: saved once, after the second server)
#
# SGLANG_DSV4_SYNC_DEBUG=warn in front: torch's sync debug mode around our forwards (srt/model.py),
# its warnings shown at the end (a short run for that: the mode slows every step a little).
# $OUT gets server_no_overlap.log, server_overlap.log, check_*.json and sweep.md (both sweeps' tables).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
rc=0
SAVE_COMPILE_CACHES=0 SERVER_ARGS="${SERVER_ARGS:-} --disable-overlap-schedule" SWEEP_LABEL=no_overlap PORT=30000 \
  bash scripts/gpu_server_check.sh || rc=1
SWEEP_LABEL=overlap PORT=30001 bash scripts/gpu_server_check.sh || rc=1
grep -o "'disable_overlap_schedule': [A-Za-z]*" "$OUT/server_no_overlap.log" "$OUT/server_overlap.log" | sort -u
# with SGLANG_DSV4_SYNC_DEBUG=warn in the environment: the host syncs inside our forwards, by site
grep -h -A2 "called a synchronizing CUDA operation" "$OUT/server_no_overlap.log" "$OUT/server_overlap.log" | head -30
python3 - "$OUT" <<'PY' || rc=1
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/check_{label}.json")) for label in ("no_overlap", "overlap")]
same = {k: runs[0][k] == runs[1][k] for k in runs[0]}
print(("PASS" if all(same.values()) else "FAIL") + " overlap vs not: the checks' greedy outputs equal", same)
sys.exit(0 if all(same.values()) else 1)
PY
echo "--- A/B exit status $rc"
exit $rc
