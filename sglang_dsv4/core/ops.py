"""Per-token V4 math shared by the reference oracle and the incremental model.

Everything here is a function of the tokens it is given (and their absolute positions); nothing
reads or writes a cache. Section numbers refer to ``shared/docs/v4_architecture.md``.
Shapes: T tokens, D hidden, H heads, Dh head dim, hc residual streams.
"""

from __future__ import annotations

import functools
import math
import os
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import RopeScaling, V4Config, yarn_ramp_bounds
from ..kernels import c128_pool, hc_split
from ..kernels import hc_boundary as hc_boundary_kernel
from ..kernels import c4_entries as c4_entries_kernel
from ..kernels import route as route_kernel
from ..kernels import topk as topk_kernel
from ..kernels.expert_rows import expert_rows
from ..kernels.fp8_linear import Fp8Act, Fp8Weight, fp8_linear, quantize_act
from ..kernels.fp8_moe import fp8_grouped_experts, stack_fp8_experts
from ..kernels.fp8_weight_only import grouped_weight_only_linear
from ..quant import FP8_WEIGHT_BLOCK, fp4_qat, fp8_qat, hadamard
from .compiled import on_gpu
from .step import CPU_TOKEN_TILE

Tensor = torch.Tensor


# CPU GEMMs (MKL) choose their kernel, blocking and K split by shape and thread count, so a row's
# fp32 result can depend on how many rows come with it. Measured on a 2-core Xeon (AVX-512): K = 256
# gives one result for 8 rows and another for 16 or more; K = 1024 (the hc mixes, hc_head, wo_b)
# with 2 threads splits K across the threads below a few hundred rows, differently for each count;
# an EPYC agreed on every multiple of 4 rows. Padding cannot fix the second, so on the CPU every
# GEMM runs over blocks of exactly CPU_ROW_TILE rows (the last zero-padded): each weight sees one
# GEMM shape, and a row's result depends on that row alone, on any machine's MKL, for a fixed
# thread count. 32 = the step's token tile (core.step.CPU_TOKEN_TILE): token rows need no padding.
CPU_ROW_TILE = 32


def _zero_pad_rows(x: Tensor, tile: int) -> Tensor:
    """x with zero rows appended (dim 0) up to a multiple of ``tile``."""
    extra = -x.shape[0] % tile
    return torch.cat((x, x.new_zeros((extra,) + tuple(x.shape[1:])))) if extra else x


def pad_rows(x: Tensor, tile: int = CPU_ROW_TILE) -> Tensor:
    """x with zero rows appended (dim 0) up to a multiple of ``tile`` on the CPU; as is elsewhere."""
    return _zero_pad_rows(x, tile) if x.device.type == "cpu" else x


def _gemm(x: Tensor, w: Tensor | Fp8Weight, act: Fp8Act | None = None) -> Tensor:
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, act)
    return x @ w.t() if x.dtype == w.dtype else (x.to(w.dtype) @ w.t()).to(x.dtype)


def linear(x: Tensor, w: Tensor | Fp8Weight, act: Fp8Act | None = None) -> Tensor:
    """x @ w.T in the weight's dtype (bf16 weights: a bf16 GEMM), returned in x's dtype. An fp8
    block-128 weight (``kernels.fp8_linear.Fp8Weight``, the fp8 weight mode) takes x quantised
    as V4's QAT does (e4m3, groups of 128, power-of-two scales) into the fp8 block GEMM; ``act``:
    that quantisation made by x's producer (``hc_boundary``), the same bytes, no launch of its own.

    Row i of the result depends only on row i of x: on the CPU over tiles of exactly
    CPU_ROW_TILE rows (see there; x is quantised again per tile there)."""
    if x.device.type == "cpu" and CPU_ROW_TILE:
        return tiled_linear(x, w, CPU_ROW_TILE)
    return _gemm(x, w, act)


def tiled_linear(x: Tensor, w: Tensor | Fp8Weight, tile: int) -> Tensor:
    """``linear`` over blocks of exactly ``tile`` rows, the last one zero-padded: every GEMM has
    the same shape whatever the row count, so a row's result does not depend on the rows that
    come with it even where the GEMM kernel is chosen by row count (MKL, cuBLAS, split-K)."""
    n = x.shape[0]
    if n == 0:
        return _gemm(x, w)
    x = _zero_pad_rows(x, tile)
    if x.shape[0] == tile:
        return _gemm(x, w)[:n]
    return torch.cat([_gemm(x[i:i + tile], w) for i in range(0, x.shape[0], tile)])[:n]


@on_gpu(rows={"x": (0,)})
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


# ---- RoPE (§1.3, §2.2) ---------------------------------------------------------------------

@lru_cache(maxsize=16)
def _inv_freqs(rope_dim: int, base: float, scaling: RopeScaling | None) -> Tensor:
    freqs = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    if scaling is not None:
        low, high = yarn_ramp_bounds(rope_dim, base, scaling)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / scaling.factor * (1 - smooth) + freqs * smooth
    return freqs


def layer_inv_freqs(cfg: V4Config, ratio: int, device: torch.device | str = "cpu") -> Tensor:
    """RoPE frequencies of a layer: compress_rope_theta + YaRN if ratio > 0, else rope_theta.
    Built once per device (a step copies no table to the device)."""
    if ratio:
        return _device_inv_freqs(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling, str(device))
    return _device_inv_freqs(cfg.qk_rope_head_dim, cfg.rope_theta, None, str(device))


@lru_cache(maxsize=64)
def _device_inv_freqs(rope_dim: int, base: float, scaling: RopeScaling | None, device: str) -> Tensor:
    return _inv_freqs(rope_dim, base, scaling).to(device)


class Rope(NamedTuple):
    """The rotation of each row's position: cos and sin of its angles pos * f, [T, rd/2] float64."""

    cos: Tensor
    sin: Tensor


@on_gpu(rows={"positions": (0,)})
def rope_at(positions: Tensor, inv_freqs: Tensor) -> Rope:
    """The rotations of ``positions`` [T] at frequencies ``inv_freqs``. Angles are formed in
    float64 so large positions stay exact. Built once per step and position set (``V4Model``):
    inside a fused region Inductor recomputes a table like this for every element it rotates,
    float64 cosines and sines for each of a [T, H, Dh] output (session-13 census: ~90 us per
    layer for attention_output's rotation at batch 256, ~8x its bytes)."""
    angles = positions.to(torch.float64)[:, None] * inv_freqs.to(positions.device)[None, :]
    return Rope(torch.cos(angles), torch.sin(angles))


def apply_rope(x: Tensor, rope: Rope, inverse: bool = False) -> Tensor:
    """Rotate the last 2 * rd/2 dims of x (interleaved pairs) by each row's ``rope`` [T, rd/2]
    (``inverse``: by minus its angles). x: [T, ..., d]."""
    rd = 2 * rope.cos.shape[-1]
    cos = rope.cos.to(x.dtype)
    sin = rope.sin.to(x.dtype)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    rot = x[..., -rd:].unflatten(-1, (rd // 2, 2))
    re, im = rot[..., 0], rot[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], out), dim=-1)


# ---- manifold-constrained hyper-connections (§5) ----------------------------------------------

