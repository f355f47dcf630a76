#!/usr/bin/env bash
# One device call: serve a tiny V4 checkpoint through SGLang on the GPU, query it, stop it.
#
#   run(command="bash scripts/gpu_server_check.sh", carry=[".whl", ".srt-site", ".inductor-cache"])   # $OUT comes back
# (.inductor-cache, optional: the compile caches an earlier call brought back, scripts/inductor_cache.sh)
#
# The device has no package registry. .srt-site/site.tar.xz (built by scripts/build_srt_site.sh, ~27 MB)
# holds sglang 0.5.23 and the packages the image lacks; it is unpacked to /tmp/srt-site. sgl-kernel
# and flashinfer are not carried: the pure-torch sgl_kernel stand-in (sglang_dsv4/srt/cpu_shim) takes
# their place, so the server runs with torch-native attention/sampling and no CUDA graphs; our model
# does its own attention (FlashMLA, from .whl). Without CUDA (a local dry run) it serves on the CPU.
# PRESET=flash8 serves V4-Flash dimensions cut to 8 layers (sglang_dsv4.tiny.FLASH_PRESETS; its 6.9 GiB
# checkpoint is written on the GPU first) instead of tiny. SERVER_ARGS go to the server, e.g.
#   SERVER_ARGS='--disable-overlap-schedule', or '--json-model-override-args {"dsv4_deterministic":true}'
# (the deterministic mode: then resumed and cold runs must give the same tokens, as on the CPU).
# Exit status: 0 when the server came up and every check below passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; PORT=${PORT:-30000}; PRESET=${PRESET:-tiny}; MODEL=${MODEL:-/tmp/$PRESET}; SITE=/tmp/srt-site
export OUT SWEEP_LABEL=${SWEEP_LABEL:-server}; LOG=$OUT/server_$SWEEP_LABEL.log  # one log per labelled server
mkdir -p "$OUT" "$SITE"
if python3 -c "import sglang, sglang_dsv4" 2>/dev/null; then
  SITE=/nonexistent  # a local dry run in this project's venv: its own SGLang and entry point
else
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -c "import tarfile; tarfile.open('.srt-site/site.tar.xz').extractall('$SITE', filter='data')" || exit 1
# Our plugin's entry point (group sglang.srt.plugins), as pip would install it from pyproject.toml.
python3 - "$SITE" <<'EOF' || exit 1
import pathlib, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
d = pathlib.Path(sys.argv[1], f"sglang_dsv4-{p['version']}.dist-info"); d.mkdir(exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang-dsv4\nVersion: {p['version']}\n")
(d / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
                                            for g, eps in p["entry-points"].items()))
EOF
fi
export PYTHONPATH=/tmp/site:$SITE:$PWD/sglang_dsv4/srt/cpu_shim:$PWD
# No sglang-kernel distribution here (the stand-in has none); the device cannot reach the HF Hub.
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
EXTRA=()
EXACT=0; [[ "${SERVER_ARGS:-}" == *dsv4_deterministic* ]] && EXACT=1
save_compile_caches() { :; }
if python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  source scripts/inductor_cache.sh  # compile caches: restored when carried, saved to $OUT at exit
else
  EXACT=1
  export SGLANG_USE_CPU_ENGINE=1   # local dry run: patches/cpu-launcher.md
  EXTRA=(--device cpu --dtype float32 --max-total-tokens 65536)
fi
python3 -c "import sys, torch, transformers, sglang; print('python', sys.version.split()[0], '| torch', torch.__version__,
  '| cuda', torch.cuda.is_available(), '| transformers', transformers.__version__, '| sglang', sglang.__version__)"
[ -f "$MODEL/config.json" ] || python3 -m sglang_dsv4.tiny --preset "$PRESET" --seed 0 --out "$MODEL" || exit 1

python3 -m sglang.launch_server --model-path "$MODEL" --port "$PORT" \
  --sampling-backend pytorch --mem-fraction-static 0.5 "${EXTRA[@]}" ${SERVER_ARGS:-} >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; save_compile_caches' EXIT
