"""A sublayer boundary of the hyper-connections in two Triton launches.

Between two sublayers the streams take the finished one's output (``ops.hc_post``: h' = post f +
comb^T h) and are reduced to the next one's input (``ops.hc_pre`` with its norm: the mixes, their
split and Sinkhorn, the weighted sum RMS-normed). On a GPU that was four launches a boundary: the
post as an Inductor kernel, SGLang's mixes + sum-of-squares split-K kernel and its reduce + Sinkhorn
kernel (``hc_split.hc_pre_split``), the weighted norm as another Inductor kernel; each reads the
[T, hc, D] fp32 streams again (4 MB at batch 64 and V4-Flash's width). In session 33's census of
flash43 at batch 64 (H100) they were ~25 us a boundary, 2.2 ms of a 22 ms step over 86 boundaries.

Here launch 1 computes the post and, from the new streams still in registers, each slice of the
hidden dims' share of the mixes' dot products and sum of squares (``post_mix_kernel``); launch 2, a
program a token, adds the slices' partials, splits, runs the Sinkhorn and writes the normed
weighted sum (``pre_finish_kernel``). The first sublayer (no output to expand yet) takes the same
two launches with the post left out. The streams are read once by each launch and written once.

The math is the torch ops' in fp32 (another summation order for the mixes' dot products and the
sums of squares: slices of the hidden dims, as SGLang's kernel slices its K); each row's bits depend
on the width alone, not the batch. Tested against the torch ops under the interpreter
(``tests/kernels/test_hc_boundary.py``) and on the GPU (``tests/kernels/test_hc_boundary_gpu.py``).
Opt-in (``SGLANG_DSV4_HC_BOUNDARY_KERNEL=1``, ``bench_decode --switches hc_boundary_kernel``), and
not worth switching on yet: on an H200 (session 35, ``benchmarks/bench_hc_boundary.py``, graph
replay) its two launches took 30.8 / 33.2 / 95.9 us a boundary at batch 1 / 64 / 256 against the
default path's four at 13.7 / 21.3 / 48.7 (0.44-0.64x), the same values to 7e-7 and each row the
same bits alone as in the batch. Where the time goes (the finishing kernel's 8 warps over a [4, 4]
Sinkhorn, the fp32 FMA dot, the streams' tiles reloaded per output stream) is for a profile to say.
"""

from __future__ import annotations

import os

import torch

from ..config import V4Config
from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor
# opt-in: slower than the default path so far (module docstring); read per call
ENABLED = os.environ.get("SGLANG_DSV4_HC_BOUNDARY_KERNEL", "0") == "1"
BLOCK_M = 16   # rows a launch-1 program takes (a dot's least M); fixed, so a row's bits are the batch's
BLOCK_D = 64   # the dot's K tile within a stream
MAX_SLICES = 32  # slices of the hidden dims launch 1 spreads over (fewer where D is narrow)
# the mixes' dot: "ieee" (fp32 FMAs) or "tf32x3" (three TF32 tensor-core products, fp32-level
# error; SGLang's hc_mix_stats on NVIDIA); a harness sweeps it
PRECISION = "ieee"
# launch 2's dims a program (0: the whole row, a program a token; else a program per token and
# block of dims, four streams only, the norm from launch 1's Gram partials); a harness sweeps it
FINISH_BLOCK = 0
FINISH_WARPS: int | None = None
MIX_WARPS = 4  # launch 1's warps; a harness sweeps it  # launch 2's warps (None: 8 from a width of 2048, else 4); a harness sweeps it


