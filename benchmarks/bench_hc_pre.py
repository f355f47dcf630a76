"""A hyper-connection ``hc_pre`` on the GPU at V4-Flash width: the default path against SGLang's
fused mixes (``kernels.hc_split.hc_pre_split``, on by default, ``SGLANG_DSV4_HC_FUSED_PRE=0`` off), side by side.

    python -m benchmarks.bench_hc_pre [--batches 1,16,64,256] [--dim 4096] [--reps 50]

Per batch: microseconds per call of each path (calls captured in a CUDA graph and replayed, as in
a graphed step, ``bench_fp8_gemm.time_us``), kernel launches per call (torch profiler), the
fused path's speed-up, the largest difference of pre / post / comb between the paths, and
whether a row's fused result is the same bits alone as in the batch. The bytes a call must read
(the streams in float32 and the mixing matrix) over the copy bandwidth measured in the same run
give its floor. A harness: it decides the switch's default; the package never imports it.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_decode import copy_bandwidth
from benchmarks.bench_fp8_gemm import time_us
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_split
from sglang_dsv4.tiny import preset_config


def kernel_times(fn) -> list[tuple[str, float]]:
    """(kernel name, GPU us) of each launch of one eager call of ``fn`` (torch profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == cuda]


def _launches(fn) -> int:
    """Kernel launches of one call of ``fn`` (torch profiler)."""
    return len(kernel_times(fn))


def mixer(hc: int, D: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random hyper-connection mixer on the GPU at width ``D``: (fn, base, scale)."""
    mix = (2 + hc) * hc
    fn = torch.randn(mix, hc * D, generator=g, device="cuda") * 0.01
    base = torch.randn(mix, generator=g, device="cuda") * 0.5
    return fn, base, torch.rand(3, generator=g, device="cuda") + 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--dim", type=int, default=4096, help="hidden size D (V4-Flash: 4096)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    cfg = preset_config("flash8")
    hc, D = cfg.hc_mult, args.dim
    if hc_split.sglang_fused_pre() is None or hc_split.sglang_kernel() is None:
        raise SystemExit("SGLang's hyper-connection kernels do not import here (carry .srt-site)")
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s ({torch.cuda.get_device_name()}); hc {hc}, D {D}")
    print("| batch | default us | launches | fused us | launches | fused speed-up | floor us | max diff "
          "| alone = in batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    fn, base, scale = mixer(hc, D, g)
    for B in [int(b) for b in args.batches.split(",")]:
        h = torch.randn(B, hc, D, generator=g, device="cuda")

        def default():
            mixes = ops.hc_mixes(h, fn, cfg)
            return hc_split.hc_split_sinkhorn(mixes, scale, base, cfg)

        def fused():
            return hc_split.hc_pre_split(h, fn, scale, base, cfg, enabled=True)

        want, got = default(), fused()
        diff = max((a - b).abs().max().item() for a, b in zip(want, got))
        alone = hc_split.hc_pre_split(h[-1:], fn, scale, base, cfg, enabled=True)
        same = all(torch.equal(a[0], b[-1]) for a, b in zip(alone, got))
        t_def, t_fused = time_us(default, args.reps), time_us(fused, args.reps)
        floor = (h.numel() * 4 + fn.numel() * 4) / bw * 1e6  # bytes read / copy bandwidth (bench_decode's roofline)
        print(f"| {B} | {t_def:.1f} | {_launches(default)} | {t_fused:.1f} | {_launches(fused)} | "
              f"{t_def / t_fused:.2f}x | {floor:.1f} | {diff:.1e} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
