"""The fp8 routed experts' row layout at decode shapes, on the GPU: the fused torch region
(``fp8_moe._row_layout``, what the step ran before) against the one-launch kernel
(``kernels.moe_layout``).

    python -m benchmarks.bench_moe_layout [--batches 1,64,256] [--experts 32,8,256] [--reps 50]

Calls are captured in a CUDA graph and replayed (a decode step's launches cost what they cost
there); the table gives the time per call, the ratio and whether the kernel's layout equals the
region's (it must). A harness: the package never imports it.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.bench_fp8_gemm import time_us
from sglang_dsv4.kernels import fp8_moe, moe_layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--experts", default="32,8,256")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| batch | experts | fused torch region us | kernel us | region / kernel | same layout |")
    print("|---|---|---|---|---|---|")
    for T, E in itertools.product(ints(args.batches), ints(args.experts)):
        chosen = torch.rand(T, E, generator=g, device="cuda").argsort(1)[:, :min(args.k, E)].int()
        gates = torch.rand(chosen.shape, generator=g, device="cuda")
        A, M = fp8_moe.grouped_rows(chosen.numel(), E)
        region = lambda: fp8_moe._row_layout(chosen, gates, 0, E, A, M)  # noqa: E731
        kernel = lambda: moe_layout.row_layout(chosen, gates, 0, E, A, M)  # noqa: E731
        same = all(torch.equal(a, b) for a, b in zip(region(), kernel()))
        t_region, t_kernel = time_us(region, args.reps), time_us(kernel, args.reps)
        print(f"| {T} | {E} | {t_region:.1f} | {t_kernel:.1f} | {t_region / t_kernel:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