# SERVER_ARGS: more server arguments; SWEEP / SWEEP_LABEL: a throughput sweep after the checks;
# PROFILE_HIT: prompt lengths for benchmarks/profile_server.py (a hit's TTFT under SGLang's profiler)
healthy() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2>/dev/null; }
# HEALTH_WAIT: seconds to wait for /health (a start-up capture, --dsv4-cuda-graph-precapture-len,
# compiles first: flash8 at 1024 tokens had not finished in 280 s with cold caches, 2026-12-05)
for _ in $(seq "${HEALTH_WAIT:-300}"); do
  healthy && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited; log tail:"; tail -40 "$LOG"; exit 1; }
  sleep 1
done
healthy || { echo "no /health after ${HEALTH_WAIT:-300} s"; grep "start-up capture" "$LOG" | cut -c1-200; tail -40 "$LOG"; exit 1; }
echo "--- server up"
grep -E "Executed general plugin|sglang_dsv4|attention backend|Tree cache|[Cc]uda graph|Load weight end" "$LOG" | cut -c1-400

if [ "${CHECKS:-1}" = 1 ]; then  # CHECKS=0: the sweep and the profile alone (a short call)
EXACT=$EXACT python3 - "$PORT" "$MODEL" <<'EOF'
import json, os, sys, urllib.request
from tokenizers import Tokenizer
port, model = sys.argv[1:]

def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))

def flush():
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/flush_cache?timeout=30", b"", method="POST"), timeout=60)

def generate(ids, stop=None):
    sampling = {"max_new_tokens": 16, "temperature": 0, **({"stop_token_ids": [stop]} if stop is not None else {})}
    r = post("/generate", {"input_ids": ids, "sampling_params": sampling,
                           "return_logprob": True, "top_logprobs_num": 2})
    m = r["meta_info"]
    print(f"  prompt_tokens={m['prompt_tokens']} cached_tokens={m['cached_tokens']} "
          f"e2e={m['e2e_latency']:.3f}s text={r['text']!r}")
    return r

# Exact (CPU; a GPU server in the deterministic mode): every pair of runs of one prompt below
# gives the same tokens, however its passes were cut. Otherwise on the GPU a position computed
# alone (a resumed turn's first positions, a decode step) goes through FlashMLA's decode kernel
# and inside a prefill through the prefill kernel, and the first request of a shape runs kernels
# compiled for that static shape: they round differently, and with random weights (near-flat
# bf16 logits, fp8 activations) runs part at near-ties. Those pairs are then reported, not checked.
EXACT = os.environ.get("EXACT") == "1"

def agree(x, y, what):
    """Whether two greedy runs gave the same tokens; reports where they part, the largest
    log-probability difference of the tokens before it, and each run's top-1 minus the other
    run's token there (inf: not in its top 2)."""
    xs, ys = x["output_ids"], y["output_ids"]
    lx = [lp for lp, _, _ in x["meta_info"]["output_token_logprobs"]]
    ly = [lp for lp, _, _ in y["meta_info"]["output_token_logprobs"]]
    n = next((i for i, (a, b) in enumerate(zip(xs, ys)) if a != b), min(len(xs), len(ys)))
    drift = max((abs(a - b) for a, b in zip(lx[:n], ly[:n])), default=0.0)
    if xs == ys:
        print(f"INFO {what}: equal, {n} tokens, max |d logprob| {drift:.4f}")
        return True
    def gap(r, i, other):
        top = {t: lp for lp, t, _ in r["meta_info"]["output_top_logprobs"][i]}
        return top[r["output_ids"][i]] - top.get(other, float("-inf"))
    where = (f", top-1 minus the other's token there {gap(x, n, ys[n]):.4f} / {gap(y, n, xs[n]):.4f}"
             if n < min(len(xs), len(ys)) else "")
    print(f"INFO {what}: part at token {n} of {len(xs)}, max |d logprob| before {drift:.4f}{where}")
    return False

ids = Tokenizer.from_file(f"{model}/tokenizer.json").encode(
    "The quick brown fox jumps over the lazy dog. " * 8).ids
