"""The Triton kernels of ``hc_boundary.post_pre`` (imported on first use, as ``c4_entries_triton``),
for V4's four streams.

Launch 1 (``post_mix_kernel``), a program per (16-token block, slice of the hidden dims): the
sublayer output expanded into the streams (``ops.hc_post``, where there is one) and that slice's
share of the next mixes' dot products and of the streams' Gram matrix. Launch 2
(``pre_finish_kernel``), a program per (token, block of dims): the slices' partials summed in
slice order, the RMS scale, the split and the Sinkhorn of ``ops.hc_split_torch``, then that block
of the streams' weighted sum RMS-normed (``hc_weighted_norm``), its mean square from the Gram
matrix.

Each row's arithmetic depends on the hidden width alone (the slices, the dot's K tiles, a fixed
block of 16 rows, the blocks of dims), never on how many rows the batch holds: a row is the same
bits alone or in any batch, as the chunk-invariance contract asks. The mixes' dot products take
a ``tl.dot`` at ``PRECISION`` ("tf32x3": three TF32 tensor-core products, fp32-level error,
SGLang's choice for the same dot; "ieee": Triton's FMA dot, 31.1 us a boundary against 21.3 at
batch 1 on an H100, session 36) or, with ``PRECISION`` "fma" (``hc_boundary.FMA_MIX``), fp32 FMAs
a column at a time reduced over the tile's dims (``_mix_fma``). The dot's operands (each split
for TF32x3, four streams' worth) spill: 255 registers a thread and 284K local-memory requests a
launch at batch 64 (ncu, H100, session 41); the column FMAs hold the tiles and one column's
products.
"""

import triton
import triton.language as tl

from .fp8_bits_triton import e4m3_groups, exp2_int
from .pdl_triton import await_predecessor


@triton.jit
def _expanded(k: tl.constexpr, f, h0, h1, h2, h3, Post, Comb, HNew, rows, row_ok, d, ok, D: tl.constexpr):
    """Stream k's tile after the post, p_k f + sum_j comb[j, k] h_j (in stream order), stored to
    HNew; the four streams' tiles are loaded once for all four outputs."""
    c0 = tl.load(Comb + rows * 16 + 0 * 4 + k, mask=row_ok, other=0.0)
    c1 = tl.load(Comb + rows * 16 + 1 * 4 + k, mask=row_ok, other=0.0)
    c2 = tl.load(Comb + rows * 16 + 2 * 4 + k, mask=row_ok, other=0.0)
    c3 = tl.load(Comb + rows * 16 + 3 * 4 + k, mask=row_ok, other=0.0)
    mix = c0[:, None] * h0
    mix = mix + c1[:, None] * h1
    mix = mix + c2[:, None] * h2
    mix = mix + c3[:, None] * h3
    p = tl.load(Post + rows * 4 + k, mask=row_ok, other=0.0)
    hk = p[:, None] * f + mix
    tl.store(HNew + (rows[:, None] * 4 + k) * D + d[None, :], hk, mask=ok)
    return hk


