"""A ratio-4 compressor's entries at decode shapes on the GPU: the compiled torch region
(``ops.c4_entries_torch``, what the step ran before session 35) against the two-launch Triton kernels
(``kernels.c4_entries``, the default since session 35), V4-Flash widths, quantisation
simulated, side by side.

    python -m benchmarks.bench_c4_entries [--batches 1,16,64,256] [--reps 50] [--warps 4,8]

Per batch and compressor (main d 512, indexer d 128): microseconds per call of each path (calls
captured in a CUDA graph and replayed, as in a graphed step, ``bench_fp8_gemm.time_us``), kernel
launches per call (torch profiler), the kernel's speed-up, the largest entry difference relative
to its row's scale and how many fp8 / fp4 codes differ (boundary cases: the paths' exp and rsqrt
round apart). ``--warps``: the kernel also at these warp counts. One decode token per request at a
random position past its first window. A harness: it decides the switch's default; the package
never imports it.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_fp8_gemm import time_us
from benchmarks.bench_hc_pre import _launches
from sglang_dsv4.core import ops
from sglang_dsv4.core.model import _c4_window_rows_of
from sglang_dsv4.kernels import c4_entries as kernel
from sglang_dsv4.tiny import preset_config


def _decode_step(B: int, kind: str, g: torch.Generator):
    """``ops.c4_entries``' arguments for a decode step of B requests (one token each) in one C4
    layer of flash43 (the states are [slots + scratch, C4 layers, 8, 2d] viewed at one)."""
    cfg = preset_config("flash43")
    d = cfg.head_dim if kind == "main" else cfg.index_head_dim
    prefix = "attn.compressor" if kind == "main" else "attn.indexer.compressor"
    positions = torch.randint(8, 16384, (B,), generator=g, device="cuda")
    tok_req = torch.arange(B, device="cuda")
    ones = torch.ones(B, dtype=torch.long, device="cuda")
    slots = torch.randperm(B, generator=g, device="cuda")
    idx, dst = _c4_window_rows_of(positions, tok_req, positions, positions + ones, tok_req, slots, B)
    rope = ops.rope_at(positions - 3, ops.layer_inv_freqs(cfg, 4, "cuda"))
    a = torch.randn(B, 2 * d, generator=g, device="cuda")
    s = torch.randn(B, 2 * d, generator=g, device="cuda")
    n4 = len(cfg.c4_layers)
    state_a = torch.randn(B + 1, n4, 8, 2 * d, generator=g, device="cuda")[:, n4 // 2]
    state_s = torch.randn(B + 1, n4, 8, 2 * d, generator=g, device="cuda")[:, n4 // 2]
    w = {f"{prefix}.norm.weight": torch.rand(d, generator=g, device="cuda") + 0.5}
    return cfg, (a, s, state_a, state_s, slots, idx, dst, w, prefix, rope, cfg, kind == "index", True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warps", default="", help="the kernel also at these warp counts (e.g. 2,4,8,16)")
    args = ap.parse_args()
    kernel.ENABLED = True  # the harness times it whatever the environment says
    g = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name())
    print("| batch | compressor | torch region us | launches | kernel us | launches | speed-up | max diff "
          "| codes apart |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B in [int(b) for b in args.batches.split(",")]:
        for kind in ("main", "index"):
            cfg, call = _decode_step(B, kind, g)
            a, s, state_a, state_s, slots, idx, dst, w, prefix, rope = call[:10]
            if not kernel.supported(a, s, state_a, state_s, idx, rope, cfg, kind == "index"):
                raise SystemExit("c4_entries: the kernel does not take these operands")

            def region():
                return ops.c4_entries_torch(*call)

            def launch(warps=None):
                return kernel.c4_entries(a, s, state_a, state_s, slots, idx, dst, w[f"{prefix}.norm.weight"], rope,
                                         cfg, kind == "index", True, num_warps=warps)

            want = ops.c4_entries_torch(a, s, state_a.clone(), state_s.clone(), *call[4:])
            got = launch()
            coded = want.shape[1] if kind == "index" else cfg.nope_head_dim
            diff = float(((got - want).abs() / want.abs().amax(-1, keepdim=True)).max())
            apart = int((got[:, :coded] != want[:, :coded]).sum())
            t_region, t_kernel = time_us(region, args.reps), time_us(launch, args.reps)
            print(f"| {B} | {kind} | {t_region:.1f} | {_launches(region)} | {t_kernel:.1f} | {_launches(launch)} | "
                  f"{t_region / t_kernel:.2f}x | {diff:.1e} | {apart} of {got[:, :coded].numel()} |")
            for warps in [int(v) for v in args.warps.split(",") if v]:
                us = time_us(lambda: launch(warps), args.reps)
                print(f"| {B} | {kind}, {warps} warps | | | {us:.1f} | | {t_region / us:.2f}x | | |")


if __name__ == "__main__":
    main()
