"""How many kernels a GPU decode step launches outside the fused regions, by call site, and how
many traced graphs its fused regions run, counted on the CPU (no device time needed).

    python -m benchmarks.count_step_ops [--config tiny] [--batch 1] [--context 600] [--top 30]
        [--weights bf16|fp8] [--regions] [--new N]

On a GPU each torch op outside a ``core.compiled.on_gpu`` function is (at least) one kernel; the
functions themselves become a few Inductor kernels each, GEMMs stay cuBLAS / Triton, FlashMLA is
one kernel per call. This runs one decode step of the GPU's code path on the CPU (the serving
cache with the FlashMLA layout and its torch reference kernels; the CPU-only padding switched
off: no row tiles, GPU entry-table widths) under a dispatch mode, and prints the ops outside the
fused regions per source function, not counting views, allocations, the reference attention
kernels, the CPU's loop over experts (grouped GEMMs on a GPU) and the host-side step building. A proxy to plan kernel work with; the profiler on the
GPU (``profile_decode.py``) gives the real count.

``--regions`` instead traces every ``on_gpu`` function with ``torch.compile`` as the GPU does
(Dynamo, with a backend that runs each traced graph eagerly and counts it) and prints, per
function, its calls in the step and the graphs they ran, then the graph breaks' reasons. A graph
break splits a region: on the GPU each piece is at least one kernel of its own, and nothing
fuses across the break (session 16's census: the split-K sum after a broken ``fp8_linear``).
``--weights fp8`` runs the fp8 weight mode (the GPU benchmarks' ``--weights fp8``). ``--new N``:
each request brings N tokens (a cache hit's extend) instead of one.
"""

from __future__ import annotations

import argparse
import collections
import re
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_decode import bench_weights, make_config
from sglang_dsv4.core import compiled, ops
from sglang_dsv4.core import model as model_mod
from sglang_dsv4.core import step as step_mod
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.kernels import fp8_linear, fp8_moe, kv_layout, sparse_mla
from sglang_dsv4.srt import state as state_mod
from sglang_dsv4.srt.state import SglangV4Cache

FREE = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "t", "transpose", "permute", "slice", "select",
        "as_strided", "detach", "alias", "unbind", "split", "split_with_sizes", "reshape", "flatten", "unflatten",
        "_reshape_alias", "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided"}
HOST = {"build_step", "_c128_segments", "_pad_segments", "stage", "plan_tables", "completing_tokens", "<genexpr>",
        "<dictcomp>", "<listcomp>"}  # step building: host tensors on a GPU too
CPU_ONLY = {"_sorted_experts"}  # the CPU's loop over experts (grouped GEMMs on a GPU)
# the modules with on_gpu functions
REGION_MODULES = (ops, model_mod, kv_layout, sparse_mla, state_mod, fp8_linear, fp8_moe)


def wrap_regions(wrap) -> None:
    """Replace every ``on_gpu`` function of ``REGION_MODULES`` by ``wrap(fn)`` (which keeps ``.eager``)."""
    for module in REGION_MODULES:
        for name in dir(module):
            fn = getattr(module, name)
            if callable(fn) and hasattr(fn, "eager"):
                setattr(module, name, wrap(fn))


def device_op(stack) -> bool:
    """Whether an op called from ``stack`` is the step's device work on a GPU: called from the
    package, not from the torch reference kernels, the host-side step building or the CPU's own
    loop over experts. (``Branches.run`` runs its parts in a list comprehension on the CPU: not
    host work.)"""
    frames = [fr for fr in stack if "sglang_dsv4" in fr.filename and not fr.filename.endswith("core/branches.py")]
    return bool(frames) and not any("torch_ref" in fr.filename or fr.name in HOST | CPU_ONLY for fr in frames)


class FusedRegions:
    """Marks the calls of ``ops``' ``on_gpu`` functions (compiled on a GPU)."""

    def __init__(self):
        self.depth = 0

    def wrap(self, fn):
        def inside(*a, **k):
            self.depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
        inside.eager = fn.eager
        return inside


class OpCensus(TorchDispatchMode):
    """Counts ops outside fused regions by (innermost sglang_dsv4 function, op)."""

    def __init__(self, regions: FusedRegions):
        super().__init__()
        self.regions, self.counts = regions, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.regions.depth or name in FREE:
            return out
        stack = traceback.extract_stack()[:-1]
        if not device_op(stack):
            return out
        site = [fr for fr in stack if "sglang_dsv4" in fr.filename][-1]
        self.counts[f"{site.filename.split('sglang_dsv4/')[-1]}:{site.name}"] += 1
        return out


class RegionGraphs:
    """Compiles each ``on_gpu`` function (``--regions``) with a backend that counts the traced
    graphs each call runs; a region called from inside another is traced into it, as on_gpu does."""

    def __init__(self):
        self.calls, self.graphs = collections.Counter(), collections.Counter()
        self._compiled: dict[str, object] = {}

    def _backend(self, name: str):
        def backend(gm: torch.fx.GraphModule, example_inputs):
            def run(*args):
                self.graphs[name] += 1
                return gm.forward(*args)
            return run
        return backend

    def wrap(self, fn):
        name = fn.eager.__qualname__

        def inside(*a, **k):
            if torch.compiler.is_compiling() or any(fr.name in CPU_ONLY for fr in traceback.extract_stack()):
                return fn.eager(*a, **k)  # traced into its caller / the CPU's own loop over experts
            self.calls[name] += 1
            if name not in self._compiled:
                self._compiled[name] = torch.compile(fn.eager, backend=self._backend(name))
            return self._compiled[name](*a, **k)
        inside.eager = fn.eager
        return inside

    def reset(self) -> None:
        self.calls.clear()
        self.graphs.clear()
        torch._dynamo.utils.counters["graph_break"].clear()


