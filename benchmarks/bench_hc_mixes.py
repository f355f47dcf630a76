"""The hyper-connection mixes' GEMM at decode shapes, on the GPU: one GEMM against split-K.

    python -m benchmarks.bench_hc_mixes [--tokens 1,64,256] [--splits 1,8,16,32,64,128] [--reps 50]

``ops.hc_mixes`` is (x @ fn^T) * rsqrt(mean(x^2) + eps) over each token's flattened streams, at
V4-Flash width a [T, 16384] x [16384, 24] fp32 product, 17 calls a step. Prints per token count
the time of: the product as one GEMM (``ops.linear``, cuBLAS), as ``ops.split_k_dots`` at each
split count, ``ops.hc_mixes`` as the step runs it (compiled, ``ops.mixes_splits``'s choice), and a
copy of x (the bytes it must read, at the copy bandwidth of this run); each case's largest
relative difference from float64 dots. Calls are captured in a CUDA graph and replayed (no host
launch cost), x is rotated through copies larger than the L2, as the layers of a step are. A
harness: what it shows decides ``ops.MIXES_CHUNK``; nothing here is imported by the package.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_fp8_gemm import L2_BYTES, time_us
from sglang_dsv4.config import V4Config
from sglang_dsv4.core import ops

HC, DIM, N = 4, 4096, 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,64,256")
    ap.add_argument("--splits", default="1,8,16,32,64,128")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    cfg = V4Config.from_dict(dict(hidden_size=DIM, hc_mult=HC))
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(N, HC * DIM, generator=g, device="cuda") * 0.01
    K = HC * DIM
    print(f"| tokens | case | us / call | GB/s of x | x bytes / copy | max rel diff vs float64 |")
    print("|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        copies = max(2, -(-2 * L2_BYTES // (T * K * 4)))
        hs = [torch.randn(T, HC, DIM, generator=g, device="cuda") for _ in range(copies)]
        ref = [(h.flatten(1).double() @ fn.double().t()) for h in hs]
        it = {"i": 0}

        def nxt() -> torch.Tensor:
            it["i"] = (it["i"] + 1) % copies
            return hs[it["i"]]

        out = torch.empty(T, K, device="cuda")
        copy_us = time_us(lambda: out.copy_(nxt().flatten(1)), args.reps)
        rows = [("copy of x", copy_us, None)]
        for s in (int(s) for s in args.splits.split(",")):
            if K % s:
                continue
            f = (lambda: ops.linear(nxt().flatten(1), fn)) if s == 1 else (lambda s=s: ops.split_k_dots(nxt().flatten(1), fn, s))
            us = time_us(f, args.reps)
            err = max(((f_(h) - r).abs().max() / r.abs().max()).item()
                      for h, r in zip(hs[:2], ref[:2])
                      for f_ in [(lambda h: ops.linear(h.flatten(1), fn)) if s == 1 else (lambda h, s=s: ops.split_k_dots(h.flatten(1), fn, s))])
            rows.append((f"dots, {'one GEMM' if s == 1 else f'split-K {s}'}", us, err))
        us = time_us(lambda: ops.hc_mixes(nxt(), fn, cfg), args.reps)
        rows.append((f"ops.hc_mixes (compiled, {ops.mixes_splits(K)} splits)", us, None))
        for name, us, err in rows:
            gbs = T * K * 4 / us / 1e3
            e = "" if err is None else f"{err:.1e}"
            print(f"| {T} | {name} | {us:.1f} | {gbs:.0f} | {us / copy_us:.1f}x | {e} |")


if __name__ == "__main__":
    main()
