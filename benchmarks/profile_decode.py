"""Where a graphed decode step's time goes, on the GPU: host phases, replay alone, kernels.

    python -m benchmarks.profile_decode [--cases tiny:1:1024,flash8:64:16384] [--steps 20] [--weights fp8]

Per case (config:batch:context, the configs of ``bench_decode``): the whole step (the GPU drained
around it, as ``bench_decode`` times it), the graph replay alone (back to back, CUDA events), the
host time of each phase of ``V4Model.forward``, and the eager step's kernels from the torch
profiler (count, summed time, top kernels by time). ``SGLANG_DSV4_COMPILE=0`` profiles the
uncompiled ops (``core.compiled``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.bench_decode import NewPath, bench_weights, make_config
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="tiny:1:1024,flash8:1:16384,flash8:64:16384")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--weights", default="bf16", help="bf16 or fp8 (bench_decode's weight modes)")
    args = ap.parse_args()
    timer = PhaseTimer()
    from sglang_dsv4.srt.state import SglangV4Cache
    timer.wrap(SglangV4Cache, "plan_tables", "plan_tables")
    timer.wrap(graphs_mod, "decode_inputs", "graph inputs")
    timer.wrap(model_mod.V4Model, "_per_request", "outputs")
    timer.wrap(model_mod.V4Model, "forward", "forward (all)")
    summary = []
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
        summary.append((case, 1e3 * statistics.median(wall), rep, n, ktotal, phases.get("forward (all)", 0)))
        del path, w
        torch.cuda.empty_cache()
    print("\n| case | step ms | replay ms | host forward ms | eager kernels | kernel ms |")
    print("|---|---|---|---|---|---|")
    for case, s, r, n, k, f in summary:
        print(f"| {case} | {s:.2f} | {r:.2f} | {f:.2f} | {n} | {k:.2f} |")


if __name__ == "__main__":
    main()
