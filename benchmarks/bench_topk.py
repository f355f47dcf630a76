"""The indexer's top-k at decode shapes, on the GPU: ``torch.topk`` over unique keys against the
one-launch kernel (``kernels.topk``), both its methods, at each chunk size and warp count.

    python -m benchmarks.bench_topk [--batches 1,64,256] [--entries 4096,16384] [--k 512]
        [--chunks 1024,2048,4096,8192] [--warps 4,8,16] [--reps 20] [--width 8192] [--split]

``--width W``: the score rows are W wide with ``entries`` visible, as in a step, whose entry
tables are the power of two past the longest request's entries (``step.entry_width``; a flash8
decode step at 16K context has 4097+ entries, one past a chunk of 4096). 0: rows of ``entries``.

Prints per (batch, entries) the torch path's time (``ops.select_topk_torch``, what the step ran
before the kernel), the kernel's shipped choice and its five fastest other settings, and whether
each gives the torch path's columns (it must: the same keys). Calls are captured in a CUDA graph
and replayed (a step's launches cost what they cost there). A harness: it decides
``kernels.topk``'s defaults; the package never imports it.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.bench_fp8_gemm import time_us
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import topk


def _is_shipped(method: str, chunk: int | None, warps: int | None) -> bool:
    """``select_topk_rows``' defaults: radix, its chunk (rows past it split with ``--split``), its warps."""
    return method == "radix" and chunk is None and warps is None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--entries", default="4096,16384")
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--chunks", default="1024,2048,4096,8192")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--width", type=int, default=0, help="score row width (0: the entries)")
    ap.add_argument("--split", action="store_true",
                    help="rows wider than a chunk split (kernels.topk.SPLIT, opt-in SGLANG_DSV4_TOPK_SPLIT=1): the "
                         "shipped row and the default-chunk rows time the split")
    args = ap.parse_args()
    topk.SPLIT = topk.SPLIT or args.split
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| batch | entries | path | us / call | vs torch | same columns |")
    print("|---|---|---|---|---|---|")
    for B, N in itertools.product(ints(args.batches), ints(args.entries)):
        scores = torch.randn(B, max(args.width, N), generator=g, device="cuda").relu()
        visible = torch.full((B,), N, device="cuda")
        want = ops.select_topk_torch(scores, visible, args.k)
        base = time_us(lambda: ops.select_topk_torch(scores, visible, args.k), args.reps)
        rows = []
        for method, chunk, warps in itertools.product(("bitonic", "radix"), [None] + ints(args.chunks),
                                                      [None] + ints(args.warps)):
            if chunk is not None and chunk < args.k:
                continue
            run = lambda c=chunk, w=warps, m=method: topk.select_topk_rows(scores, visible, args.k, c, w, m)  # noqa: E731
            try:
                us = time_us(run, args.reps)
                same = torch.equal(run(), want)
            except Exception as e:  # a setting that does not compile (registers, shared memory)
                print(f"<!-- {method} chunk {chunk} warps {warps}: {type(e).__name__} -->")
                continue
            rows.append((us, method, chunk, warps, same))
        shipped = [r for r in rows if _is_shipped(*r[1:4])]
        others = sorted((r for r in rows if r not in shipped), key=lambda r: r[0])[:6]
        print(f"| {B} | {N} | torch.topk over keys | {base:.1f} | 1.00x | yes |")
        for us, method, chunk, warps, same in shipped + others:
            name = ("kernel, shipped" if _is_shipped(method, chunk, warps)
                    else f"kernel {method}, chunk {chunk or 'default'}, {warps or 'default'} warps")
            print(f"| {B} | {N} | {name} | {us:.1f} | {base / us:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