@triton.jit
def _mix_dot(hk, Fn, k: tl.constexpr, cols, col_ok, d, d_ok, fn_stride, D: tl.constexpr,
             PRECISION: tl.constexpr):
    fn = tl.load(Fn + cols[None, :] * fn_stride + (k * D + d)[:, None],
                 mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    return tl.dot(hk, fn, input_precision=PRECISION)


@triton.jit
def _mix_fma(h0, h1, h2, h3, Fn, cols, d, d_ok, fn_stride, D: tl.constexpr, MIX: tl.constexpr,
             BLOCK_M: tl.constexpr, MIX_PAD: tl.constexpr):
    """The tile's share of the mixes in fp32 FMAs, a column at a time (``PRECISION`` "fma"): per
    row, the four streams' products summed per dim (in stream order), then over the tile's dims;
    no dot operands to hold, so few registers."""
    out = tl.zeros([BLOCK_M, MIX_PAD], dtype=tl.float32)
    for c in tl.static_range(MIX):
        row = Fn + c * fn_stride + d
        p = h0 * tl.load(row, mask=d_ok, other=0.0)[None, :]
        p = p + h1 * tl.load(row + D, mask=d_ok, other=0.0)[None, :]
        p = p + h2 * tl.load(row + 2 * D, mask=d_ok, other=0.0)[None, :]
        p = p + h3 * tl.load(row + 3 * D, mask=d_ok, other=0.0)[None, :]
        out += tl.where(cols[None, :] == c, tl.sum(p, axis=1)[:, None], 0.0)
    return out


@triton.jit
def post_mix_kernel(F, FPlus, H, Post, Comb, HNew, Fn, PartMix, PartGram,
                    T, f_stride, fp_stride, fn_stride,
                    D: tl.constexpr, MIX: tl.constexpr, MIX_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D_BLOCKS: tl.constexpr,
                    POST: tl.constexpr, PLUS: tl.constexpr, PRECISION: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Program (m, s): rows m * BLOCK_M.. and dims s * D_BLOCKS * BLOCK_D.. of each of the four streams.

    With POST: h'[t, k] = Post[t, k] * (F[t] (+ FPlus[t])) + sum_j Comb[t, j, k] H[t, j] (the sum in
    stream order), stored to HNew [T, 4, D]; without: h' = H (nothing stored). Then over the
    program's dims: PartMix[s, t, :] = sum_{k, d} h'[t, k, d] Fn[:, k * D + d] and the Gram matrix
    PartGram[s, t, 4 i + j] = sum_d h'[t, i, d] h'[t, j, d]: its trace is the streams' sum of
    squares, and the norm of any weighted sum of the streams follows from it, so launch 2 need not
    see a whole row. H [T, 4, D] contiguous; Post [T, 4], Comb [T, 4, 4] contiguous fp32; Fn
    [MIX, 4 * D] fp32 with unit column stride."""
    await_predecessor(PDL)
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    cols = tl.arange(0, MIX_PAD)
    col_ok = cols < MIX
    acc = tl.zeros([BLOCK_M, MIX_PAD], dtype=tl.float32)
    g00 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g01 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g02 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g03 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g11 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g12 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g13 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g22 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g23 = tl.zeros([BLOCK_M], dtype=tl.float32)
    g33 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for b in tl.static_range(D_BLOCKS):
        d = (pid_s * D_BLOCKS + b) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        ok = row_ok[:, None] & d_ok[None, :]
        h0 = tl.load(H + (rows[:, None] * 4 + 0) * D + d[None, :], mask=ok, other=0.0)
        h1 = tl.load(H + (rows[:, None] * 4 + 1) * D + d[None, :], mask=ok, other=0.0)
        h2 = tl.load(H + (rows[:, None] * 4 + 2) * D + d[None, :], mask=ok, other=0.0)
        h3 = tl.load(H + (rows[:, None] * 4 + 3) * D + d[None, :], mask=ok, other=0.0)
        if POST:
            f = tl.load(F + rows[:, None] * f_stride + d[None, :], mask=ok, other=0.0).to(tl.float32)
            if PLUS:
                f = f + tl.load(FPlus + rows[:, None] * fp_stride + d[None, :], mask=ok, other=0.0).to(tl.float32)
            e0 = _expanded(0, f, h0, h1, h2, h3, Post, Comb, HNew, rows, row_ok, d, ok, D)
            e1 = _expanded(1, f, h0, h1, h2, h3, Post, Comb, HNew, rows, row_ok, d, ok, D)
            e2 = _expanded(2, f, h0, h1, h2, h3, Post, Comb, HNew, rows, row_ok, d, ok, D)
            e3 = _expanded(3, f, h0, h1, h2, h3, Post, Comb, HNew, rows, row_ok, d, ok, D)
            h0, h1, h2, h3 = e0, e1, e2, e3
        if PRECISION == "fma":
            acc += _mix_fma(h0, h1, h2, h3, Fn, cols, d, d_ok, fn_stride, D, MIX, BLOCK_M, MIX_PAD)
        else:
            acc += _mix_dot(h0, Fn, 0, cols, col_ok, d, d_ok, fn_stride, D, PRECISION)
            acc += _mix_dot(h1, Fn, 1, cols, col_ok, d, d_ok, fn_stride, D, PRECISION)
            acc += _mix_dot(h2, Fn, 2, cols, col_ok, d, d_ok, fn_stride, D, PRECISION)
            acc += _mix_dot(h3, Fn, 3, cols, col_ok, d, d_ok, fn_stride, D, PRECISION)
        g00 += tl.sum(h0 * h0, axis=1)
        g01 += tl.sum(h0 * h1, axis=1)
        g02 += tl.sum(h0 * h2, axis=1)
        g03 += tl.sum(h0 * h3, axis=1)
        g11 += tl.sum(h1 * h1, axis=1)
        g12 += tl.sum(h1 * h2, axis=1)
        g13 += tl.sum(h1 * h3, axis=1)
        g22 += tl.sum(h2 * h2, axis=1)
        g23 += tl.sum(h2 * h3, axis=1)
        g33 += tl.sum(h3 * h3, axis=1)
    tl.store(PartMix + (pid_s * T + rows[:, None]) * MIX + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])
    gram = PartGram + (pid_s * T + rows) * 16
    tl.store(gram + 0, g00, mask=row_ok)
    tl.store(gram + 1, g01, mask=row_ok)
    tl.store(gram + 2, g02, mask=row_ok)
    tl.store(gram + 3, g03, mask=row_ok)
    tl.store(gram + 4, g01, mask=row_ok)
    tl.store(gram + 5, g11, mask=row_ok)
    tl.store(gram + 6, g12, mask=row_ok)
    tl.store(gram + 7, g13, mask=row_ok)
    tl.store(gram + 8, g02, mask=row_ok)
    tl.store(gram + 9, g12, mask=row_ok)
    tl.store(gram + 10, g22, mask=row_ok)
    tl.store(gram + 11, g23, mask=row_ok)
    tl.store(gram + 12, g03, mask=row_ok)
    tl.store(gram + 13, g13, mask=row_ok)
    tl.store(gram + 14, g23, mask=row_ok)
    tl.store(gram + 15, g33, mask=row_ok)


@triton.jit
def pre_finish_kernel(PartMix, PartGram, HNew, Scale, Base, Norm, Y, Post, Comb, Yq, Ys,
                      T, inv_k, eps, N_SLICES: tl.constexpr,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, MIX: tl.constexpr,
                      ITERS: tl.constexpr, HC_EPS: tl.constexpr, QUANT: tl.constexpr = False,
                      GROUP: tl.constexpr = 128, PDL: tl.constexpr = False):
    """Program (t, c): token t's mixes and Gram matrix from the slices' partials (added in slice
    order, unrolled so their loads are in flight together), times the streams' RMS scale; pre / post
    / comb as ``ops.hc_split_torch`` (sigmoids; a row softmax, then Sinkhorn from a column
    normalisation, ``ITERS`` columns; every program of the token computes the same bits, the first
    stores post and comb); then dims c * BLOCK_D.. of Y[t] = rms_norm(sum_i pre_i HNew[t, i], Norm)
    (the sum in stream order), the mean square being pre^T G pre / D. With ``QUANT`` also that
    block quantised as the fp8 GEMMs' input (``fp8_linear.quantize_act``: groups of ``GROUP``, e4m3
    bytes to Yq [T, D], power-of-two scales to Ys [T, D / GROUP]; BLOCK_D and D whole groups).
    One warp: the [4, 4] reductions stay within it."""
    await_predecessor(PDL)
    t = tl.program_id(0)
    c = tl.program_id(1)
    HC: tl.constexpr = 4
    j = tl.arange(0, HC)
    jj = j[:, None]
    kk = j[None, :]
    a_pre = tl.zeros([HC], dtype=tl.float32)
    a_post = tl.zeros([HC], dtype=tl.float32)
    a_comb = tl.zeros([HC, HC], dtype=tl.float32)
    gram = tl.zeros([HC, HC], dtype=tl.float32)
    for s in tl.static_range(N_SLICES):
        off = (s * T + t) * MIX
        a_pre += tl.load(PartMix + off + j)
        a_post += tl.load(PartMix + off + HC + j)
        a_comb += tl.load(PartMix + off + 2 * HC + jj * HC + kk)
        gram += tl.load(PartGram + (s * T + t) * 16 + jj * HC + kk)
    sq = tl.sum(tl.sum(tl.where(jj == kk, gram, 0.0), axis=1), axis=0)
    rsqrt = 1.0 / tl.sqrt(sq * inv_k + eps)
    s0 = tl.load(Scale + 0)
    s1 = tl.load(Scale + 1)
    s2 = tl.load(Scale + 2)
    pre = tl.sigmoid(a_pre * rsqrt * s0 + tl.load(Base + j)) + HC_EPS
    comb = a_comb * rsqrt * s2 + tl.load(Base + 2 * HC + jj * HC + kk)
    comb = tl.exp(comb - tl.max(comb, axis=1)[:, None])
    comb = comb / tl.sum(comb, axis=1)[:, None] + HC_EPS
    comb = comb / (tl.sum(comb, axis=0)[None, :] + HC_EPS)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + HC_EPS)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + HC_EPS)
    if c == 0:
        post = 2.0 * tl.sigmoid(a_post * rsqrt * s1 + tl.load(Base + HC + j))
        tl.store(Post + t * HC + j, post)
        tl.store(Comb + t * HC * HC + jj * HC + kk, comb)
    ms = tl.sum(tl.sum(pre[:, None] * gram * pre[None, :], axis=1), axis=0) / D
    r = 1.0 / tl.sqrt(ms + eps)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    y = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(HC):
        p = tl.sum(tl.where(j == i, pre, 0.0), axis=0)
        y = y + p * tl.load(HNew + (t * HC + i) * D + d, mask=d_ok, other=0.0)
    w = tl.load(Norm + d, mask=d_ok, other=0.0).to(tl.float32)
    y = y * r * w
    tl.store(Y + t * D + d, y, mask=d_ok)
    if QUANT:  # dims past D are 0 here; their groups are not stored
        NG: tl.constexpr = BLOCK_D // GROUP
        q, e = e4m3_groups(tl.reshape(y, [NG, GROUP]), 1e-4)
        g = c * NG + tl.arange(0, NG)
        g_ok = g < D // GROUP
        dq = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        tl.store(Yq + t * D + dq, q, mask=g_ok[:, None])
        tl.store(Ys + t * (D // GROUP) + g, exp2_int(e), mask=g_ok)
