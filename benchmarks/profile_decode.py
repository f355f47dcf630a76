"""Where a graphed decode step's time goes, on the GPU: host phases, replay alone, kernels.

    python -m benchmarks.profile_decode [--cases tiny:1:1024,flash8:64:16384] [--steps 20] [--weights fp8]

Per case (config:batch:context, the configs of ``bench_decode``): the whole step (the GPU drained
around it, as ``bench_decode`` times it), the graph replay alone (back to back, CUDA events), the
host time of each phase of ``V4Model.forward``, the eager step's kernels from the torch
profiler (count, summed time, top kernels by time), and with ``--census`` the eager step's kernel
launches by the innermost ``sglang_dsv4`` function that issued them (and its caller), from the
profiler's Python tracer: which code a fusion has to take on next (a graph replays the same
kernels; on an H200 each small one costs ~2-3 us however little it does). The last table gives
each case's roofline as ``bench_decode`` does (the bytes the step must read over the copy
bandwidth measured in the same run) and step / roofline. ``SGLANG_DSV4_COMPILE=0`` profiles the
uncompiled ops (``core.compiled``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.bench_decode import LAUNCH_CALLS, NewPath, bench_weights, copy_bandwidth, make_config, step_bytes
from sglang_dsv4.core import graphs as graphs_mod
from sglang_dsv4.core import model as model_mod


class PhaseTimer:
    """Wraps functions to sum their host time per call of the step."""

    def __init__(self):
        self.t = defaultdict(list)

    def wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.t[label].append(time.perf_counter() - t0)
            return out

        setattr(owner, name, timed)
        return fn


def replay_ms(path, n: int = 50) -> float:
    g = next(iter(path.model.graphs.graphs[path.cache].values()))
    for _ in range(3):
        g.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def kernels_of_eager_step(path) -> tuple[int, float, list[tuple[str, int, float]]]:
    from torch.profiler import ProfilerActivity, profile

    graphs, path.model.graphs = path.model.graphs, None
    path.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        path.step()
        torch.cuda.synchronize()
    path.model.graphs = graphs
    by = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by[e.name][0] += 1
            by[e.name][1] += e.device_time_total
    count = sum(v[0] for v in by.values())
    total = sum(v[1] for v in by.values()) / 1e3
    top = sorted(((k[:70], v[0], v[1] / 1e3) for k, v in by.items()), key=lambda x: -x[2])[:14]
    return count, total, top


LAUNCHES = LAUNCH_CALLS + ("cudaMemcpyAsync", "cudaMemsetAsync")  # a copy or memset is a graph node too


def _site(name: str) -> str | None:
    """'…/sglang_dsv4/core/ops.py(12): hc_pre' -> 'core/ops.py:hc_pre'; None outside the package
    and for ``core/compiled.py``'s dispatcher (the fused function's own frame is the site)."""
    if "sglang_dsv4/" not in name or "compiled.py" in name:
        return None
    path, _, fn = name.split("sglang_dsv4/")[-1].partition(": ")
    return f"{path.split('(')[0]}:{fn}"


def launch_census(path) -> tuple[int, list[tuple[str, int, float]], dict[str, dict[str, list]]]:
    """One eager step's kernel launches (and their kernels' GPU time) by (innermost package
    function <- its caller), from the profiler's trace with the Python tracer on. -> (launches,
    [(site, launches, kernel ms)] most launches first, {site: {kernel name: [launches, ms]}})."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    graphs, path.model.graphs = path.model.graphs, None
    path.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        path.step()
        torch.cuda.synchronize()
    path.model.graphs = graphs
    fd, trace = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    os.remove(trace)
    kernel_us = defaultdict(float)  # correlation id -> the kernel's (or copy's) GPU time
    kernel_name: dict[object, str] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            corr = e.get("args", {}).get("correlation")
            kernel_us[corr] += e["dur"]
            kernel_name[corr] = e["name"]
    # sweep per thread: python frames nest, so an open-frame stack gives each launch its frames
    marks = []
    for e in events:
        if e.get("cat") == "python_function":
            marks.append((e["tid"], e["ts"], 0, e["ts"] + e["dur"], e["name"]))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in LAUNCHES:
            marks.append((e["tid"], e["ts"], 1, e.get("args", {}).get("correlation"), None))
    marks.sort(key=lambda m: (m[0], m[1], m[2]))
    by = defaultdict(lambda: [0, 0.0])
    names: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    stack: list[tuple[float, str]] = []
    tid = None
    for t, ts, kind, x, name in marks:
        if t != tid:
            tid, stack = t, []
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if kind == 0:
            stack.append((x, name))
            continue
        sites = [s for s in (_site(n) for _, n in reversed(stack)) if s]
        site = " <- ".join(sites[:2]) if sites else "(outside the package)"
        by[site][0] += 1
        by[site][1] += kernel_us.get(x, 0.0) / 1e3
        kernel = names[site][kernel_name.get(x, "(no kernel)")[:60]]
        kernel[0] += 1
        kernel[1] += kernel_us.get(x, 0.0) / 1e3
    total = sum(v[0] for v in by.values())
    return total, sorted(((k, v[0], v[1]) for k, v in by.items()), key=lambda r: -r[1]), names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="tiny:1:1024,flash8:1:16384,flash8:64:16384")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--weights", default="bf16", help="bf16 or fp8 (bench_decode's weight modes)")
    ap.add_argument("--census", type=int, default=0, metavar="N",
                    help="print the N call sites that launch the most kernels in an eager step")
    ap.add_argument("--census-kernels", type=int, default=0, metavar="N",
                    help="with --census: the kernels each of the first N of those sites launches (what a fusion "
                         "there would replace)")
    args = ap.parse_args()
    timer = PhaseTimer()
    from sglang_dsv4.srt.state import SglangV4Cache
    timer.wrap(SglangV4Cache, "plan_tables", "plan_tables")
    timer.wrap(graphs_mod, "decode_inputs", "graph inputs")
    timer.wrap(model_mod.V4Model, "_per_request", "outputs")
    timer.wrap(model_mod.V4Model, "forward", "forward (all)")
    summary = []
    bw = copy_bandwidth("cuda")  # the roofline's: the bytes a step must read over this
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})")
    for case in args.cases.split(","):
        cname, b, ctx = case.split(":")
        b, ctx = int(b), int(ctx)
        cfg = make_config(cname, ctx + args.steps + 128)
        w = bench_weights(cfg, "cuda", args.weights)
        path = NewPath(cfg, w, b, ctx, args.steps + 20, "cuda", graphs=True)
        t0 = time.perf_counter()
        path.prefill(2048)
        for _ in range(3):
            path.step()
        torch.cuda.synchronize()
        print(f"(prefill + warm-up {time.perf_counter() - t0:.1f} s)", flush=True)
        timer.t.clear()
        wall = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            path.step()
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t0)
        phases = {k: 1e3 * statistics.median(v) for k, v in timer.t.items()}
        rep = replay_ms(path)
        n, ktotal, top = kernels_of_eager_step(path)
        print(f"\n## {case}: step {1e3 * statistics.median(wall):.2f} ms, replay alone {rep:.2f} ms, "
              f"eager kernels {n} summing {ktotal:.2f} ms")
        print("host ms per phase: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
        for name, cnt, ms in top:
            print(f"  {ms:8.3f} ms  {cnt:5d}x  {name}")
        if args.census:
            launches, sites, names = launch_census(path)
            print(f"launches by call site ({launches} in the eager step; kernel ms = their GPU time):")
            print("| launches | kernel ms | where (innermost <- caller) |\n|---|---|---|")
            for site, cnt, ms in sites[:args.census]:
                print(f"| {cnt} | {ms:.3f} | {site} |")
            if args.census_kernels:
                print("\nthe kernels of the sites with the most launches:")
                print("| where | launches | kernel ms | kernel |\n|---|---|---|---|")
                for site, _, _ in sites[:args.census_kernels]:
                    for kname, (cnt, ms) in sorted(names[site].items(), key=lambda kv: -kv[1][0]):
                        print(f"| {site} | {cnt} | {ms:.3f} | {kname} |")
        roof = 1e3 * step_bytes(cfg, w, b, ctx) / bw
        summary.append((case, 1e3 * statistics.median(wall), rep, n, ktotal, phases.get("forward (all)", 0), roof))
        del path, w
        torch.cuda.empty_cache()
    print("\n| case | step ms | replay ms | host forward ms | eager kernels | kernel ms | roofline ms "
          "| step / roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for case, s, r, n, k, f, roof in summary:
        print(f"| {case} | {s:.2f} | {r:.2f} | {f:.2f} | {n} | {k:.2f} | {roof:.3f} | {s / roof:.1f} |")


if __name__ == "__main__":
    main()