print("/generate, same prompt twice (greedy):")
a, b = generate(ids), generate(ids)
print("/generate, next turn: the prompt + the first answer (resumes at its finish point):")
c = generate(ids + a["output_ids"])
print("/v1/chat/completions:")
r = post("/v1/chat/completions", {"model": "default", "max_tokens": 16, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Hello! Who are you?"}]})
print("  ", json.dumps(r["choices"][0]["message"], ensure_ascii=False), r["usage"])
print("/flush_cache, then the next turn again, cold:")
flush()
d = generate(ids + a["output_ids"])
# the same prompt again (no snapshot to resume from: a full recompute, cut at the fork point),
# then cold twice after flushes (no cut)
e = generate(ids)
flush()
f = generate(ids)
flush()
g = generate(ids)
repeats = {f"a repeat (cached {b['meta_info']['cached_tokens']}) == the first answer": agree(a, b, "repeat vs first"),
           "repeat recomputed == repeat from a snapshot": agree(b, e, "repeat recomputed vs from a snapshot"),
           "the first request == cold after a flush": agree(a, f, "first request vs cold after a flush")}
# a stop-token finish (under overlap scheduling the step after it has fed the stop token, and
# the finish snapshot is taken one token further: patches/server-arg-overrides.md), resumed, then
# cold; its stop token comes from a cold run right before it (cold twice computes the same)
print("/generate with a stop token from a cold run, its next turn, the next turn cold:")
flush()
s0 = generate(ids)
flush()
stop = s0["output_ids"].index(s0["output_ids"][4]) + 1  # where a stop on that token ends
s = generate(ids, stop=s0["output_ids"][4])
t = generate(ids + s["output_ids"] + ids[:8])
flush()
u = generate(ids + s["output_ids"] + ids[:8])
with open(os.path.join(os.environ["OUT"], f"check_{os.environ['SWEEP_LABEL']}.json"), "w") as fh:  # for an A/B of two servers
    json.dump({k: v["output_ids"] for k, v in dict(a=a, b=b, c=c, d=d, e=e, f=f, g=g, s0=s0, s=s, t=t, u=u).items()}, fh)
checks = {
          "a stop-token finish stops on it": s["meta_info"]["finish_reason"]["type"] == "stop"
              and s["output_ids"] == s0["output_ids"][:stop],
          "its next turn resumes at its finish (cached = prompt + output - 1, or + output with overlap)":
              t["meta_info"]["cached_tokens"] - (len(ids) + len(s["output_ids"]) - 1) in (0, 1),
          "that turn after a flush is cold": u["meta_info"]["cached_tokens"] == 0,
          # (a stop-token finish under overlap scheduling is cached through its stop token)
          "next turn resumes at the first turn's finish (cached = prompt + output - 1)":
              c["meta_info"]["cached_tokens"] - (len(ids) + len(a["output_ids"]) - 1)
              in ((0, 1) if a["meta_info"]["finish_reason"]["type"] == "stop" else (0,)),
          "the same next turn after a flush is cold": d["meta_info"]["cached_tokens"] == 0,
          "cold twice after flushes: the same tokens": agree(f, g, "cold twice"),
          "chat completion has content": bool(r["choices"][0]["message"].get("content"))}
pairs = {"resumed next turn == the same prompt cold": agree(c, d, "next turn resumed vs cold"),
         "resumed stop-token turn == the same prompt cold": agree(t, u, "stop-token turn resumed vs cold"),
         **repeats}
if EXACT:
    checks.update(pairs)
else:
    print("INFO not exact here (see above): equal pairs", sum(pairs.values()), "of", len(pairs))
for name, ok in checks.items():
    print(("PASS " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
EOF
rc=$?
else rc=0; fi
if [ -n "${SWEEP:-}" ]; then  # e.g. SWEEP="--concurrency 1,8,64": throughput at those concurrencies
  echo "--- sweep ($SWEEP_LABEL)"
  python3 -m benchmarks.serve_sweep --port "$PORT" --label "$SWEEP_LABEL" $SWEEP 2>&1 | tee -a "$OUT/sweep.md"
  grep -E "captured the decode step|CUDA graphs of the decode" "$LOG" | cut -c1-300 | head -20
fi
if [ -n "${PROFILE_HIT:-}" ]; then  # e.g. PROFILE_HIT=1024,16384: a cache hit's TTFT under SGLang's profiler
  echo "--- profile_server ($PROFILE_HIT)"
  python3 -m benchmarks.profile_server --port "$PORT" --lengths "$PROFILE_HIT" --trace-dir /tmp/dsv4-server-trace 2>&1 \
    | tee -a "$OUT/profile_server.md"
  find /tmp/dsv4-server-trace -name "*.json.gz" -size -15M -exec cp {} "$OUT/" \;  # (at most 8 files come back)
fi
echo "--- server log: $LOG; exit status $rc"
exit $rc
