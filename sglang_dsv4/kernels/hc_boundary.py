"""A sublayer boundary of the hyper-connections in two Triton launches.

Between two sublayers the streams take the finished one's output (``ops.hc_post``: h' = post f +
comb^T h) and are reduced to the next one's input (``ops.hc_pre`` with its norm: the mixes, their
split and Sinkhorn, the weighted sum RMS-normed). On a GPU that was four launches a boundary: the
post as an Inductor kernel, SGLang's mixes + sum-of-squares split-K kernel and its reduce + Sinkhorn
kernel (``hc_split.hc_pre_split``), the weighted norm as another Inductor kernel; each reads the
[T, hc, D] fp32 streams again (4 MB at batch 64 and V4-Flash's width). In session 33's census of
flash43 at batch 64 (H100) they were ~25 us a boundary, 2.2 ms of a 22 ms step over 86 boundaries.

Here launch 1 computes the post and, from the new streams still in registers, each slice of the
hidden dims' share of the mixes' dot products and of the streams' Gram matrix (``post_mix_kernel``);
launch 2, a program a token and block of 512 dims, adds the slices' partials, splits, runs the
Sinkhorn and writes its block of the normed weighted sum, whose mean square is pre^T G pre / D
(``pre_finish_kernel``). The first sublayer (no output to expand yet) takes the same two launches
with the post left out. The streams are read once by each launch and written once. V4's four
streams only (``supported``).

The math is the torch ops' in fp32 (other summation orders: slices of the hidden dims for the
mixes' dot products, as SGLang's kernel slices its K, and the Gram matrix for the norms); each
row's bits depend on the width alone, not the batch. Tested against the torch ops under the
interpreter (``tests/kernels/test_hc_boundary.py``) and on the GPU
(``tests/kernels/test_hc_boundary_gpu.py``: passed in session 35 with the first shapes below and
in session 38 with these).
Graph-replayed (``benchmarks/bench_hc_boundary.py``), the first shapes (32 slices, an fp32 FMA
dot, a program a token with 8 warps for launch 2) took 30.8 / 33.2 / 95.9 us a boundary at batch 1
/ 64 / 256 on an H200 (session 35) against the default path's four launches at 13.7 / 21.3 / 48.7;
these (the constants below) 13.6 / 17.4 / 65.0 against 13.7 / 21.9 / 54.4 on an H100 (session 36,
within 4e-7 of the default path's values): level, 1.26x and 0.84x. Eager, launch 1 is most of
the time; at 256 rows it is slower than the default path's post and mixes kernels together.
So it is on by default up to ``MAX_ROWS`` rows, the torch ops above them
(``SGLANG_DSV4_HC_BOUNDARY_KERNEL=0``: the torch ops everywhere), and the model takes it for
decode steps and every piece of the deterministic mode (64 rows each) only: a prefill chunk keeps
the torch ops at any length, so that chunkings of a prompt give the same bits
(``V4Model.boundary_kernel``; session 39's GPU run of ``tests/srt/test_state_gpu.py`` found a
40-row chunk through the kernel 1.5 off in a tiny model's logits from an 81-row one through the
ops). Its GPU tests passed with these shapes on an H100 in session 38, where the step (1K, fp8,
graphs) went from 17.62 to 17.28 ms with it at flash43's batch 64 and from 5.84 to 5.78 ms at
flash8's.
"""

from __future__ import annotations

import os

import torch

from ..config import V4Config
from . import fp8_linear
from .fp8_linear import ACT_GROUP, Fp8Act
from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor
# on by default up to MAX_ROWS rows (module docstring); both read per call
ENABLED = os.environ.get("SGLANG_DSV4_HC_BOUNDARY_KERNEL", "1") == "1"
MAX_ROWS = 64  # level at 1 row, 1.26x at 64, 0.84x at 256 (session 36, H100): the torch ops above
BLOCK_M = 16   # rows a launch-1 program takes (a dot's least M); fixed, so a row's bits are the batch's
# Launch shapes, measured side by side on an H100 in session 36 (``bench_hc_boundary --variants``,
# which sets these): 64 slices of one tile against 32 of two, 13.6 against 19.4 us at batch 1;
# TF32x3 against the fp32 FMA dot, 21.3 against 31.1 us (launch 2 then a program a token).
BLOCK_D = 64   # the dot's K tile within a stream
MAX_SLICES = 64  # slices of the hidden dims launch 1 spreads over (fewer where D is narrow)
PRECISION = "tf32x3"  # the mixes' tl.dot ("fma": FMA_MIX's column FMAs instead)
# On by default since session 42 (read per call; ``SGLANG_DSV4_HC_FMA_MIX=0``: the dot): the mixes
# as fp32 FMAs a column at a time (``_mix_fma``) instead of the TF32x3 dot, whose split operands
# spill (ncu, H100, session 41: 255 registers a thread, 284K local-memory requests a launch at
# batch 64). H100, session 42: 128 registers, no spills; launch 1 7.6 -> 5.0 us at batch 1,
# 11.2 -> 7.2 at 64; the boundary (graph-replayed) 12.5 -> 10.1 and 17.5 -> 13.4 us; flash43's
# batch-64 step 17.10 -> 16.74 ms; its GPU tests (against the torch ops, graph replay) passed
FMA_MIX = os.environ.get("SGLANG_DSV4_HC_FMA_MIX", "1") == "1"
MIX_WARPS = 4  # launch 1's warps
FINISH_BLOCK = 512  # dims a launch-2 program normalises (each also runs the token's Sinkhorn)
FINISH_WARPS = 1  # launch 2's: the [4, 4] Sinkhorn's reductions stay within a warp


