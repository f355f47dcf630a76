"""A hyper-connection sublayer boundary on the GPU at V4-Flash width: the default path (``hc_post``'s
region, SGLang's two mixes + Sinkhorn kernels, the weighted norm's region) against the two launches
of ``kernels.hc_boundary`` (``SGLANG_DSV4_HC_BOUNDARY_KERNEL=1``), side by side.

    python -m benchmarks.bench_hc_boundary [--batches 1,16,64,256] [--dim 4096] [--reps 50]
        [--variants 32/1/ieee/512,64/2/tf32x3/1024]

Per batch and kind (``post``: an attention output expanded, then the next input; ``first``: the
first sublayer's input alone): microseconds per call of each path (captured in a CUDA graph and
replayed, as in a graphed step, ``bench_fp8_gemm.time_us``), kernel launches per call (torch
profiler), the speed-up, the largest difference of the outputs relative to their largest value,
and whether a row's kernel result is the same bits alone as in the batch; then each path's kernels
with their GPU time in one eager call (profiler; an eager launch runs longer than a replayed
one, the split between kernels is the point). The floor: the bytes a
call must move (the streams read, the output read and the new streams written where it expands
one, the mixing matrix) over the copy bandwidth measured in the same run. ``--variants``: the
kernel's launch shapes (``hc_boundary``'s constants) side by side. A harness: it decides the
switch's default and the kernel's shapes; the package never imports it.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_decode import copy_bandwidth
from benchmarks.bench_fp8_gemm import time_us
from benchmarks.bench_hc_pre import _launches, kernel_times, mixer
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_boundary, hc_split
from sglang_dsv4.tiny import preset_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--dim", type=int, default=4096, help="hidden size D (V4-Flash: 4096)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variants", default="",
                    help="launch shapes of the kernel to time besides its default, comma-separated "
                         "SLICES/WARPS/PRECISION/BLOCK[/MIX_WARPS[/BLOCK_D]] (hc_boundary.MAX_SLICES / FINISH_WARPS / "
                         "PRECISION / FINISH_BLOCK / MIX_WARPS / BLOCK_D), e.g. 32/1/ieee/512,64/2/tf32x3/1024/8/32")
    ap.add_argument("--variants-only", action="store_true",
                    help="time the kernel's launch shapes alone (no default-path comparison)")
    args = ap.parse_args()
    cfg = preset_config("flash8")
    hc, D = cfg.hc_mult, args.dim
    if hc_split.sglang_fused_pre() is None:
        print("note: SGLang's hyper-connection kernels do not import here: the default path is torch ops")
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s ({torch.cuda.get_device_name()}); hc {hc}, D {D}")
    print("| batch | kind | default us | launches | kernel us | launches | speed-up | floor us | max diff "
          "| alone = in batch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    fn, base, scale = mixer(hc, D, g)
    profiles: list[str] = []
    norm = torch.rand(D, generator=g, device="cuda") + 0.5
    if args.variants_only:
        variants(args, cfg, fn, base, scale, norm, g)
        return
    for B in [int(b) for b in args.batches.split(",")]:
        h = torch.randn(B, hc, D, generator=g, device="cuda")
        f = torch.randn(B, D, generator=g, device="cuda")
        post = torch.rand(B, hc, generator=g, device="cuda") * 2
        comb = torch.softmax(torch.randn(B, hc, hc, generator=g, device="cuda"), -1)
        for kind, done in (("post", ops.SublayerOutput(f, post, comb)), ("first", None)):
            def call(on: bool, h=h, done=done):
                hc_boundary.ENABLED = on
                return ops.hc_boundary(h, done, fn, base, scale, cfg, norm)

            want, got = call(False), call(True)
            diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
            part = done and ops.SublayerOutput(*(t[-1:] if t is not None else None for t in done))
            alone = call(True, h[-1:].contiguous(), part)
            same = all(torch.equal(a[0], b[-1]) for a, b in zip(alone, got))
            t_def, t_new = time_us(lambda: call(False), args.reps), time_us(lambda: call(True), args.reps)
            n_def, n_new = _launches(lambda: call(False)), _launches(lambda: call(True))
            moved = h.numel() * 4 + fn.numel() * 4 + (f.numel() * 4 + h.numel() * 4 if done else 0)
            print(f"| {B} | {kind} | {t_def:.1f} | {n_def} | {t_new:.1f} | {n_new} | {t_def / t_new:.2f}x | "
                  f"{moved / bw * 1e6:.1f} | {diff:.1e} | {'yes' if same else 'no'} |")
            for name, on in (("default", False), ("kernel", True)):
                split = ", ".join(f"{k[:48]} {us:.1f}" for k, us in kernel_times(lambda: call(on)))
                profiles.append(f"| {B} | {kind} | {name} | {split} |")
    print("\n| batch | kind | path | kernels, us each (one eager call, profiler) |\n|---|---|---|---|")
    print("\n".join(profiles))
    if args.variants:
        variants(args, cfg, fn, base, scale, norm, g)
    hc_boundary.ENABLED = False


def variants(args, cfg, fn, base, scale, norm, g) -> None:
    """The kernel's launch shapes side by side (replayed us per call, ``post`` kind, each launch's
    eager GPU time, and each launch's registers a thread / spilled registers as Triton compiled
    it): slices of the hidden dims, the dot's precision, warps and dims a program; the first column
    is the kernel's default shape."""
    knobs = ("MAX_SLICES", "FINISH_WARPS", "PRECISION", "FINISH_BLOCK", "MIX_WARPS", "BLOCK_D")
    fma_mix = hc_boundary.FMA_MIX
    default = tuple("fma" if k == "PRECISION" and fma_mix else getattr(hc_boundary, k) for k in knobs)
    shapes = []
    for v in filter(None, args.variants.split(",")):
        parts = v.split("/")
        given = [int(parts[0]), int(parts[1]), parts[2], *(int(x) for x in parts[3:])]
        shapes.append(tuple(given + list(default[len(given):])))
    hc, D = cfg.hc_mult, args.dim
    print("\n| batch | " + " | ".join("/".join(str(x) for x in v) + " us" for v in [default, *shapes])
          + " | max diff of each |")
    print("|---" * (len(shapes) + 3) + "|")
    for B in [int(b) for b in args.batches.split(",")]:
        h = torch.randn(B, hc, D, generator=g, device="cuda")
        done = ops.SublayerOutput(torch.randn(B, D, generator=g, device="cuda"),
                                  torch.rand(B, hc, generator=g, device="cuda") * 2,
                                  torch.softmax(torch.randn(B, hc, hc, generator=g, device="cuda"), -1))
        times, diffs, splits, regs = [], [], [], []
        hc_boundary.ENABLED = False
        want = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
        hc_boundary.ENABLED = True
        for shape in [default, *shapes]:
            for k, v in zip(knobs, shape):
                setattr(hc_boundary, k, v)
            hc_boundary.FMA_MIX = shape[2] == "fma"  # PRECISION "fma": the column FMAs, else tl.dot at it
            _forget_compiled()
            got = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
            diffs.append(max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)))
            times.append(time_us(lambda: ops.hc_boundary(h, done, fn, base, scale, cfg, norm), args.reps))
            splits.append(" + ".join(f"{us:.1f}" for _, us in kernel_times(
                lambda: ops.hc_boundary(h, done, fn, base, scale, cfg, norm))))
            regs.append(" + ".join(_registers(k) for k in _KERNELS))
        for k, v in zip(knobs, default):
            setattr(hc_boundary, k, v)
        hc_boundary.FMA_MIX = fma_mix
        print(f"| {B} | " + " | ".join(f"{t:.1f}" for t in times) + " | " + ", ".join(f"{e:.0e}" for e in diffs) + " |")
        print(f"| {B} eager, us a launch | " + " | ".join(splits) + " | |")
        print(f"| {B} registers / spills | " + " | ".join(regs) + " | |")


_KERNELS = ("post_mix_kernel", "pre_finish_kernel")


def _compiled(name: str) -> dict:
    """The in-memory compiled specialisations of the ``hc_boundary_triton`` kernel ``name`` here
    (Triton's per-device cache; the disk cache keeps a recompile short)."""
    from sglang_dsv4.kernels import hc_boundary_triton

    return getattr(hc_boundary_triton, name).device_caches[torch.cuda.current_device()][0]


def _forget_compiled() -> None:
    """Drop the kernels' in-memory compilations, so that ``_registers`` sees one launch shape's."""
    try:
        for name in _KERNELS:
            _compiled(name).clear()
    except (AttributeError, KeyError, IndexError, TypeError):
        pass


def _registers(name: str) -> str:
    """'registers/spilled' of kernel ``name`` as compiled since ``_forget_compiled`` (the most
    over its specialisations; '?' where this Triton does not say)."""
    try:
        compiled = list(_compiled(name).values())
        return f"{max(k.n_regs for k in compiled)}/{max(k.n_spills for k in compiled)}"
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return "?"


if __name__ == "__main__":
    main()