def hc_pre(h: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg: V4Config,
           norm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Reduce the hc streams to one input. h: [T, hc, D] -> (y [T, D], post [T, hc], comb [T, hc, hc]).
    With ``norm`` (the sublayer's input norm weight) y comes RMS-normed: ``rms_norm(y, norm)``,
    the same ops, one fused region with the weighted sum on the GPU.

    On a GPU with SGLang importable the split and Sinkhorn of the mixes are SGLang's Triton kernel
    (one launch instead of ~40, ``kernels.hc_split``), with ``SGLANG_DSV4_HC_FUSED_PRE=1`` the
    mixes too (``hc_split.hc_pre_split``); the torch ops everywhere else."""
    split = hc_split.hc_pre_split(h, fn, scale, base, cfg) if h.is_cuda else None
    if split is None:
        mixes = hc_mixes(h, fn, cfg)
        split = hc_split.hc_split_sinkhorn(mixes, scale, base, cfg) if h.is_cuda else None
        if split is None:
            split = hc_split_torch(mixes, base, scale, cfg)
    pre, post, comb = split
    y = hc_weighted_sum(pre, h) if norm is None else hc_weighted_norm(pre, h, norm, cfg.rms_norm_eps)
    return y, post, comb


def _mixes(h: Tensor, fn: Tensor, cfg: V4Config) -> Tensor:
    flat = h.flatten(1)
    return linear(flat, fn) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)


@on_gpu(rows={"h": (0,)})
def hc_mixes(h: Tensor, fn: Tensor, cfg: V4Config) -> Tensor:
    """h [T, hc, D] -> the mixes [T, (2 + hc) * hc] (RMS over all hc * D values, §5.3)."""
    return _mixes(h, fn, cfg)


def _sum_in_order(x: Tensor, dim: int) -> Tensor:
    """x summed over a short ``dim`` as explicit adds of its slices in index order (dim dropped):
    elementwise, so a compiled region on the GPU fuses it instead of launching a reduction."""
    parts = x.unbind(dim)
    return functools.reduce(torch.add, parts[1:], parts[0])


def _stream_sum(w: Tensor, h: Tensor, unrolled: bool) -> Tensor:
    """sum_j w[:, j, ...] h[:, j] over the hc streams: w [T, hc] -> [T, D], or w [T, hc, k]
    -> [T, k, D] (``hc_post``'s comb). ``unrolled`` writes the hc-long sum as explicit adds of
    its terms, in stream order: on the GPU the region is then one elementwise kernel that reads
    h once (as a batched GEMM of hc x hc x D products it cost ~68 us per call at batch 256 and
    V4-Flash width, ~8x its bytes over the copy bandwidth; session-10 census). The CPU keeps the
    einsum (its summation order is the one the bit-exact chunking tests pin)."""
    if w.dim() == 2:
        return _sum_in_order(w[..., None] * h, 1) if unrolled else torch.einsum("th,thd->td", w, h)
    return _sum_in_order(w[..., None] * h[:, :, None], 1) if unrolled else torch.einsum("tjk,tjd->tkd", w, h)


@on_gpu(rows={"pre": (0,), "h": (0,)})
def hc_weighted_sum(pre: Tensor, h: Tensor) -> Tensor:
    """y = sum_i pre_i h[:, i] (not normalised to sum 1): [T, hc], [T, hc, D] -> [T, D]."""
    return _stream_sum(pre, h, h.is_cuda)


@on_gpu(rows={"pre": (0,), "h": (0,)})
def hc_weighted_norm(pre: Tensor, h: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm(hc_weighted_sum(pre, h), weight, eps)``: a sublayer's normed input [T, D]."""
    return rms_norm(hc_weighted_sum(pre, h), weight, eps)


@on_gpu(rows={"mixes": (0,)})
def hc_split_torch(mixes: Tensor, base: Tensor, scale: Tensor, cfg: V4Config) -> tuple[Tensor, Tensor, Tensor]:
    """The mixes [T, (2 + hc) * hc] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]) in torch ops
    (the CPU, and a GPU without SGLang's kernel)."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    comb = sinkhorn(torch.softmax(comb, dim=-1) + eps, cfg.hc_sinkhorn_iters, eps)
    return pre, post, comb


def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """Alternate column / row normalisation of [T, hc, hc] (a column first, ``iters`` columns).

    On a GPU the sums over the tiny hc axis are written as explicit adds of its slices: then the
    loop is elementwise and ``torch.compile`` makes each normalisation one kernel instead of two
    (the same adds in the same order: torch's hc-long sums, to rounding). Inductor still
    materialises every normalisation (39 kernels per call, measured): where SGLang imports,
    ``hc_pre`` takes its one-kernel split instead."""
    def col_sum(c: Tensor) -> Tensor:
        return _sum_in_order(c, -2).unsqueeze(-2) if c.is_cuda else c.sum(-2, keepdim=True)

    def row_sum(c: Tensor) -> Tensor:
        return _sum_in_order(c, -1).unsqueeze(-1) if c.is_cuda else c.sum(-1, keepdim=True)

    comb = comb / (col_sum(comb) + eps)
    for _ in range(iters - 1):
        comb = comb / (row_sum(comb) + eps)
        comb = comb / (col_sum(comb) + eps)
    return comb


class SublayerOutput(NamedTuple):
    """A sublayer's output not yet expanded into the streams: ``hc_post``'s operands but h. The
    model hands it to the next sublayer's ``hc_boundary``, where the expansion and the next input's
    reduction can be one pair of launches."""
    f: Tensor
    post: Tensor
    comb: Tensor
    f_plus: Tensor | None = None


def hc_boundary(h: Tensor, done: SublayerOutput | None, fn: Tensor, base: Tensor, scale: Tensor,
                cfg: V4Config, norm: Tensor, kernel: bool = True, quantized: bool = False) -> tuple:
    """The streams after the finished sublayer ``done`` (``hc_post``; h itself where None), and the
    next sublayer's input from them (``hc_pre`` with its ``norm``) -> (streams, y, post, comb);
    with ``quantized`` a fifth, y's fp8 GEMM operands (``Fp8Act``) where the kernel made them
    (``fp8_linear.SHARED_OPERANDS``), else None.

    On a GPU, where ``kernel`` allows it and up to ``kernels.hc_boundary.MAX_ROWS`` rows
    (``SGLANG_DSV4_HC_BOUNDARY_KERNEL=0``: never), that is two Triton launches
    (``kernels.hc_boundary``) instead of hc_post's region, SGLang's two kernels and the weighted
    norm's region; the same ops as ever elsewhere. The two round differently (within 7e-7), so a
    caller whose results must not follow a row count passes the same ``kernel`` for every count
    (``V4Model.boundary_kernel``)."""
    if kernel and hc_boundary_kernel.supported(h, fn, norm, cfg, done.f if done else None,
                                               done.f_plus if done else None):
        got = hc_boundary_kernel.post_pre(h, fn, scale, base, norm, cfg, *(done or ()), quantize=quantized)
        return got if quantized else got[:4]
    h = hc_expand(h, done)
    return (h, *hc_pre(h, fn, base, scale, cfg, norm=norm)) + ((None,) if quantized else ())


def hc_expand(h: Tensor, done: SublayerOutput | None) -> Tensor:
    """The streams after the finished sublayer ``done`` (``hc_post``), h itself where None."""
    return h if done is None else hc_post(done.f, h, done.post, done.comb, done.f_plus)


@on_gpu(rows={"f": (0,), "h": (0,), "post": (0,), "comb": (0,), "f_plus": (0,)})
def hc_post(f: Tensor, h: Tensor, post: Tensor, comb: Tensor, f_plus: Tensor | None = None) -> Tensor:
    """Expand a sublayer output back to the streams: h'[k] = post_k f + sum_j comb[j, k] h[j].
    ``f_plus``: a second part of the output, f + f_plus (the MoE's routed and shared experts
    computed apart)."""
    if f_plus is not None:
        f = f + f_plus
    return post.unsqueeze(-1) * f.unsqueeze(1) + _stream_sum(comb, h, h.is_cuda)


@on_gpu(rows={"h": (0,)})
def hc_head(h: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg: V4Config) -> Tensor:
    """Final stream merge before the output norm (§5.6). h: [T, hc, D] -> [T, D]."""
    mixes = _mixes(h, fn, cfg)
    pre = torch.sigmoid(mixes * scale[0] + base) + cfg.hc_eps
    return _stream_sum(pre, h, h.is_cuda)


# ---- attention projections (§2.2-§2.5) ------------------------------------------------------

@on_gpu(rows={"x": (0,), "rope": (0,), "act": (0,)})
def project_q(x: Tensor, w: dict[str, Tensor], rope: Rope, cfg: V4Config,
              q_dtype: torch.dtype | None = None, xq: Tensor | None = None,
              act: Fp8Act | None = None, qr_act: bool = False) -> tuple:
    """x: [T, D] -> (q [T, H, Dh] normed and rotated, qr [T, Q] latent reused by the indexer).
    ``q_dtype``: q rounded to the attention kernel's input dtype here (FlashMLA's bf16), where
    the rounding fuses with the RoPE instead of costing a pass of its own. ``xq``: x @ wq_a.T
    computed already (``x_projections``' stacked GEMM); ``act``: x's fp8 operands (``linear``).
    ``qr_act`` (wq_b fp8): a third output, qr's fp8 operands, quantised once here for wq_b and
    the indexer's wq_b (``indexer_queries``) instead of once in each region."""
    xq = linear(x, w["attn.wq_a.weight"], act) if xq is None else xq
    qr = rms_norm(xq, w["attn.q_norm.weight"], cfg.rms_norm_eps)
    qa = Fp8Act(*quantize_act(qr)) if qr_act else None
    q = linear(qr, w["attn.wq_b.weight"], qa).view(x.shape[0], -1, cfg.head_dim)
    q = apply_rope(rms_norm(q, None, cfg.rms_norm_eps), rope)
    q = q if q_dtype is None else q.to(q_dtype)
    return (q, qr, qa) if qr_act else (q, qr)


@on_gpu(rows={"x": (0,), "rope": (0,), "act": (0,)})
def project_kv(x: Tensor, w: dict[str, Tensor], rope: Rope, cfg: V4Config, quant_sim: bool,
               xkv: Tensor | None = None, act: Fp8Act | None = None) -> Tensor:
    """x: [T, D] -> window KV [T, Dh] (one shared head; K = V). ``xkv``: x @ wkv.T computed
    already (``x_projections``); ``act``: x's fp8 operands (``linear``)."""
    xkv = linear(x, w["attn.wkv.weight"], act) if xkv is None else xkv
    kv = rms_norm(xkv, w["attn.kv_norm.weight"], cfg.rms_norm_eps)
    kv = apply_rope(kv, rope)
    return _fp8_nope(kv, cfg) if quant_sim else kv


# The matrices an attention sublayer applies to its normed input x, in stacking order. Each is a
# small GEMM of its own (7 in a C4 layer); stacked by storage kind (V4-Flash: wq_a + wkv fp8, the
# compressors' and the indexer's bf16) they are one GEMM each, and x is quantised / cast once.
X_MATRICES = ("attn.wq_a.weight", "attn.wkv.weight", "attn.compressor.wkv.weight", "attn.compressor.wgate.weight",
              "attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight",
              "attn.indexer.weights_proj.weight")
X_STACK = "attn.x_stack."  # + storage kind ("fp8", "bfloat16", ...): a layer's stacked matrices
# opt-in (session 32, H100: 1% slower at batch 1, even at 16, 17 s more compile; ``bench_decode
# --switches stack_x``): a GPU model stacks them at construction (``V4Model._stack_x_matrices``)
STACK_X = os.environ.get("SGLANG_DSV4_STACK_X", "0") == "1"


def _storage_kind(t: Tensor | Fp8Weight) -> str:
    return "fp8" if isinstance(t, Fp8Weight) else str(t.dtype).removeprefix("torch.")


def _row_slice(t: Tensor | Fp8Weight, start: int, stop: int) -> Tensor | Fp8Weight:
    """Rows start..stop of a matrix, a view (fp8: start on a scale block's first row)."""
    if isinstance(t, Fp8Weight):
        b = FP8_WEIGHT_BLOCK
        return Fp8Weight(t.q[start:stop], t.scale[start // b:-(-stop // b)])
    return t[start:stop]


def stack_x_matrices(w: dict[str, Tensor]) -> list[str]:
    """Stack a layer's ``X_MATRICES`` of one storage kind into one matrix (``X_STACK`` + kind) and
    make their entries row views of it (no second copy). fp8 matrices stack where every one but
    the last fills whole 128-row scale blocks (V4's do). -> the stacks made."""
    by_kind: dict[str, list[str]] = {}
    for name in (n for n in X_MATRICES if n in w):
        by_kind.setdefault(_storage_kind(w[name]), []).append(name)
    made = []
    for kind, names in by_kind.items():
        mats = [w[n] for n in names]
        if len(names) < 2 or (kind == "fp8" and any(m.shape[0] % FP8_WEIGHT_BLOCK for m in mats[:-1])):
            continue
        if kind == "fp8":
            stack = Fp8Weight(torch.cat([m.q for m in mats]), torch.cat([m.scale for m in mats]))
        else:
            stack = torch.cat(mats)
        start = 0
        for n, m in zip(names, mats):
            w[n] = _row_slice(stack, start, start + m.shape[0])
            start += m.shape[0]
        w[X_STACK + kind] = stack
        made.append(X_STACK + kind)
    return made


# Each compressor's two bf16 matrices (wkv, wgate) stacked into one, one GEMM a compressor instead of
# two (a C4 layer: two GEMMs and their split-K reductions fewer, a C128 layer one and one), each
# compressor's chain still on its own side stream (unlike ``STACK_X``, which forks after one GEMM
# of all seven). GPU models only, at construction (``V4Model._stack_compressor_matrices``); a
# GEMM of twice the columns may sum in another order (the bits within rounding). Opt-in: level at
# flash43's and flash8's batch-64 steps on an H100 (session 40, ``bench_decode --switches
# stack_compressor``): the compressors' chains are off the step's critical path.
STACK_COMPRESSOR = os.environ.get("SGLANG_DSV4_STACK_COMPRESSOR", "0") == "1"
COMPRESSORS = ("attn.compressor", "attn.indexer.compressor")
KV_GATE = ".wkv_wgate"  # + a compressor's prefix: its stacked [wkv; wgate]


def stack_compressor_matrices(w: dict[str, Tensor]) -> list[str]:
    """Stack each compressor's wkv and wgate (same dtype and shape, not fp8) into one matrix
    (prefix + ``KV_GATE``) and make their entries row views of it (no second copy) -> the
    stacks made."""
    made = []
    for prefix in COMPRESSORS:
        kv, gate = w.get(f"{prefix}.wkv.weight"), w.get(f"{prefix}.wgate.weight")
        if not (isinstance(kv, Tensor) and isinstance(gate, Tensor)) or kv.dtype != gate.dtype or kv.shape != gate.shape:
            continue
        stack, n = torch.cat((kv, gate)), kv.shape[0]
        w[f"{prefix}.wkv.weight"], w[f"{prefix}.wgate.weight"] = stack[:n], stack[n:]
        w[prefix + KV_GATE] = stack
        made.append(prefix + KV_GATE)
    return made


def has_x_stack(w: dict[str, Tensor]) -> bool:
    """Whether the layer ``w`` holds stacked input matrices (``stack_x_matrices``)."""
    return any(k.startswith(X_STACK) for k in w)


def x_projections(x: Tensor, w: dict[str, Tensor]) -> dict[str, Tensor]:
    """x [T, D] times each stacked matrix of the layer (``stack_x_matrices``): one GEMM a stack,
    its columns cut back into {matrix name: [T, rows]}. Empty where the layer has no stack.

    Not a compiled region: a GEMM with its input quantiser / cast has nothing for Inductor to
    fuse, and Dynamo failed building the guards of this function's dict of column views once
    the token count turned dynamic (H100, torch 2.11: "sources must not be empty for symbol")."""
    out: dict[str, Tensor] = {}
    for key in [k for k in w if k.startswith(X_STACK)]:
        y, start = linear(x, w[key]), 0
        for name in X_MATRICES:
            if name in w and X_STACK + _storage_kind(w[name]) == key:
                rows = w[name].shape[0]
                out[name], start = y[:, start:start + rows], start + rows
    return out


def _fp8_nope(kv: Tensor, cfg: V4Config) -> Tensor:
    nope = cfg.nope_head_dim
    return torch.cat((fp8_qat(kv[..., :nope], 64), kv[..., nope:]), dim=-1)


@on_gpu(rows={"o": (0,), "rope": (0,)})
def attention_output(o: Tensor, w: dict[str, Tensor], rope: Rope, cfg: V4Config,
                     dtype: torch.dtype | None = None) -> Tensor:
    """o: [T, H, Dh] -> [T, D]: inverse RoPE by the query position, grouped wo_a, then wo_b.
    ``dtype``: the activations' dtype, o's first (exact) cast: the kernel's bf16 output is
    widened inside this fused region rather than by a pass of its own."""
    o = apply_rope(o if dtype is None else o.to(dtype), rope, inverse=True)
    # the groups held here: all o_groups, or a tensor-parallel rank's share (core.parallel)
    wo_a = w["attn.wo_a.weight"]
    G = wo_a.shape[0] // cfg.o_lora_rank
    T = o.shape[0]
    o = pad_rows(o.reshape(T, G, -1))  # a per-group GEMM over the rows: padded like ``linear``
    if isinstance(wo_a, Fp8Weight):  # held fp8 (``fp8_linear.GROUPED_WO_A``): the einsum's bf16 product
        z = grouped_weight_only_linear(o, wo_a)[:T]
    else:
        wo_a = wo_a.view(G, cfg.o_lora_rank, -1)
        z = torch.einsum("tgd,grd->tgr", o.to(wo_a.dtype), wo_a).to(o.dtype)[:T]
    return linear(z.flatten(1), w["attn.wo_b.weight"])


def sparse_attention(q: Tensor, kv: Tensor, idx: Tensor, sink: Tensor, scale: float,
                     block: int = 256) -> Tensor:
    """Sink attention of each query over its own selected keys (§2.4).

    q: [T, H, Dh]; kv: [N, Dh] (K = V); idx: [T, K] rows of kv, -1 = masked; sink: [H].
    The sink adds exp(sink[h]) to the softmax denominator with a zero value vector.
    """
    out = torch.empty_like(q)
    for t0 in range(0, q.shape[0], block):  # bounds the [block, K, Dh] gather, not a loop over tokens
        ib = idx[t0:t0 + block]
        out[t0:t0 + block] = sink_attention(q[t0:t0 + block], kv[ib.clamp_min(0)], ib >= 0, sink, scale)
    return out


def sink_attention(q: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Sink attention of each query over its own gathered keys (K = V).

    q: [T, H, Dh]; keys: [T, K, Dh]; valid: [T, K] -> [T, H, Dh]. Each row's result depends only
    on its own query, keys and mask (per-token batched GEMMs).
    """
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(logits.dtype)
    probs = torch.softmax(torch.cat((logits, sink_col), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys)


def window_indices(positions: Tensor, window: int, first_pos: int) -> Tensor:
    """Row indices (into a buffer holding positions first_pos, first_pos+1, ...) of each query's
    window keys max(0, p-W+1)..p; -1 where the position would be negative. -> [T, W]."""
    key_pos = positions[:, None] - (window - 1) + torch.arange(window, device=positions.device)
    return torch.where(key_pos >= 0, key_pos - first_pos, -1)


# ---- compressor (§3) -----------------------------------------------------------------------

@on_gpu(rows={"x": (0,), "positions": (0,)})
def compressor_projections(x: Tensor, w: dict[str, Tensor], prefix: str, positions: Tensor
                           ) -> tuple[Tensor, Tensor]:
    """x: [T, D] -> (a [T, coff*d], s [T, coff*d]) in x's dtype; s includes ape[p mod r] (the
    reference's form: the serving step adds the bias in its entry kernels, ``compressor_gemms``)."""
    a, s = compressor_gemms(x, w, prefix)
    return a, with_position_bias(s, w[f"{prefix}.ape"], positions)


def compressor_gemms(x: Tensor, w: dict[str, Tensor], prefix: str, xa: Tensor | None = None,
                     xs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x: [T, D] times the compressor's wkv and wgate -> (a, s) [T, coff*d] in x's dtype, s
    before its position bias (``with_position_bias``). The serving step hands them to the entry
    kernels as they are: x in the matrices' dtype (``compressor_input``), the rows stay bf16 and
    the kernels widen them and add the bias on load, where casts and the bias add would be three
    launches of their own. ``xa``, ``xs``: computed already (``x_projections``); else one GEMM
    where the two matrices are stacked (``stack_compressor_matrices``: a, s column views)."""
    pair = w.get(prefix + KV_GATE)
    if xa is None and xs is None and pair is not None:
        y = linear(x, pair)
        n = y.shape[1] // 2
        return y[:, :n], y[:, n:]
    a = linear(x, w[f"{prefix}.wkv.weight"]) if xa is None else xa
    s = linear(x, w[f"{prefix}.wgate.weight"]) if xs is None else xs
    return a, s


def compressor_input(x: Tensor, w: dict[str, Tensor]) -> Tensor:
    """x [T, D] in the dtype of the layer's compressor matrices (the dtype their GEMMs run in):
    cast once for every compressor of the layer rather than by each of its GEMMs; x itself where
    the matrices are fp8 or the layer has no compressor."""
    m = w.get("attn.compressor.wkv.weight")
    return x.to(m.dtype) if isinstance(m, Tensor) and m.dtype != x.dtype else x


def with_position_bias(s: Tensor, ape: Tensor, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A compressor's gate rows s [T, coff*d] plus its position bias ``ape`` [ratio, coff*d] at
    each row's position mod ratio; s widened to ``dtype`` first (exact) where given."""
    return (s if dtype is None else s.to(dtype)) + ape[positions % ape.shape[0]]


def pool_c4(a: Tensor, s: Tensor) -> Tensor:
    """Overlapping ratio-4 pooling. a, s: [4*(m+1), 2d], rows of groups j0-1 .. j0+m-1 (group
    j0-1 may be padding: a = 0, s = -inf). -> pooled entries j0 .. j0+m-1, [m, d].

    Entry j softmax-pools, per channel, the A half (first d) of group j-1 and the B half of group j.
    """
    d2 = a.shape[1]
    a, s = a.view(-1, 4, d2), s.view(-1, 4, d2)
    return pool_c4_windows(torch.cat((a[:-1], a[1:]), dim=1), torch.cat((s[:-1], s[1:]), dim=1))


@on_gpu(rows={"a": (0,), "s": (0,)})
def pool_c4_windows(a: Tensor, s: Tensor) -> Tensor:
    """The entry each 8-row window completes: a, s [N, 8, 2d] = rows of groups j-1 and j -> [N, d].

    Per channel a softmax over the A half (first d) of group j-1's rows and the B half of group
    j's. The softmax runs over the last dim: CPU softmax over an inner dim changes its summation
    order with the batch size, which would make an entry depend on how its sequence was chunked.
    """
    d = a.shape[2] // 2
    a = torch.cat((a[:, :4, :d], a[:, 4:, d:]), dim=1).transpose(1, 2).contiguous()
    s = torch.cat((s[:, :4, :d], s[:, 4:, d:]), dim=1).transpose(1, 2).contiguous()
    return (torch.softmax(s, dim=-1) * a).sum(-1)


def c4_entries(a: Tensor, s: Tensor, state_a: Tensor, state_s: Tensor, slots: Tensor, idx: Tensor,
               dst: tuple[Tensor, Tensor], w: dict[str, Tensor], prefix: str, rope: Rope, cfg: V4Config,
               is_indexer: bool, quant_sim: bool, positions: Tensor | None = None) -> Tensor:
    """``c4_entries_torch``; opted in on the GPU, two Triton launches (``kernels.c4_entries``)
    instead of the fused region's ~9 kernels. Decided here, outside the compiled region.
    ``positions`` [T]: s is ``compressor_gemms``' (before its bias; the bias ``{prefix}.ape`` is
    added here, at these positions); None: s has it already."""
    ape = None if positions is None else w[f"{prefix}.ape"]
    if c4_entries_kernel.supported(a, s, state_a, state_s, idx, rope, cfg, is_indexer, ape, positions):
        return c4_entries_kernel.c4_entries(a, s, state_a, state_s, slots, idx, dst, w[f"{prefix}.norm.weight"],
                                            rope, cfg, is_indexer, quant_sim, ape=ape, positions=positions)
    return c4_entries_torch(a, s, state_a, state_s, slots, idx, dst, w, prefix, rope, cfg, is_indexer, quant_sim,
                            positions)


@on_gpu(rows={"a": (0,), "s": (0,), "slots": (0,), "idx": (0,), "dst": (0,), "rope": (0,), "positions": (0,)})
def c4_entries_torch(a: Tensor, s: Tensor, state_a: Tensor, state_s: Tensor, slots: Tensor, idx: Tensor,
                     dst: tuple[Tensor, Tensor], w: dict[str, Tensor], prefix: str, rope: Rope, cfg: V4Config,
                     is_indexer: bool, quant_sim: bool, positions: Tensor | None = None) -> Tensor:
    """The C4 entry each token's 8-row window completes, finished (``finish_entries``) -> [T, d].

    The window's rows come from [the step's requests' rows of this layer's slot states
    ``state_*`` [slots, 8, 2d] (``slots`` [B]: B * 8 rows); the chunk's rows a, s (T); a padding
    row (a 0, s -inf)], ``idx`` [T, 8] indexing that concatenation; a token at position p pools
    positions p-7..p, the group's first token p - 3 (``rope``: each token's rotation at p - 3).
    Then the states take the chunk's rows in place at ``dst`` (slot, row) (each request's last 8
    positions; the scratch slot the others). One fused region on the GPU, the writes included.
    ``positions``: as ``c4_entries``'s (the rows widened to the states' dtype, the bias added)."""
    if positions is not None:
        a, s = a.to(state_a.dtype), with_position_bias(s, w[f"{prefix}.ape"], positions, state_s.dtype)
    d2 = a.shape[1]
    prev_a, prev_s = state_a[slots].reshape(-1, d2), state_s[slots].reshape(-1, d2)
    src_a = torch.cat((prev_a, a, a.new_zeros(1, d2)))
    src_s = torch.cat((prev_s, s, s.new_full((1, d2), float("-inf"))))
    pooled = pool_c4_windows(src_a[idx], src_s[idx])
    entries = finish_entries(pooled, w, prefix, rope, cfg, is_indexer, quant_sim)
    state_a[dst] = a
    state_s[dst] = s
    return entries


def online_softmax_pool(a: Tensor, s: Tensor, tok: Tensor, state: Tensor, width: int) -> Tensor:
    """Sequential online-softmax pooling of groups: ``state`` [G, 3, d] (running max, sum,
    weighted sum) absorbs, position by position, rows ``a[tok[g, i]]``, ``s[tok[g, i]]`` for
    i < width (tok -1: no row). -> the new state [G, 3, d].

    One fixed order (position by position) whatever the chunking, so a group's pooled value does
    not depend on where a prefill chunk started inside it. Opted in on the GPU: one launch for
    all positions (``kernels.c128_pool``) instead of one region per position."""
    if c128_pool.preferred(a, s, state):
        return c128_pool.pool(a, s, tok, state, width)
    m, total, acc = state.unbind(1)
    for i in range(width):
        m, total, acc = _absorb_position(m, total, acc, a, s, tok[:, i])
    return torch.stack((m, total, acc), dim=1)


@on_gpu(rows={"m": (0,), "total": (0,), "acc": (0,), "a": (0,), "s": (0,), "t": (0,)})
def _absorb_position(m: Tensor, total: Tensor, acc: Tensor, a: Tensor, s: Tensor, t: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """One step of ``online_softmax_pool``: each group's state [G, d] x3 absorbs row t[g] of a, s
    (t -1: none). One fused region on the GPU, compiled once for every position of the loop."""
    valid = (t >= 0).unsqueeze(1)
    ai, si = a[t.clamp_min(0)], s[t.clamp_min(0)]
    m_new = torch.maximum(m, si)
    c_old, c_new = torch.exp(m - m_new), torch.exp(si - m_new)
    total = torch.where(valid, total * c_old + c_new, total)
    acc = torch.where(valid, acc * c_old + ai * c_new, acc)
    return torch.where(valid, m_new, m), total, acc


def _empty_pool_state(like: Tensor) -> Tensor:
    """A group's online-softmax state before its first row [3, d]: (max -inf, sum 0, weighted 0)."""
    d = like.shape[1]
    return torch.stack((like.new_full((d,), float("-inf")), like.new_zeros(d), like.new_zeros(d)))


@on_gpu(rows={"carry": (0,), "slots": (0,)})
def c128_start(carry: Tensor, slots: Tensor, state: Tensor, a: Tensor) -> Tensor:
    """Each segment's online-softmax state before its rows [G, 3, d]: its slot's carried state
    in this layer's ``state`` [slots, 3, d] where the segment continues a group, else empty."""
    return torch.where(carry[:, None, None], state[slots], _empty_pool_state(a))


def c128_entries(a: Tensor, s: Tensor, tok: Tensor, width: int, carry: Tensor, slots: Tensor, state: Tensor,
                 completes: Tensor, store_slot: Tensor, w: dict[str, Tensor], rope: Rope, cfg: V4Config,
                 quant_sim: bool, positions: Tensor | None = None) -> Tensor:
    """A ratio-128 layer's segments -> their finished entries [G, d], the slots' states updated in
    place: ``online_softmax_pool`` from ``c128_start``, then ``c128_finish``. Opted in on the GPU,
    two Triton launches (``kernels.c128_pool.entries``) instead of ~9 kernels. Decided here,
    outside the compiled regions. ``positions`` [T]: s is ``compressor_gemms``' (before its bias,
    added here at these positions; a and s widened to the state's dtype); None: s has it already."""
    ape = None if positions is None else w["attn.compressor.ape"]
    if c128_pool.entries_supported(a, s, state, rope, cfg, ape, positions):
        return c128_pool.entries(a, s, tok, carry, slots, state, completes, store_slot, width,
                                 w["attn.compressor.norm.weight"], rope, cfg, quant_sim, ape=ape, positions=positions)
    if positions is not None:
        a, s = a.to(state.dtype), with_position_bias(s, ape, positions, state.dtype)
    run = online_softmax_pool(a, s, tok, c128_start(carry, slots, state, a), width)
    return c128_finish(run, completes, state, store_slot, w, rope, cfg, quant_sim)


@on_gpu(rows={"run": (0,), "completes": (0,), "store_slot": (0,), "rope": (0,)})
def c128_finish(run: Tensor, completes: Tensor, state: Tensor, store_slot: Tensor, w: dict[str, Tensor],
                rope: Rope, cfg: V4Config, quant_sim: bool) -> Tensor:
    """Each segment's state after its rows [G, 3, d] -> its pooled entry, finished, [G, d]
    (meaningful where it completed its group); the state its slot keeps (empty where the group
    completed) goes in place to row ``store_slot`` of this layer's ``state`` [slots, 3, d].
    ``rope``: each segment's rotation at its group's first position."""
    state[store_slot] = torch.where(completes[:, None, None], _empty_pool_state(run[:, 0]), run)
    pooled = run[:, 2] / run[:, 1]
    return finish_entries(pooled, w, "attn.compressor", rope, cfg, False, quant_sim)


@on_gpu(rows={"pooled": (0,), "rope": (0,)})
def finish_entries(pooled: Tensor, w: dict[str, Tensor], prefix: str, rope: Rope, cfg: V4Config,
                   is_indexer: bool, quant_sim: bool) -> Tensor:
    """Pooled [N, d] -> compressed entries: norm, RoPE at the group's first token (``rope``),
    then FP8 (main) or Hadamard + FP4 (indexer)."""
    c = rms_norm(pooled, w[f"{prefix}.norm.weight"], cfg.rms_norm_eps)
    c = apply_rope(c, rope)
    if is_indexer:
        c = hadamard(c)
        return fp4_qat(c, 32) if quant_sim else c
    return _fp8_nope(c, cfg) if quant_sim else c


# ---- lightning indexer (§4) ----------------------------------------------------------------

@on_gpu(rows={"x": (0,), "qr": (0,), "rope": (0,), "qr_act": (0,)})
def indexer_queries(x: Tensor, qr: Tensor, w: dict[str, Tensor], rope: Rope, cfg: V4Config,
                    quant_sim: bool, xw: Tensor | None = None, qr_act: Fp8Act | None = None) -> tuple[Tensor, Tensor]:
    """-> (qI [T, Hi, Di] rotated, Hadamard'ed, FP4; head weights [T, Hi]). ``xw``: x @
    weights_proj.T computed already (``x_projections``); ``qr_act``: qr's fp8 operands
    (``project_q``'s)."""
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    qi = linear(qr, w["attn.indexer.wq_b.weight"], qr_act).view(-1, Hi, Di)
    qi = hadamard(apply_rope(qi, rope))
    if quant_sim:
        qi = fp4_qat(qi, 32)
    xw = linear(x, w["attn.indexer.weights_proj.weight"]) if xw is None else xw
    weights = xw * (Di**-0.5 * Hi**-0.5)
    return qi, weights


def indexer_scores(qi: Tensor, head_weights: Tensor, keys: Tensor) -> Tensor:
    """score[t, j] = sum_h w[t, h] * relu(<qI[t, h], K[j]>). keys: [N, Di] -> [T, N]."""
    return torch.einsum("th,thn->tn", head_weights, F.relu(torch.einsum("thd,nd->thn", qi, keys)))


@on_gpu(rows={"qi": (0, 1), "head_weights": (0, 1), "keys": (0,)}, widths={"keys": (1,)})
def batched_indexer_scores(qi: Tensor, head_weights: Tensor, keys: Tensor, exact: bool = False) -> Tensor:
    """Per request: qi [B, L, Hi, Di], head weights [B, L, Hi], its keys [B, N, Di] -> [B, L, N].

    The head sum is a plain reduction over Hi (not a per-row GEMM), so a row's score does not
    depend on the rows or requests batched with it. ``exact`` (the deterministic mode, the CPU) takes
    the dot products in float64: qi and the keys are fp4 values times power-of-two scales after
    V4's QAT, so every product and partial sum is exact in float64 and the dot does not depend
    on the summation order the GEMM kernel (chosen by shape on a GPU) happens to use."""
    B, L, Hi, Di = qi.shape
    if exact:
        dots = torch.bmm(qi.reshape(B, L * Hi, Di).double(), keys.transpose(1, 2).double())
        dots = dots.to(qi.dtype).view(B, L, Hi, -1)
    else:
        dots = torch.bmm(qi.reshape(B, L * Hi, Di), keys.transpose(1, 2)).view(B, L, Hi, -1)
    return (head_weights.unsqueeze(-1) * F.relu(dots)).sum(2)


@on_gpu(rows={"scores": (0,), "num_visible": (0,)}, widths={"scores": (1,)})
def select_topk(scores: Tensor, num_visible: Tensor, k: int) -> Tensor:
    """Top-min(k, visible) entries per row among j < num_visible[t]; -1 pads. -> [T, k].

    Ties break toward the lower entry index (stable sort), so the choice does not depend on how
    many invisible entries a row carries. float32 scores take one top-k over unique integer keys
    (``_stable_topk``: the same entries in the same order, a few kernels on a GPU where the
    stable sort of the whole row is a dozen); other dtypes the sort itself.
    """
    if topk_kernel.preferred(scores, k):  # the GPU: one launch a pass (kernels/topk.py), the same columns
        return topk_kernel.select_topk_rows(scores, num_visible, k)
    return select_topk_torch(scores, num_visible, k)


def select_topk_torch(scores: Tensor, num_visible: Tensor, k: int) -> Tensor:
    """``select_topk`` in torch ops (the CPU; the reference of ``kernels.topk``)."""
    n = scores.shape[1]
    j = torch.arange(n, device=scores.device)
    visible = j[None, :] < num_visible[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    if masked.dtype == torch.float32:
        order = _stable_topk(masked, min(k, n))
    else:
        order = _sorted_topk(masked, k)
    keep = torch.arange(order.shape[1], device=scores.device)[None, :] < num_visible[:, None]
    order = torch.where(keep, order, -1)
    if order.shape[1] < k:
        order = F.pad(order, (0, k - order.shape[1]), value=-1)
    return order


def _sorted_topk(x: Tensor, k: int) -> Tensor:
    """The first k (at most) columns of each row in a stable descending sort: the definition."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def _stable_topk(x: Tensor, k: int) -> Tensor:
    """``_sorted_topk`` of float32 rows by ``torch.topk`` over unique int64 keys: the value's
    bits made order-preserving in the high half (negative floats' magnitude bits flipped; -0 taken
    as +0, which the sort ranks equal), n - 1 - column in the low half (ties: lower column
    first). The keys are distinct, so the top-k and its order are exactly the sort's."""
    n = x.shape[1]
    bits = torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (key.to(torch.int64) << 32) + (n - 1 - torch.arange(n, device=x.device))
    return torch.topk(packed, k, dim=-1).indices


# ---- MoE (§6) ------------------------------------------------------------------------------

def _folded_stack(w: dict[str, Tensor]):
    """The layer's fp8 expert stack where the shared expert is folded into it, else None."""
    stack = w.get(FP8_EXPERTS)
    return stack if stack is not None and stack.shared else None


def separate_shared_expert(w: dict[str, Tensor], cfg: V4Config) -> bool:
    """Whether ``moe`` computes a shared expert apart from the routed ones (not folded into the
    fp8 expert stack): ``routed_experts + shared_expert``, two independent chains."""
    return bool(cfg.n_shared_experts) and _folded_stack(w) is None


def moe(x: Tensor, token_ids: Tensor, w: dict[str, Tensor], cfg: V4Config, hash_routed: bool,
        act: Fp8Act | None = None) -> Tensor:
    """x: [T, D] -> routed experts (sqrtsoftplus gate) + shared expert. Where the shared expert
    is folded into the layer's fp8 expert stack (``stack_experts(fold_shared=True)``), one grouped
    pass computes both: each token routes one more slot, gate 1, to it. ``act``: x's fp8
    operands (``linear``)."""
    stack = _folded_stack(w)
    if stack is not None:
        chosen, gates = _route(x, token_ids, w, cfg, hash_routed, shared_slot=cfg.n_routed_experts)
        return fp8_grouped_experts(x, chosen, gates, stack, 0, cfg.swiglu_limit, act)
    out = routed_experts(x, token_ids, w, cfg, hash_routed, act=act)
    return shared_expert(x, w, cfg, plus=out, act=act) if cfg.n_shared_experts else out


def routed_experts(x: Tensor, token_ids: Tensor, w: dict[str, Tensor], cfg: V4Config, hash_routed: bool,
                   experts: range | None = None, act: Fp8Act | None = None) -> Tensor:
    """Sum of the gated routed-expert outputs of each token, [T, D].

    ``experts`` (default: all) limits the sum to the experts held here; routing is decided over
    all experts, so the sums of disjoint ranges add up to the full one (expert parallelism).
    ``act``: x's fp8 operands (``linear``).
    """
    chosen, gates = _route(x, token_ids, w, cfg, hash_routed)
    local = experts if experts is not None else range(cfg.n_routed_experts)
    return grouped_experts(x, chosen, gates, w, cfg, local, act)


def _route(x: Tensor, token_ids: Tensor, w: dict[str, Tensor], cfg: V4Config, hash_routed: bool,
           shared_slot: int | None = None) -> tuple[Tensor, Tensor]:
    """``route_tokens`` with the layer's bias, or its token -> experts table (hash-routed)."""
    bias_or_chosen = w["ffn.gate.tid2eid"][token_ids] if hash_routed else w["ffn.gate.bias"]
    if shared_slot is None and route_kernel.preferred(x, w["ffn.gate.weight"], cfg.num_experts_per_tok):
        # the GEMM as the region has it, then one launch for the rest (kernels/route.py)
        return route_kernel.route_from_logits(linear(x, w["ffn.gate.weight"]), bias_or_chosen,
                                              cfg.num_experts_per_tok, cfg.routed_scaling_factor)
    return route_tokens(x, w["ffn.gate.weight"], bias_or_chosen, cfg, shared_slot)


@on_gpu(rows={"x": (0,), "bias_or_chosen": (-2,)})
def route_tokens(x: Tensor, gate: Tensor, bias_or_chosen: Tensor, cfg: V4Config,
                 shared_slot: int | None = None) -> tuple[Tensor, Tensor]:
    """-> (chosen experts [T, k], gate weights [T, k]): sqrt-softplus scores; top-k of scores +
    bias, or (hash-routed layers: an integer ``bias_or_chosen``) the token's fixed experts.
    ``shared_slot``: a last column (k + 1) routing every token to that expert index with gate 1
    (the shared expert folded into the expert stack)."""
    scores = torch.sqrt(F.softplus(linear(x, gate)))
    if bias_or_chosen.is_floating_point():
        chosen = torch.topk(scores + bias_or_chosen, cfg.num_experts_per_tok, dim=-1).indices
    else:
        chosen = bias_or_chosen.long()
    gates = scores.gather(1, chosen)
    gates = gates / gates.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    if shared_slot is not None:
        chosen = torch.cat((chosen, torch.full_like(chosen[:, :1], shared_slot)), 1)
        gates = torch.cat((gates, torch.ones_like(gates[:, :1])), 1)
    return chosen, gates


def grouped_experts(x: Tensor, chosen: Tensor, gates: Tensor, w: dict[str, Tensor], cfg: V4Config,
                    experts: range, act: Fp8Act | None = None) -> Tensor:
    """sum_k gates[t, k] * expert_{chosen[t, k]}(x[t]) over the experts held here, [T, D].

    With stacked bf16 expert matrices on a GPU (``stack_experts``): two grouped GEMMs, no host
    sync (``_grouped_experts_mm``). Otherwise (the CPU path) the (token, slot) pairs are sorted
    by expert once; each expert runs one GEMM over its rows (padded like ``linear``), and the
    outputs are added per token in expert order. Either way a token's result depends only on its
    own row and routing, not on the other tokens of the batch.
    """
    if FP8_EXPERTS in w and x.is_cuda:  # fp8 weight mode: the grouped fp8 GEMMs, any EP share
        return fp8_grouped_experts(x, chosen, gates, w[FP8_EXPERTS], experts.start, cfg.swiglu_limit, act)
    # the grouped path holds every expert: an expert-parallel share (EP) takes the loop for now (on
    # the H200 the grouped GEMMs over a share dropped some tokens' outputs: not yet understood)
    if STACKED_W13 in w and x.is_cuda and len(experts) == cfg.n_routed_experts:
        return _grouped_experts_mm(x, chosen, gates, w[STACKED_W13], w[STACKED_W2], experts, cfg.swiglu_limit)
    return _sorted_experts(x, chosen, gates, w, cfg, experts)


STACKED_W13, STACKED_W2 = "ffn.experts.w13", "ffn.experts.w2"  # [E_local, 2I, D], [E_local, D, I]
FP8_EXPERTS = "ffn.experts.fp8"  # kernels.fp8_moe.Fp8Experts: the stacked fp8 experts
GROUP_ALIGN = 16  # rows per expert group are padded to this for the grouped GEMM


SHARED_EXPERT = "ffn.shared_experts"


def stack_experts(w: dict[str, Tensor], experts: range, fold_shared: bool = False) -> None:
    """Give a layer's weights the stacked expert matrices the grouped GEMM reads, and make the
    per-expert entries views of them (no second copy). fp8 experts (``Fp8Weight``) stack into
    one ``Fp8Experts`` entry (``FP8_EXPERTS``); with ``fold_shared`` (fp8 only; the caller's
    experts are all of them, one process or tensor parallelism: ``moe`` then routes every token
    to it) the layer's shared expert joins the stack last and its entries become views too."""
    if isinstance(w[f"ffn.experts.{experts.start}.w1.weight"], Fp8Weight):
        names = [[f"ffn.experts.{e}.{m}.weight" for e in experts] for m in ("w1", "w3", "w2")]
        shared_names = [f"{SHARED_EXPERT}.{m}.weight" for m in ("w1", "w3", "w2")]
        shared = None
        if fold_shared and all(n in w for n in shared_names):
            shared = tuple(w[n] for n in shared_names)
        stack, views = stack_fp8_experts(*[[w.pop(n) for n in ns] for ns in names], shared=shared)
        for i, e in enumerate(experts):
            for m, view in zip(("w1", "w3", "w2"), views[i]):
                w[f"ffn.experts.{e}.{m}.weight"] = view
        if shared is not None:
            for n, view in zip(shared_names, views[-1]):
                w[n] = view
        w[FP8_EXPERTS] = stack
        return
    w13 = torch.stack([torch.cat((w[f"ffn.experts.{e}.w1.weight"], w[f"ffn.experts.{e}.w3.weight"]))
                       for e in experts])
    w2 = torch.stack([w[f"ffn.experts.{e}.w2.weight"] for e in experts])
    inter = w13.shape[1] // 2
    for i, e in enumerate(experts):
        w[f"ffn.experts.{e}.w1.weight"], w[f"ffn.experts.{e}.w3.weight"] = w13[i, :inter], w13[i, inter:]
        w[f"ffn.experts.{e}.w2.weight"] = w2[i]
    w[STACKED_W13], w[STACKED_W2] = w13, w2


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here (bf16 on SM90+)."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _grouped_experts_mm(x: Tensor, chosen: Tensor, gates: Tensor, w13: Tensor, w2: Tensor, experts: range,
                        limit: float) -> Tensor:
    """The routed experts as two ``torch._grouped_mm`` calls over expert-sorted rows.

    Shapes depend only on T, k and the number of local experts (host values): each expert's rows
    are padded to GROUP_ALIGN inside a buffer of fixed size, so there is no host sync and no
    data-dependent allocation. Pairs routed to other ranks' experts go to a dropped row.
    """
    T, k = chosen.shape
    E, P, A = w13.shape[0], chosen.numel(), GROUP_ALIGN
    M = P + min(P, E) * (A - 1)        # room for every group's padding
    dev = x.device
    rows = expert_rows(chosen, experts.start, E, A, M)
    ends, pair_of_row = rows.ends, rows.pair_of_row
    xs = torch.cat((x, x.new_zeros(1, x.shape[1])))[torch.where(pair_of_row < P, pair_of_row // k, T)]
    offs = ends.to(torch.int32)
    h = torch._grouped_mm(xs.to(w13.dtype), w13.transpose(-2, -1), offs=offs).to(x.dtype)
    g, u = h.chunk(2, dim=-1)
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    gate_of_row = torch.cat((gates.flatten(), gates.new_zeros(1)))[pair_of_row]
    y = (F.silu(g) * u) * gate_of_row[:, None]
    out = torch._grouped_mm(y.to(w2.dtype), w2.transpose(-2, -1), offs=offs).to(x.dtype)
    # rows past the last group are not computed: their pair index is the dropped P
    pairs = x.new_zeros(P + 1, x.shape[1])
    pairs[torch.where(torch.arange(M, device=dev) < ends[-1], pair_of_row, P)] = out
    return pairs[:P].view(T, k, -1).sum(1)  # k-sum in slot order: deterministic


def _sorted_experts(x: Tensor, chosen: Tensor, gates: Tensor, w: dict[str, Tensor], cfg: V4Config,
                    experts: range) -> Tensor:
    T, k = chosen.shape
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cfg.n_routed_experts).tolist()  # host: the CPU path
    rows = order // k
    out = torch.zeros_like(x)
    first = 0
    for e, n in enumerate(counts):
        if n and e in experts:
            r = rows[first:first + n]
            p = f"ffn.experts.{e}"
            # rows padded like the step's tokens: no row falls in a vector loop's scalar tail
            xr, g = pad_rows(x[r], CPU_TOKEN_TILE), pad_rows(gates.flatten()[order[first:first + n]], CPU_TOKEN_TILE)
            y = _swiglu(xr, w[f"{p}.w1.weight"], w[f"{p}.w3.weight"], cfg.swiglu_limit, g)
            out.index_add_(0, r, linear(y, w[f"{p}.w2.weight"])[:n])
        first += n
    return out


@on_gpu(rows={"x": (0,), "plus": (0,), "act": (0,)})
def shared_expert(x: Tensor, w: dict[str, Tensor], cfg: V4Config, plus: Tensor | None = None,
                  act: Fp8Act | None = None) -> Tensor:
    """The shared expert's output, [T, D] (V4 has one; callers check ``n_shared_experts``);
    ``plus + `` it with ``plus`` (the routed experts' sum: the add joins the region's last kernel).
    ``act``: x's fp8 operands (``linear``)."""
    p = SHARED_EXPERT
    y = _swiglu(x, w[f"{p}.w1.weight"], w[f"{p}.w3.weight"], cfg.swiglu_limit, None, act)
    out = linear(y, w[f"{p}.w2.weight"])
    return out if plus is None else plus + out


def _swiglu(x: Tensor, w1: Tensor, w3: Tensor, limit: float, gate: Tensor | None,
            act: Fp8Act | None = None) -> Tensor:
    g, u = linear(x, w1, act), linear(x, w3, act)
    if limit > 0:  # swiglu_limit 0 means no clamp
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    h = F.silu(g) * u
    return h * gate.unsqueeze(-1) if gate is not None else h


def mtp_input(h_main: Tensor, next_ids: Tensor, embed: Tensor, w: dict[str, Tensor], cfg: V4Config) -> Tensor:
    """MTP block input streams (§7): e_proj(enorm(embed(t+1))) + h_proj(hnorm(h_main)). -> [T, hc, D]."""
    e = rms_norm(embed[next_ids].to(h_main.dtype), w["enorm.weight"], cfg.rms_norm_eps)
    hn = rms_norm(h_main, w["hnorm.weight"], cfg.rms_norm_eps)
    return linear(e, w["e_proj.weight"]).unsqueeze(1) + linear(hn, w["h_proj.weight"])


def layer_view(weights: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The tensors under ``prefix.`` with the prefix stripped."""
    cut = len(prefix) + 1
    return {k[cut:]: v for k, v in weights.items() if k.startswith(prefix + ".")}


def check_finite(x: Tensor, what: str) -> None:
    if not torch.isfinite(x).all():
        raise FloatingPointError(f"non-finite values in {what}")


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "math")]