def gpu_code_path() -> None:
    """Switch off the CPU-only padding, so that the CPU runs the GPU's step shapes."""
    cpu_width = step_mod.entry_width

    def gpu_width(needed: int, max_entries: int, device) -> int:  # the GPU's entry-table widths
        return cpu_width(needed, max_entries, torch.device("cuda"))

    step_mod.entry_width = state_mod.entry_width = gpu_width
    V4Model._pad = lambda self, cache, step: step
    ops.pad_rows = lambda x, tile=ops.CPU_ROW_TILE: x
    ops.CPU_ROW_TILE = 0  # one GEMM per linear, as on the GPU


def decode_step(config: str, B: int, ctx: int, weights: str, new: int = 1):
    """(model, cache, request states, token ids) of one decode step: B requests resuming from a
    snapshot of one ``ctx``-token prompt (its prefill runs here), one new token each; with
    ``new`` > 1, ``new`` tokens each (B cache hits' extends)."""
    cfg = make_config(config, ctx + new + 64)
    model = V4Model(cfg, bench_weights(cfg, "cpu", weights))
    L = ctx + new + 8
    cache = SglangV4Cache.with_own_table(cfg, B + 1, (B + 1) * L, max_seq_len=L, device="cpu", backend="torch-fp8")
    cache.req_to_token[0, :ctx] = torch.arange(1, ctx + 1, dtype=torch.int32)
    prompt = cache.bind(0, 1, 0)
    model.forward(cache, [prompt], [torch.randint(0, cfg.vocab_size, (ctx,))])
    cache.take_snapshot(prompt)
    states = []
    for b in range(1, B + 1):  # B requests sharing the prompt, ``new`` tokens each
        cache.req_to_token[b, :ctx] = cache.req_to_token[0, :ctx]
        cache.req_to_token[b, ctx:ctx + new] = torch.arange(ctx + 1 + (b - 1) * new, ctx + 1 + b * new,
                                                            dtype=torch.int32)
        states.append(cache.bind(b, 1, ctx))
    ids = [torch.randint(0, cfg.vocab_size, (new,)) for _ in range(B)]
    return model, cache, states, ids


def region_census(args) -> None:
    """``--regions``: the fused regions' calls and traced graphs in one decode step."""
    regions = RegionGraphs()
    wrap_regions(regions.wrap)
    gpu_code_path()
    # every region traces once per shape family and argument variant, as on the GPU (core.compiled)
    with torch._dynamo.config.patch(recompile_limit=compiled.RECOMPILE_LIMIT,
                                    accumulated_recompile_limit=16 * compiled.RECOMPILE_LIMIT):
        model, cache, states, ids = decode_step(args.config, args.batch, args.context, args.weights, args.new)
        regions.reset()
        model.forward(cache, states, ids, flat=True)
    calls, graphs = sum(regions.calls.values()), sum(regions.graphs.values())
    cfg = model.cfg
    print(f"{args.config}: {cfg.num_hidden_layers} layers, batch {args.batch}, context {args.context}, "
          f"{args.new} new token(s) each, {args.weights} weights: {calls} fused-region calls ran {graphs} traced "
          f"graphs in one step "
          f"({graphs - calls:+d} against one a call: a graph break adds one, a region left all eager by "
          f"one, e.g. a lone kernel launch, runs none)")
    print("\n| calls | graphs | region |\n|---|---|---|")
    for name, n in sorted(regions.calls.items(), key=lambda kv: (-regions.graphs[kv[0]], kv[0]))[:args.top]:
        print(f"| {n} | {regions.graphs[name]} | {name} |")
    breaks = torch._dynamo.utils.counters["graph_break"]
    print("\n| graph breaks (while tracing the step's variants) | reason |\n|---|---|")
    for reason, n in breaks.most_common(args.top):
        print(f"| {n} | {re.sub(r' at 0x[0-9a-f]+', '', ' '.join(reason.split()))[:200]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny", help="a preset or a bench_decode config (flash8 needs ~20 GB)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--weights", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--regions", action="store_true", help="count the fused regions' traced graphs instead")
    ap.add_argument("--new", type=int, default=1, help="new tokens per request (> 1: cache hits' extends)")
    args = ap.parse_args()
    if args.regions:
        return region_census(args)
    regions = FusedRegions()
    wrap_regions(regions.wrap)
    gpu_code_path()
    B, ctx = args.batch, args.context
    model, cache, states, ids = decode_step(args.config, B, ctx, args.weights, args.new)
    cfg = model.cfg
    decode_calls = 0
    decode = sparse_mla.SparseMLABackend._decode

    def counted_decode(self, b):  # which attention path the step took (the GPU's: the decode kernel)
        nonlocal decode_calls
        decode_calls += 1
        return decode(self, b)

    sparse_mla.SparseMLABackend._decode = counted_decode
    census = OpCensus(regions)
    with census:
        model.forward(cache, states, ids, flat=True)
    total = sum(census.counts.values())
    print(f"{args.config}: {cfg.num_hidden_layers} layers (ratios {list(cfg.compress_ratios)}), batch {B}, "
          f"context {ctx}, {args.new} new token(s) each: {total} ops outside the fused regions in one step")
    print(f"layers through the decode kernel's path: {decode_calls}")
    print("\n| ops | where |\n|---|---|")
    for site, n in census.counts.most_common(args.top):
        print(f"| {n} | {site} |")


if __name__ == "__main__":
    main()
