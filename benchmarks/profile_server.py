"""Where a running server's time to first token goes: SGLang's profiler around one request.

    python -m benchmarks.profile_server --port 30000 [--lengths 1024,16384] [--new 32] [--top 30]
        [--trace-dir /tmp/dsv4-server-trace]

For each prompt length: an untimed cold request and cache hit (this length's compiles), a fresh
prompt cold (so it is cached), then the hit (``--new`` tokens after it) with SGLang's torch
profiler on in the scheduler (``/start_profile``: CPU and GPU activity, Python stacks) and the cold
prompt again without it. Prints the hit's TTFT with and without the profiler, and from the trace:
the GPU kernels (count, summed time, the top ones), the CUDA runtime calls that block the host
(synchronisations, copies) and the Python functions by inclusive time (an occurrence nested in one
of the same name counted once): what the scheduler process does in that request's time. The
tokenizer and detokenizer processes are not in the trace; their share is the TTFT less the
trace's span. ``serve_sweep --hit-lengths`` measures the same TTFTs without the profiler.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import random
import re
import time
import urllib.request
from collections import defaultdict

from benchmarks.serve_sweep import _stream

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
HOST_CATS = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")  # not record_function ranges: they
# open and close in different Python frames, so they do not nest with them


def _short(name: str) -> str:
    """'/x/site-packages/sglang/srt/a.py(12): f' -> 'sglang/srt/a.py(12): f' (table width)."""
    name = re.sub(r" at 0x[0-9a-f]+", "", name)  # a bound method's object address
    for root in ("sglang_dsv4/", "sglang/"):
        if root in name:
            return root + name.split(root, 1)[1][:110]
    return name[:110]


def _post(port: int, path: str, body: dict | None = None) -> None:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=600).read()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


def _one(port: int, ids: list[int]) -> dict:
    return _stream(port, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                                 "ignore_eos": True}})


def _wait_trace(trace_dir: str, before: set[str], timeout: float = 300.0) -> str:
    """The trace file the profiler wrote after ``/stop_profile`` (its size steady for a second)."""
    end = time.time() + timeout
    while time.time() < end:
        new = [p for p in glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True) if p not in before]
        if new:
            path = max(new, key=os.path.getmtime)
            size = os.path.getsize(path)
            time.sleep(1.0)
            if size and os.path.getsize(path) == size:
                return path
        time.sleep(1.0)
    raise RuntimeError(f"no trace appeared in {trace_dir} within {timeout:.0f} s")


def summarise(path: str, top: int, thread: str = "run_event_loop") -> list[str]:
    """Markdown lines: the trace's span, its GPU kernels, blocking runtime calls, Python functions
    (those of the threads where a Python function whose name holds ``thread`` ran: SGLang's
    scheduler loop by default; an in-process harness names its own)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    blocking: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    launches = 0
    for e in events:
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            k = kernels[e["name"][:90]]
            k[0] += 1
            k[1] += e["dur"] / 1e3
        elif cat in ("cuda_runtime", "cuda_driver"):
            launches += "Launch" in e["name"]
            if e["name"] in BLOCKING:
                b = blocking[e["name"]]
                b[0] += 1
                b[1] += e["dur"] / 1e3
    lines = [f"trace span {span:.1f} ms; {sum(v[0] for v in kernels.values())} GPU kernels/copies summing to "
             f"{sum(v[1] for v in kernels.values()):.1f} ms; {launches} launches",
             "", "| blocking runtime call | count | host ms |", "|---|---|---|"]
    lines += [f"| {k} | {n} | {ms:.1f} |" for k, (n, ms) in sorted(blocking.items(), key=lambda x: -x[1][1])]
    lines += ["", "| GPU kernel | count | ms |", "|---|---|---|"]
    lines += [f"| {k} | {n} | {ms:.2f} |" for k, (n, ms) in sorted(kernels.items(), key=lambda x: -x[1][1])[:top]]
    # the scheduler's own thread (the one running its event loop): inclusive time of SGLang's and
    # our functions (an occurrence nested in one of the same name counted once), and a flat profile
    # of self time over Python functions, torch ops and runtime calls
    loop_tids = {e["tid"] for e in events if e.get("cat") == "python_function" and thread in e["name"]}
    mine = sorted((e for e in events if e["tid"] in loop_tids and e.get("cat") in HOST_CATS),
                  key=lambda e: (e["ts"], -e["dur"]))
    inclusive: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    own: dict[str, float] = defaultdict(float)
    open_until: dict[str, float] = {}
    stack: list[list] = []  # [end, name, self us]
    for e in mine:
        end = e["ts"] + e["dur"]
        while stack and stack[-1][0] <= e["ts"]:
            _, name, us = stack.pop()
            own[name] += us
        if stack:
            stack[-1][2] -= e["dur"]
        stack.append([end, e["name"], e["dur"]])
        if "sglang" in e["name"] and e["cat"] == "python_function" and open_until.get(e["name"], -1.0) < end:
            open_until[e["name"]] = end
            inclusive[e["name"]][0] += 1
            inclusive[e["name"]][1] += e["dur"] / 1e3
    for _, name, us in stack:
        own[name] += us
    lines += ["", f"| SGLang / sglang_dsv4 function, {thread} thread (inclusive) | calls | ms |", "|---|---|---|"]
    lines += [f"| {_short(k)} | {n} | {ms:.1f} |"
              for k, (n, ms) in sorted(inclusive.items(), key=lambda x: -x[1][1])[:top]]
    lines += ["", f"| self time, {thread} thread (Python function, torch op or runtime call) | ms |", "|---|---|"]
    lines += [f"| {_short(k)} | {us / 1e3:.1f} |" for k, us in sorted(own.items(), key=lambda x: -x[1])[:top]]
    return lines


def profile_length(port: int, length: int, new: int, top: int, trace_dir: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    warm = _prompt(rng, length)
    _one(port, warm)  # untimed: this length's compiles
    _one(port, warm + _prompt(rng, new))
    prompt, more = _prompt(rng, length), _prompt(rng, new)
    cold_ms = 1e3 * _one(port, prompt)["ttft"]
    before = set(glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True))
    _post(port, "/start_profile", {"output_dir": trace_dir, "activities": ["CPU", "GPU"], "with_stack": True,
                                   "record_shapes": False, "profile_id": f"hit{length}-{time.time_ns()}"})
    hit = _one(port, prompt + more)
    _post(port, "/stop_profile")
    path = _wait_trace(trace_dir, before)
    again = _one(port, prompt + _prompt(rng, new))  # the same hit without the profiler
    lines = [f"\n### prompt {length} tokens, a hit with {new} new (cached {hit['cached_tokens']})",
             f"TTFT: cold {cold_ms:.1f} ms; hit profiled {1e3 * hit['ttft']:.1f} ms; "
             f"hit unprofiled {1e3 * again['ttft']:.1f} ms (cached {again['cached_tokens']}); trace {path}", ""]
    return lines + summarise(path, top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--lengths", default="1024,16384")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="/tmp/dsv4-server-trace")
    args = ap.parse_args(argv)
    os.makedirs(args.trace_dir, exist_ok=True)
    for n in (int(x) for x in args.lengths.split(",")):
        print("\n".join(profile_length(args.port, n, args.new, args.top, args.trace_dir, seed=40_000 + n)),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
