"""How many kernels a GPU decode step launches outside the fused regions, by call site, counted
on the CPU (no device time needed).

    python -m benchmarks.count_step_ops [--config tiny] [--batch 1] [--context 600] [--top 30]

On a GPU each torch op outside a ``core.compiled.on_gpu`` function is (at least) one kernel; the
functions themselves become a few Inductor kernels each, GEMMs stay cuBLAS / Triton, FlashMLA is
one kernel per call. This runs one decode step of the GPU's code path on the CPU (the serving
cache with the FlashMLA layout and its torch reference kernels; the CPU-only padding switched
off: no row tiles, GPU entry-table widths) under a dispatch mode, and prints the ops outside the
fused regions per source function, not counting views, allocations, the reference attention
kernels, the CPU's loop over experts (grouped GEMMs on a GPU) and the host-side step building. A proxy to plan kernel work with; the profiler on the
GPU (``profile_decode.py``) gives the real count.
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_decode import make_config, random_weights
from sglang_dsv4.core import ops
from sglang_dsv4.core import model as model_mod
from sglang_dsv4.core import step as step_mod
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.kernels import kv_layout, sparse_mla
from sglang_dsv4.srt import state as state_mod
from sglang_dsv4.srt.state import SglangV4Cache

FREE = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "t", "transpose", "permute", "slice", "select",
        "as_strided", "detach", "alias", "unbind", "split", "split_with_sizes", "reshape", "flatten", "unflatten",
        "_reshape_alias", "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided"}
HOST = {"build_step", "_c128_segments", "_pad_segments", "stage", "plan_tables", "completing_tokens", "<genexpr>",
        "<dictcomp>", "<listcomp>"}  # step building: host tensors on a GPU too
CPU_ONLY = {"_sorted_experts"}  # the CPU's loop over experts (grouped GEMMs on a GPU)


class FusedRegions:
    """Marks the calls of ``ops``' ``on_gpu`` functions (compiled on a GPU)."""

    def __init__(self):
        self.depth = 0

    def wrap_all(self, module) -> None:
        for name in dir(module):
            fn = getattr(module, name)
            if callable(fn) and hasattr(fn, "eager"):
                setattr(module, name, self._wrap(fn))

    def _wrap(self, fn):
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
        frames = [fr for fr in traceback.extract_stack()[:-1] if "sglang_dsv4" in fr.filename]
        if not frames or any("torch_ref" in fr.filename or fr.name in HOST | CPU_ONLY for fr in frames):
            return out
        self.counts[f"{frames[-1].filename.split('sglang_dsv4/')[-1]}:{frames[-1].name}"] += 1
        return out


def gpu_code_path() -> None:
    """Switch off the CPU-only padding, so that the CPU runs the GPU's step shapes."""
    cpu_width = step_mod.entry_width

    def gpu_width(needed: int, max_entries: int, device) -> int:  # the GPU's entry-table widths
        return cpu_width(needed, max_entries, torch.device("cuda"))

    step_mod.entry_width = state_mod.entry_width = gpu_width
    V4Model._pad = lambda self, cache, step: step
    ops.pad_rows = lambda x, tile=ops.CPU_ROW_TILE: x
    ops.CPU_ROW_TILE = 0  # one GEMM per linear, as on the GPU


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny", help="a preset or a bench_decode config (flash8 needs ~20 GB)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    regions = FusedRegions()
    for module in (ops, model_mod, kv_layout, sparse_mla, state_mod):  # the modules with on_gpu functions
        regions.wrap_all(module)
    gpu_code_path()
    B, ctx = args.batch, args.context
    cfg = make_config(args.config, ctx + 64)
    model = V4Model(cfg, random_weights(cfg, "cpu", torch.bfloat16))
    L = ctx + 8
    cache = SglangV4Cache.with_own_table(cfg, B + 1, (B + 1) * L, max_seq_len=L, device="cpu", backend="torch-fp8")
    cache.req_to_token[0, :ctx] = torch.arange(1, ctx + 1, dtype=torch.int32)
    prompt = cache.bind(0, 1, 0)
    model.forward(cache, [prompt], [torch.randint(0, cfg.vocab_size, (ctx,))])
    cache.take_snapshot(prompt)
    states = []
    for b in range(1, B + 1):  # B requests sharing the prompt, one new token each
        cache.req_to_token[b, :ctx] = cache.req_to_token[0, :ctx]
        cache.req_to_token[b, ctx] = ctx + b
        states.append(cache.bind(b, 1, ctx))
    ids = [torch.randint(0, cfg.vocab_size, (1,)) for _ in range(B)]
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
          f"context {ctx}: {total} ops outside the fused regions in one decode step")
    print(f"layers through the decode kernel's path: {decode_calls}")
    print("\n| ops | where |\n|---|---|")
    for site, n in census.counts.most_common(args.top):
        print(f"| {n} | {site} |")


if __name__ == "__main__":
    main()
