"""Prefill latency in-process: a prompt cold, and a short extension of a cached prompt (a hit).

    python -m benchmarks.bench_prefill [--configs flash8] [--lengths 1024,16384] [--new 32]
        [--weights fp8] [--chunk 8192] [--reps 5] [--vary] [--c128-pool loop,kernel]
        [--extend-graphs off,on] [--census N] [--device cuda]

What a server's time to first token is made of, SGLang's scheduler left out. Per config x length:
``cold``: the whole prompt through ``V4Model.forward`` over the serving cache
(``srt.state.SglangV4Cache``), in chunks of ``--chunk`` tokens (SGLang's chunked prefill), then
the head on its last position; ``hit``: a new request resuming from that prompt's snapshot
(``bind`` restores it) with ``--new`` tokens, and the head on its last position. Each case runs
once untimed (compiles for its shapes), then ``--reps`` times with the device drained around each.
Columns: median ms; the graphs Dynamo compiled during the timed runs (0 unless a run's shapes
recompile the fused regions); on a GPU kernel launches, host syncs and GPU busy % per prefill
(torch profiler, as ``bench_decode``). ``--vary``: each timed run one token shorter (cold) or
longer (hit) than the one before, as a server's requests are: whether new lengths recompile.
``--c128-pool loop,kernel``: each case with the ratio-128 pooling's torch loop (a fused region
per position) and with its one-launch kernel (``kernels.c128_pool``), side by side on one model;
``--extend-graphs off,on``: without and with CUDA graphs of short extends
(``core.extend_graphs``: a hit's 32 tokens, and prompts of < 1024), side by side.
``--census N``: after each case's timings, where one run of it goes: on a GPU its kernel launches
by the package function that issued them (``profile_decode.launch_census``); from a trace with
Python stacks, its host time by function (``profile_server.summarise``): a hit's 32 tokens spend a
few ms in kernels of a server TTFT near 80 ms (session 20), and this says which code holds the rest.
Set beside the server's TTFT (``serve_sweep --hit-lengths``), the difference is the work outside
``V4Model.forward``: SGLang's and our model class's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import torch

from benchmarks.bench_decode import bench_weights, compile_summary, make_config, profile_step
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.kernels import c128_pool
from sglang_dsv4.srt.state import SglangV4Cache

_POOL_DEFAULT = c128_pool.ENABLED


class PrefillCase:
    """One prefill case on one cache; ``step()`` runs it once (a new request each time)."""

    def __init__(self, model: V4Model, cache: SglangV4Cache, kind: str, length: int, new: int, chunk: int,
                 base_slots: torch.Tensor, gen: torch.Generator, extra: int = 0):
        self.model, self.cache, self.chunk = model, cache, chunk
        dev = cache.device
        vocab = model.cfg.vocab_size
        if kind == "cold":
            self.row, self.start = 1, 0
            self.cache.req_to_token[1, :length] = base_slots + length  # slots of its own, reused each run
            self.ids = torch.randint(0, vocab, (length,), generator=gen).to(dev)
        else:
            self.row, self.start = 2, length
            self.cache.req_to_token[2, :length] = base_slots  # the cached prompt's slots (row 0's)
            self.cache.req_to_token[2, length:length + new + extra] = torch.arange(
                2 * length + 1, 2 * length + 1 + new + extra, dtype=torch.int32, device=dev)
            self.ids = torch.randint(0, vocab, (new + extra,), generator=gen).to(dev)
        self.count = new if kind == "hit" else length  # tokens the next run computes
        self.own = self.cache.req_to_token[self.row, self.start:self.start + new + extra].clone() \
            if kind == "hit" else self.cache.req_to_token[1, :length].clone()  # the slots a run writes
        self.generation = 0
        self.last_hidden: torch.Tensor | None = None

    def step(self) -> None:
        self.generation += 1  # a new request in the row each run
        st = self.cache.bind(self.row, self.generation, self.start)
        hidden = None
        for p in range(0, self.count, self.chunk):
            ids = self.ids[p:min(p + self.chunk, self.count)]
            hidden = self.model.forward(self.cache, [st], [ids], return_hidden=True)[0]
        self.last_hidden = hidden[-1:]
        self.model.logits(self.last_hidden).argmax(-1)  # the first output token, left on the device

    def release(self) -> None:
        """What SGLang does when the request ends (untimed): its token slots and row go back, and
        with them the entry rows its run filed. Without it every run files new rows under the
        same slots (the old ones pending as orphans), the pools grow, and each growth drops the
        graphs that read them: a run then recaptures (the profiled cold 512-token run with
        extend graphs counted ~1000 launches and 2.5 syncs on the H100, 2026-12-05)."""
        self.cache.free_token_slots(self.own)
        self.cache.release_rows([self.row])
        self.cache.collect_pending(wait=True)  # the rows back now, not inside the next timed run


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompt_cache(model: V4Model, length: int, new: int, chunk: int, device: str,
                 gen: torch.Generator) -> tuple[SglangV4Cache, torch.Tensor, torch.Tensor]:
    """A cache holding one ``length``-token prompt (row 0, token slots 1..length), prefilled in
    chunks and snapshotted at its end, with room for a cold and a hit case beside it.
    -> (cache, the prompt's slots, its ids)."""
    cache = SglangV4Cache.with_own_table(model.cfg, 3, 2 * length + new + 64, max_seq_len=length + new + 8,
                                         device=device)  # new: the hit's tokens, and --vary's extra
    base = torch.arange(1, length + 1, dtype=torch.int32, device=device)
    cache.req_to_token[0, :length] = base
    origin = cache.bind(0, 1, 0)
    ids = torch.randint(0, model.cfg.vocab_size, (length,), generator=gen).to(device)
    for p in range(0, length, chunk):
        model.forward(cache, [origin], [ids[p:p + chunk]], return_hidden=True)
    cache.take_snapshot(origin)
    return cache, base, ids


def census_lines(case: PrefillCase, top: int) -> list[str]:
    """Markdown lines: one run of ``case`` by launch site (GPU), then its host time by Python
    function, from a profiler trace with Python stacks."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profile_server import summarise

    lines, activities = [], [ProfilerActivity.CPU]
    gpu = torch.device(case.cache.device).type == "cuda"
    if gpu:
        from benchmarks.profile_decode import launch_census

        launches, sites = launch_census(case)
        lines = [f"launches by call site ({launches} in one run; kernel ms = their GPU time):",
                 "| launches | kernel ms | where (innermost <- caller) |", "|---|---|---|"]
        lines += [f"| {n} | {ms:.3f} | {site} |" for site, n, ms in sites[:top]] + [""]
        activities.append(ProfilerActivity.CUDA)
    sync(str(case.cache.device))
    with profile(activities=activities, with_stack=True) as prof:
        case.step()
        sync(str(case.cache.device))
    fd, trace = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(trace)
        lines += summarise(trace, top, thread="bench_prefill.py")
    finally:
        os.remove(trace)
    return lines


def run_config(name: str, weights: str, lengths: list[int], new: int, chunk: int, reps: int, device: str,
               profile: bool, vary: bool = False, census: int = 0, pools: Sequence[str] = ("loop",),
               extend_graphs: Sequence[str] = ("off",)) -> list[str]:
    from torch._dynamo.utils import counters

    from sglang_dsv4.core.extend_graphs import ExtendGraphs

    if device == "cpu" and "on" in extend_graphs:
        print("(extend graphs need a GPU: the CPU runs them off)")
        extend_graphs = ["off"]
    variants = [(p, g) for g in extend_graphs for p in pools]
    extra = len(variants) * reps + 1 if vary else 0
    cfg = make_config(name, max(lengths) + new + extra + 8)
    model = V4Model(cfg, bench_weights(cfg, device, weights))
    graphs = ExtendGraphs(model) if "on" in extend_graphs else None
    rows = []
    for length in lengths:
        gen = torch.Generator(device="cpu").manual_seed(length)
        t0 = time.perf_counter()
        cache, base, _ = prompt_cache(model, length, new + extra, chunk, device, gen)
        sync(device)
        first_s = time.perf_counter() - t0
        for kind in ("cold", "hit"):
            case = PrefillCase(model, cache, kind, length, new, chunk, base, gen, extra)
            for pool, graphed in variants:  # side by side on one model and cache
                c128_pool.ENABLED = pool == "kernel"
                model.extend_graphs = graphs if graphed == "on" else None
                case.step()  # untimed: compiles for this case's shapes
                case.release()
                times, compiled = [], counters["stats"]["unique_graphs"]
                for _ in range(reps):
                    if vary:
                        case.count += 1 if kind == "hit" else -1
                    sync(device)
                    t = time.perf_counter()
                    case.step()
                    sync(device)
                    times.append(time.perf_counter() - t)
                    case.release()
                compiled = counters["stats"]["unique_graphs"] - compiled
                stats = "| - | - | - |"
                if profile:
                    prof = profile_step(case, n=1)
                    case.release()
                    stats = f"| {prof.launches:.0f} | {prof.syncs:.1f} | {prof.busy_profiled:.0f} |"
                tokens = length if kind == "cold" else new
                label = (pool if pool == "loop" or device != "cpu" else "kernel (the loop: CPU)") + (
                    " + extend graphs" if graphed == "on" else "")
                rows.append(f"| {name} | {weights} | {label} | {kind} | {length} | {tokens}{' (varied)' if vary else ''} "
                            f"| {1e3 * statistics.median(times):.1f} | {compiled} {stats} {first_s:.1f} |")
                print(rows[-1], flush=True)
                if census:
                    print(f"\n### {name} {weights} {label} {kind} {length}\n" + "\n".join(census_lines(case, census))
                          + "\n", flush=True)
                    case.release()
    c128_pool.ENABLED = _POOL_DEFAULT
    model.extend_graphs = None
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="flash8")
    ap.add_argument("--lengths", default="1024,16384")
    ap.add_argument("--new", type=int, default=32, help="new tokens after the cached prompt (the hit)")
    ap.add_argument("--weights", default="fp8", help="bf16, fp8 and/or fp32 (bench_decode's weight modes)")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (SGLang's --chunked-prefill-size)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vary", action="store_true", help="each timed run a new length (a server's requests)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--c128-pool", default="kernel" if c128_pool.ENABLED else "loop",
                    help="the ratio-128 pooling's path(s), side by side: loop (a region per position) and/or "
                         "kernel (kernels/c128_pool.py, one launch)")
    ap.add_argument("--extend-graphs", default="off",
                    help="off and/or on: extends of < 1024 tokens (up to 8 requests) from CUDA graphs (core/extend_graphs.py)")
    ap.add_argument("--census", type=int, default=0, metavar="N",
                    help="after each case, its top N launch sites (GPU) and host functions (see the docstring)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    profile = args.device.startswith("cuda")
    header = ("| config | weights | path | case | prompt tokens | tokens computed | ms (median) | graphs compiled (timed) "
              "| kernel launches | host syncs | GPU busy % | first prefill s (compiles) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(header, flush=True)
    rows = []
    for name in args.configs.split(","):
        for weights in args.weights.split(","):
            rows += run_config(name, weights, lengths, args.new, args.chunk, args.reps, args.device, profile,
                               args.vary, args.census, args.c128_pool.split(","), args.extend_graphs.split(","))
    print(f"\n{compile_summary()}\n\n{header}\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
