"""Tilings of the indexer-score kernel (``kernels.index_scores``) at decode shapes, on the GPU.

    python -m benchmarks.bench_index_scores [--batches 1,64,256] [--entries 4096] [--shared both]
        [--block-n 32,64,128] [--warps 4,8] [--stages 0,2,3] [--waves 1,2,4,8] [--reps 20]

One decode token per request, V4-Flash's indexer (64 heads of 128, keys in pages of 64 rows),
``--entries`` C4 entries per request (4096 at a 16K context). ``--shared``: ``distinct`` gives each
request its own key rows (a server's batch: the bytes come from HBM), ``shared`` one set of rows
for all (``bench_decode``'s requests, which resume from one snapshot: the rows sit in the L2),
``both``. Prints per case the shipped tiling's time and the five fastest others, the key bytes
the kernel must read over the copy bandwidth of this run (its roofline; shared rows count once),
and whether each result has the shipped result's bits. Calls are captured in a CUDA graph and
replayed. A harness: what it shows decides ``index_scores``'s defaults; the package never imports it.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.bench_decode import copy_bandwidth
from benchmarks.bench_fp8_gemm import time_us
from sglang_dsv4.kernels.index_scores import BLOCK_N, PROGRAM_WAVES, paged_index_scores
from sglang_dsv4.kernels.kv_layout import IndexFp8Rows
from sglang_dsv4.quant import fp4_qat, hadamard

HI, DI, PAGE = 64, 128, 64


def make_case(B: int, N: int, shared: bool, g: torch.Generator):
    """(qi, head weights, page buffer, layout, table, tok_req, unique key rows) on the GPU."""
    lay = IndexFp8Rows(PAGE, DI)
    rows_needed = N if shared else B * N
    pages = -(-rows_needed // PAGE) + 1
    buf = lay.alloc_pool(pages, device="cuda")
    rows = torch.randperm(pages * PAGE, generator=g, device="cuda")[:rows_needed]
    keys = fp4_qat(hadamard(torch.randn(rows_needed, DI, generator=g, device="cuda")), 32)
    lay.write(buf, rows, keys)
    table = (rows.view(1, N).expand(B, N) if shared else rows.view(B, N)).int().contiguous()
    tok_req = torch.arange(B, device="cuda")
    qi = fp4_qat(hadamard(torch.randn(B, HI, DI, generator=g, device="cuda")), 32)
    hw = torch.randn(B, HI, generator=g, device="cuda")
    return qi, hw, buf, lay, table, tok_req, rows_needed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--entries", type=int, default=4096)
    ap.add_argument("--shared", default="both", choices=["both", "shared", "distinct"])
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="0,2,3", help="num_stages; 0: Triton's default")
    ap.add_argument("--waves", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    bw = copy_bandwidth("cuda") / 2  # bytes read per second (the copy reads and writes each byte)
    print(f"copy bandwidth {2 * bw / 1e9:.0f} GB/s (read + write)")
    shipped = (BLOCK_N, 4, 0, PROGRAM_WAVES)
    grid = list(itertools.product(ints(args.block_n), ints(args.warps), ints(args.stages), ints(args.waves)))
    if shipped not in grid:
        grid.insert(0, shipped)
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| batch | keys | tiling (block_n, warps, stages, waves) | us / call | x roofline | same bits |")
    print("|---|---|---|---|---|---|")
    modes = ["shared", "distinct"] if args.shared == "both" else [args.shared]
    for B in ints(args.batches):
        for mode in modes:
            qi, hw, buf, lay, table, tok_req, unique = make_case(B, args.entries, mode == "shared", g)
            roof_us = unique * lay.page_bytes / PAGE / bw * 1e6

            def run(t):
                bn, nw, ns, wv = t
                return paged_index_scores(qi, hw, buf, lay, table, tok_req, block_n=bn, waves=wv,
                                          num_warps=nw, num_stages=ns or None)

            want = run(shipped)
            results = []
            for t in grid:
                try:
                    us = time_us(lambda t=t: run(t), args.reps)
                    same = torch.equal(run(t), want)
                except Exception as e:  # a tiling that does not compile (shared memory): skipped
                    print(f"<!-- {t}: {type(e).__name__} -->")
                    continue
                results.append((us, t, same))
            base = next(r for r in results if r[1] == shipped)
            rows = [base] + sorted((r for r in results if r[1] != shipped), key=lambda r: r[0])[:5]
            for us, t, same in rows:
                tag = " (shipped)" if t == shipped else ""
                print(f"| {B} | {mode} | {t}{tag} | {us:.1f} | {us / roof_us:.1f}x | {'yes' if same else 'no'} |")
            del qi, hw, buf, table


if __name__ == "__main__":
    main()
