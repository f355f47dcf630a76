"""Decode-sized kernels run alone, for Nsight Compute: what keeps a kernel from its bytes.

    python -m benchmarks.ncu_kernels --cases dense:wo_b:64,wo_a:64,experts:8:64 [--calls 2]
    (on the device: NCU_CASES='...' bash scripts/gpu_decode_check.sh, which wraps it in ncu)

Each case builds V4-Flash-dimension operands (``bench_fp8_gemm``'s), calls its kernels once to
compile them, then ``--calls`` times inside an NVTX range named ``ncu`` (``ncu --nvtx
--nvtx-include ncu/`` profiles those launches only) and prints, in launch order, the case and the
bytes its weights hold, so that ncu's report lines up with the cases:

- ``dense:NAME:M``: the fp8 block GEMM (Triton, not cuBLAS) of ``bench_fp8_gemm.DENSE[NAME]`` over
  M rows (its split-K sum kernel too where K is split);
- ``experts:E:T``: the routed experts' two grouped GEMMs for T tokens over E experts (random
  routing, the shipped rows per block, their fp32 partials as the model takes them);
- ``wo_a:T``: the weight-only fp8 wo_a (``kernels.fp8_weight_only``) over T tokens.

A harness for the profiler; the package never imports it.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from benchmarks.bench_fp8_gemm import DENSE, WO_A, grouped_cases, random_fp8
from sglang_dsv4.kernels import fp8_cublas
from sglang_dsv4.kernels import fp8_weight_only as weight_only
from sglang_dsv4.kernels.fp8_linear import fp8_gemm, quantize_act


def build(case: str, g: torch.Generator) -> tuple[Callable[[], object], int]:
    """(a call of the case's kernels, the bytes its weights hold)."""
    kind, *args = case.split(":")
    if kind == "dense" and len(args) == 2 and args[0] in DENSE:
        n, k = DENSE[args[0]]
        w = random_fp8((n, k), g)
        xq, xs = quantize_act(torch.randn(int(args[1]), k, generator=g, device="cuda", dtype=torch.bfloat16))
        return (lambda: fp8_gemm(xq, xs, w, torch.bfloat16, cublas=False)), n * k
    if kind == "experts" and len(args) == 2:
        (_, _, w13_bytes, w13, _, _, _), (_, _, w2_bytes, w2, _, _, _) = grouped_cases([int(args[1])], [int(args[0])], g)
        return (lambda: (w13(None), w2(None))), w13_bytes + w2_bytes
    if kind == "wo_a" and len(args) == 1:
        G, R, K = WO_A
        w = random_fp8((G * R, K), g)
        x = torch.randn(int(args[0]), G, K, generator=g, device="cuda", dtype=torch.bfloat16)
        return (lambda: weight_only.grouped_weight_only(x, w)), G * R * K
    raise SystemExit(f"--cases: unknown case {case!r} (dense:NAME:M with NAME in {', '.join(DENSE)}, "
                     "experts:E:T, wo_a:T)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", required=True, help="comma-separated cases (module docstring)")
    ap.add_argument("--calls", type=int, default=2, help="profiled calls of each case")
    args = ap.parse_args()
    fp8_cublas.REQUESTED = False  # the Triton kernels are the question
    g = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        fn, nbytes = build(case, g)
        fn()  # compiles outside the profiled range
        torch.cuda.synchronize()
        print(f"case {case}: weights {nbytes / 2**20:.1f} MiB, {args.calls} calls profiled", flush=True)
        torch.cuda.nvtx.range_push("ncu")
        for _ in range(args.calls):
            fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