def slicing(d: int) -> tuple[int, int]:
    """(slices, K tiles a slice) over a hidden width ``d``: at most ``MAX_SLICES`` slices of whole
    ``BLOCK_D`` tiles; a function of the width alone (the rows' bits must not follow the batch)."""
    tiles = -(-d // BLOCK_D)
    per = -(-tiles // MAX_SLICES)
    return -(-tiles // per), per


def supported(h: Tensor, fn: Tensor, norm: Tensor | None, cfg: V4Config, f: Tensor | None = None,
              f_plus: Tensor | None = None) -> bool:
    """Whether ``post_pre`` takes these operands: switched on (``SGLANG_DSV4_HC_BOUNDARY_KERNEL=1``);
    fp32 streams [T, hc, D] and mixer [(2 + hc) * hc, hc * D] with unit column strides, hc a power
    of two; a norm weight [D]; the output ``f`` and its second part ``f_plus`` (if any) [T, D] with
    unit column strides; a CUDA tensor (or the interpreter)."""
    if not ENABLED or norm is None:
        return False
    if h.dim() != 3 or h.dtype != torch.float32 or fn.dtype != torch.float32 or not h.is_contiguous():
        return False
    T, hc, d = h.shape
    if hc < 1 or hc & (hc - 1) or fn.shape != ((2 + hc) * hc, hc * d) or fn.stride(1) != 1:
        return False
    if norm.shape != (d,) or any(t is not None and (t.shape != (T, d) or t.stride(1) != 1) for t in (f, f_plus)):
        return False
    return runs_on(h, "hc_boundary_triton")


@torch.compiler.disable  # kernel launches, never traced
def post_pre(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm: Tensor, cfg: V4Config,
             f: Tensor | None = None, post: Tensor | None = None, comb: Tensor | None = None,
             f_plus: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (streams, y, pre's post, pre's comb): with ``f`` the streams are ``ops.hc_post(f, h, post,
    comb, f_plus)`` (new), without them ``h`` itself; then ``ops.hc_pre(streams, fn, base, scale,
    cfg, norm)`` of them. h [T, hc, D] fp32 contiguous; f, f_plus [T, D]; post [T, hc], comb
    [T, hc, hc] (the finished sublayer's); fn, scale, base, norm the next sublayer's mixer and
    input norm (``supported`` says which operands it takes)."""
    from .hc_boundary_triton import post_gram_kernel, post_mix_kernel, pre_finish_kernel, pre_finish_split_kernel

    T, hc, d = h.shape
    mix = (2 + hc) * hc
    n_slices, per = slicing(d)
    dev = h.device
    expand = f is not None
    out = torch.empty_like(h) if expand else h
    y = torch.empty(T, d, dtype=torch.float32, device=dev)
    post_n = torch.empty(T, hc, dtype=torch.float32, device=dev)
    comb_n = torch.empty(T, hc, hc, dtype=torch.float32, device=dev)
    if T == 0:
        return out, y, post_n, comb_n
    if expand:
        post, comb = post.float().contiguous(), comb.float().contiguous()
    split = FINISH_BLOCK > 0 and hc == 4
    part_mix = torch.empty(n_slices, T, mix, dtype=torch.float32, device=dev)
    part_sq = torch.empty(n_slices, T, hc * hc if split else 1, dtype=torch.float32, device=dev)
    pdl = pdl_options(h)
    operands = (f if expand else h, f_plus if f_plus is not None else h, h, post if expand else h,
                comb if expand else h, out, fn, part_mix, part_sq, T, f.stride(0) if expand else 0,
                f_plus.stride(0) if f_plus is not None else 0, fn.stride(0))
    shape = dict(D=d, MIX=mix, MIX_PAD=max(16, pow2(mix)), BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, D_BLOCKS=per,
                 POST=expand, PLUS=f_plus is not None, PRECISION=PRECISION, num_warps=MIX_WARPS, **pdl)
    finish = (part_mix, part_sq, out, scale.float().contiguous(), base.float().contiguous(), norm.contiguous(),
              y, post_n, comb_n, T, 1.0 / (hc * d), cfg.rms_norm_eps)
    if split:
        post_gram_kernel[(-(-T // BLOCK_M), n_slices)](*operands, **shape)
        pre_finish_split_kernel[(T, -(-d // FINISH_BLOCK))](
            *finish, N_SLICES=n_slices, D=d, BLOCK_D=FINISH_BLOCK, MIX=mix, ITERS=cfg.hc_sinkhorn_iters,
            HC_EPS=cfg.hc_eps, num_warps=FINISH_WARPS or 1, **pdl)
        return out, y, post_n, comb_n
    post_mix_kernel[(-(-T // BLOCK_M), n_slices)](*operands, HC=hc, **shape)
    block = pow2(d)
    pre_finish_kernel[(T,)](
        *finish, N_SLICES=n_slices, D=d, BLOCK_D=block, HC=hc, MIX=mix, ITERS=cfg.hc_sinkhorn_iters,
        HC_EPS=cfg.hc_eps, num_warps=FINISH_WARPS or (8 if block >= 2048 else 4), **pdl)
    return out, y, post_n, comb_n


__all__ = ["ENABLED", "post_pre", "slicing", "supported"]