def slicing(d: int) -> tuple[int, int]:
    """(slices, K tiles a slice) over a hidden width ``d``: at most ``MAX_SLICES`` slices of whole
    ``BLOCK_D`` tiles; a function of the width alone (the rows' bits must not follow the batch)."""
    tiles = -(-d // BLOCK_D)
    per = -(-tiles // MAX_SLICES)
    return -(-tiles // per), per


def supported(h: Tensor, fn: Tensor, norm: Tensor | None, cfg: V4Config, f: Tensor | None = None,
              f_plus: Tensor | None = None) -> bool:
    """Whether ``post_pre`` takes these operands: switched on (``ENABLED``, on by default); fp32
    streams [T, 4, D] (V4's four; T at most ``MAX_ROWS``, shapes only for CUDA graphs) and mixer
    [24, 4 * D] with unit column strides; a norm weight [D]; the output ``f`` and its second part
    ``f_plus`` (if any) [T, D] with unit column strides; a CUDA tensor (or the interpreter)."""
    if not ENABLED or norm is None:
        return False
    if h.dim() != 3 or h.dtype != torch.float32 or fn.dtype != torch.float32 or not h.is_contiguous():
        return False
    T, hc, d = h.shape
    if T > MAX_ROWS or hc != 4 or fn.shape != ((2 + hc) * hc, hc * d) or fn.stride(1) != 1:
        return False
    if norm.shape != (d,) or any(t is not None and (t.shape != (T, d) or t.stride(1) != 1) for t in (f, f_plus)):
        return False
    return runs_on(h, "hc_boundary_triton")


def quantizes(d: int) -> bool:
    """Whether ``post_pre(quantize=True)`` writes y's fp8 operands at hidden width ``d``: switched on
    (``fp8_linear.SHARED_OPERANDS``, read per call) and whole 128-wide groups in launch 2's blocks
    and in y."""
    return fp8_linear.SHARED_OPERANDS and d % ACT_GROUP == 0 and FINISH_BLOCK % ACT_GROUP == 0


@torch.compiler.disable  # kernel launches, never traced
def post_pre(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm: Tensor, cfg: V4Config,
             f: Tensor | None = None, post: Tensor | None = None, comb: Tensor | None = None,
             f_plus: Tensor | None = None, quantize: bool = False
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Fp8Act | None]:
    """-> (streams, y, pre's post, pre's comb, y's fp8 operands or None): with ``f`` the streams
    are ``ops.hc_post(f, h, post, comb, f_plus)`` (new), without them ``h`` itself; then
    ``ops.hc_pre(streams, fn, base, scale, cfg, norm)`` of them. h [T, hc, D] fp32 contiguous; f,
    f_plus [T, D]; post [T, hc], comb [T, hc, hc] (the finished sublayer's); fn, scale, base, norm
    the next sublayer's mixer and input norm (``supported`` says which operands it takes).
    ``quantize`` (where ``quantizes``): launch 2 also writes ``fp8_linear.quantize_act(y)``, the
    same bytes, as an ``Fp8Act``."""
    from .hc_boundary_triton import post_mix_kernel, pre_finish_kernel

    T, hc, d = h.shape
    mix = (2 + hc) * hc
    n_slices, per = slicing(d)
    dev = h.device
    expand = f is not None
    out = torch.empty_like(h) if expand else h
    y = torch.empty(T, d, dtype=torch.float32, device=dev)
    post_n = torch.empty(T, hc, dtype=torch.float32, device=dev)
    comb_n = torch.empty(T, hc, hc, dtype=torch.float32, device=dev)
    act = None
    if quantize and quantizes(d):
        act = Fp8Act(torch.empty(T, d, dtype=torch.float8_e4m3fn, device=dev),
                     torch.empty(T, d // ACT_GROUP, dtype=torch.float32, device=dev))
    if T == 0:
        return out, y, post_n, comb_n, act
    if expand:
        post, comb = post.float().contiguous(), comb.float().contiguous()
    part_mix = torch.empty(n_slices, T, mix, dtype=torch.float32, device=dev)
    part_gram = torch.empty(n_slices, T, hc * hc, dtype=torch.float32, device=dev)
    pdl = pdl_options(h)
    post_mix_kernel[(-(-T // BLOCK_M), n_slices)](
        f if expand else h, f_plus if f_plus is not None else h, h, post if expand else h, comb if expand else h,
        out, fn, part_mix, part_gram, T, f.stride(0) if expand else 0,
        f_plus.stride(0) if f_plus is not None else 0, fn.stride(0),
        D=d, MIX=mix, MIX_PAD=max(16, pow2(mix)), BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, D_BLOCKS=per,
        POST=expand, PLUS=f_plus is not None, PRECISION="fma" if FMA_MIX else PRECISION,
        num_warps=MIX_WARPS, **pdl)
    pre_finish_kernel[(T, -(-d // FINISH_BLOCK))](
        part_mix, part_gram, out, scale.float().contiguous(), base.float().contiguous(), norm.contiguous(),
        y, post_n, comb_n, act.q.view(torch.uint8) if act else y, act.s if act else y,
        T, 1.0 / (hc * d), cfg.rms_norm_eps, N_SLICES=n_slices,
        D=d, BLOCK_D=FINISH_BLOCK, MIX=mix, ITERS=cfg.hc_sinkhorn_iters, HC_EPS=cfg.hc_eps,
        QUANT=act is not None, GROUP=ACT_GROUP, num_warps=FINISH_WARPS, **pdl)
    return out, y, post_n, comb_n, act


__all__ = ["ENABLED", "FMA_MIX", "MAX_ROWS", "post_pre", "quantizes", "slicing", "supported"]
