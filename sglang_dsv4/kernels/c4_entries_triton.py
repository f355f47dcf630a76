"""The Triton kernels of ``c4_entries.c4_entries`` (imported on first use, as ``index_triton``).

The quantisers round with integer operations on the float bits (as ``fp8_bits_triton``) and
multiply by exact powers of two where they would divide (Triton's fp32 division is the GPU's
approximate ``div.full``): the power-of-two scales and the e4m3 / e2m1 roundings (round to nearest
even) are exact on the GPU and under the interpreter (whose float8 casts truncate and which has no
libdevice) alike.
"""

import triton
import triton.language as tl

from .fp8_bits_triton import exp2_int
from .pdl_triton import await_predecessor

FP8_FLOOR = tl.constexpr(1e-4)              # quant.fp8_qat's amax floor
FP4_FLOOR = tl.constexpr(6.0 * 2.0**-126)   # quant.fp4_qat's: the scale stays a normal float


@triton.jit
def _rint(x):
    """x rounded to the nearest integer, ties to even (0 <= x < 2^22): ``torch.round``."""
    return (x + 12582912.0) - 12582912.0  # 1.5 * 2^23


@triton.jit
def _round_minifloat(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 x (within the format's range) rounded to a minifloat of MANT mantissa bits whose
    smallest normal is 2^EMIN (subnormals below in steps of 2^(EMIN - MANT)), ties to even, sign
    kept: e4m3 (3, -6) as ``.to(torch.float8_e4m3fn)`` rounds, e2m1 (1, 0) as ``quant.e2m1_round``."""
    a = tl.abs(x)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    v = _rint(a * exp2_int(MANT - e)) * exp2_int(e - MANT)  # over the quantum 2^(e - MANT): exact
    return tl.where(x < 0, -v, v)


@triton.jit
def _pow2_exponent(amax, QMAX: tl.constexpr):
    """ceil(log2(amax / QMAX)) of positive normal fp32 amax, exactly, without a division (Triton's
    fp32 ``/`` is the GPU's approximate one): amax's exponent less QMAX's, + 1 where amax's mantissa
    is the larger. The same as ``fp8_bits_triton.ceil_log2`` of the correctly rounded quotient where
    QMAX's mantissa is not all ones (448 = 1.75 * 2^8, 6 = 1.5 * 2^2)."""
    b = amax.to(tl.int32, bitcast=True)
    q = tl.full([1], QMAX, tl.float32).to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) - ((q >> 23) & 0xFF)
    return tl.where((b & 0x7FFFFF) > (q & 0x7FFFFF), e + 1, e)


@triton.jit
def _qat_blocks(y, QMAX: tl.constexpr, FLOOR: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """``quant.fp8_qat`` / ``fp4_qat`` of a [blocks, size] fp32 tile, one block a row: scale 2^e,
    e = ceil(log2(max(amax, FLOOR) / QMAX)); the values / scale clamped to +-QMAX, rounded, times
    the scale."""
    e = _pow2_exponent(tl.maximum(tl.max(tl.abs(y), axis=1), FLOOR), QMAX)
    q = tl.minimum(tl.maximum(y * exp2_int(-e)[:, None], -QMAX), QMAX)  # over the scale 2^e: exact
    return _round_minifloat(q, MANT, EMIN) * exp2_int(e)[:, None]


@triton.jit
def _hadamard(y, D: tl.constexpr, LOG2_D: tl.constexpr, SCALE: tl.constexpr):
    """``quant.hadamard`` of [D] fp32 y: its butterflies in its order (stage h: pairs i, i + h of
    each 2h-block become a + b, a - b), then times D^-0.5. Halves picked by masked size-2 sums
    (adding 0.0: exact) rather than splits, so only reshapes move values between lanes."""
    for i in tl.static_range(LOG2_D):  # h = 2^i
        y3 = tl.reshape(y, (D // (2 << i), 2, 1 << i))
        half = tl.arange(0, 2)[None, :, None]
        a = tl.sum(tl.where(half == 0, y3, 0.0), axis=1)
        b = tl.sum(tl.where(half == 1, y3, 0.0), axis=1)
        y3 = tl.where(half == 0, (a + b)[:, None, :], (a - b)[:, None, :])
        y = tl.reshape(y3, (D,))
    return y * SCALE


@triton.jit
def finish_entry(pooled, Norm, Cos, Sin, row, cos_stride, sin_stride, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 ROPE: tl.constexpr, NOPE: tl.constexpr, IS_INDEXER: tl.constexpr, QUANT: tl.constexpr,
                 LOG2_D: tl.constexpr, HAD_SCALE: tl.constexpr):
    """``ops.finish_entries`` of one pooled entry [BLOCK_D] (lanes past D unused): RMS norm by
    ``Norm``, RoPE of the last ROPE dims (interleaved pairs) at ``row`` of ``Cos`` / ``Sin`` (float64,
    used in fp32), then FP8 QAT of the first NOPE dims in blocks of 64 (main, QUANT) or the Hadamard
    rotation and FP4 QAT in blocks of 32 (indexer)."""
    c = tl.arange(0, BLOCK_D)
    inside = c < D
    # RMS norm
    ms = tl.sum(pooled * pooled, axis=0) / D
    w = tl.load(Norm + c, mask=inside, other=0.0).to(tl.float32)
    y = pooled * tl.rsqrt(ms + eps) * w

    # RoPE of the last ROPE dims: pairs (2i, 2i + 1), i >= (D - ROPE) / 2
    HALF: tl.constexpr = BLOCK_D // 2
    OFF: tl.constexpr = (D - ROPE) // 2
    y2 = tl.reshape(y, (HALF, 2))
    k = tl.arange(0, 2)[None, :]
    re = tl.sum(tl.where(k == 0, y2, 0.0), axis=1)
    im = tl.sum(tl.where(k == 1, y2, 0.0), axis=1)
    i = tl.arange(0, HALF)
    rot = (i >= OFF) & (i < D // 2)
    j = tl.where(rot, i - OFF, 0)
    cos = tl.load(Cos + row * cos_stride + j, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(Sin + row * sin_stride + j, mask=rot, other=0.0).to(tl.float32)
    out_re = re * cos - im * sin
    out_im = re * sin + im * cos
    y2 = tl.where(rot[:, None], tl.where(k == 0, out_re[:, None], out_im[:, None]), y2)
    y = tl.reshape(y2, (BLOCK_D,))

    if IS_INDEXER:  # D a power of two: BLOCK_D == D
        y = _hadamard(y, BLOCK_D, LOG2_D, HAD_SCALE)
        if QUANT:
            y = tl.reshape(_qat_blocks(tl.reshape(y, (BLOCK_D // 32, 32)), 6.0, FP4_FLOOR, 1, 0), (BLOCK_D,))
    else:
        if QUANT:  # FP8 the nope dims (NOPE a multiple of 64), the rope dims as they are
            yb = tl.reshape(y, (BLOCK_D // 64, 64))
            q = _qat_blocks(yb, 448.0, FP8_FLOOR, 3, -6)
            yb = tl.where(tl.arange(0, BLOCK_D // 64)[:, None] < NOPE // 64, q, yb)
            y = tl.reshape(yb, (BLOCK_D,))
    return y


@triton.jit
def load_rows(A, S, Ape, Pos, rows, cols, mask, a_stride, s_stride, ape_stride, RATIO: tl.constexpr):
    """A compressor's rows ``rows`` [R] of A and S at ``cols`` ([R, C] or [C]), widened to float32
    (exact); RATIO > 0: S before its position bias, which is added here (row r's position in
    ``Pos``, mod RATIO, picks the row of ``Ape``: one float32 add, ``ops.with_position_bias``)."""
    a = tl.load(A + rows * a_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + rows * s_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if RATIO > 0:
        p = tl.load(Pos + rows).to(tl.int64) % RATIO  # rows: valid indices, masked or not
        s = s + tl.load(Ape + p * ape_stride + cols, mask=mask, other=0.0)
    return a, s


@triton.jit(do_not_specialize=["T", "n_prev", "a_stride", "s_stride", "ape_stride", "sa_slot", "sa_row", "ss_slot",
                               "ss_row", "idx_stride", "cos_stride", "sin_stride"])
def c4_entries_kernel(A, S, Ape, Pos, StateA, StateS, Slots, Idx, Norm, Cos, Sin, Out,
                      T, n_prev, a_stride, s_stride, ape_stride, sa_slot, sa_row, ss_slot, ss_row, idx_stride,
                      cos_stride, sin_stride, eps,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, NOPE: tl.constexpr,
                      ROWS: tl.constexpr, WINDOW: tl.constexpr, IS_INDEXER: tl.constexpr, QUANT: tl.constexpr,
                      LOG2_D: tl.constexpr, HAD_SCALE: tl.constexpr, RATIO: tl.constexpr = 0,
                      PDL: tl.constexpr = False):
    """Program t: token t's entry [D] (``ops.c4_entries_torch`` less its state writes).

    Its window's rows ``Idx[t, :WINDOW]`` index [the slot states' rows (n_prev = B * ROWS: row
    i is row i % ROWS of slot ``Slots[i // ROWS]``); the chunk's rows of A, S (T); a padding row
    (a 0, s -inf)]; the first WINDOW / 2 rows give their A half (dims 0..D-1), the others their
    B half (D..2D-1); the chunk's rows as ``load_rows`` reads them (RATIO: their bias). Per dim a
    softmax of s over the WINDOW rows weights a (``pool_c4_windows``); then ``finish_entries``:
    RMS norm by ``Norm``, RoPE of the last ROPE dims (interleaved pairs) at row t of ``Cos`` /
    ``Sin`` (float64, used in fp32), then FP8 QAT of the first NOPE dims in blocks of 64 (main,
    QUANT) or the Hadamard rotation and FP4 QAT in blocks of 32 (indexer)."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    r = tl.arange(0, WINDOW)
    c = tl.arange(0, BLOCK_D)
    inside = c < D
    src = tl.load(Idx + t * idx_stride + r).to(tl.int64)
    from_state = src < n_prev
    from_chunk = (src >= n_prev) & (src < n_prev + T)
    slot = tl.load(Slots + tl.where(from_state, src // ROWS, 0), mask=from_state, other=0).to(tl.int64)
    srow = tl.where(from_state, src % ROWS, 0)
    crow = tl.where(from_chunk, src - n_prev, 0)
    col = (c[None, :] + tl.where(r < WINDOW // 2, 0, D)[:, None]).to(tl.int64)  # A half, then B half
    m_state = from_state[:, None] & inside[None, :]
    m_chunk = from_chunk[:, None] & inside[None, :]
    a_state = tl.load(StateA + (slot * sa_slot + srow * sa_row)[:, None] + col, mask=m_state, other=0.0)
    s_state = tl.load(StateS + (slot * ss_slot + srow * ss_row)[:, None] + col, mask=m_state, other=0.0)
    a_chunk, s_chunk = load_rows(A, S, Ape, Pos, crow[:, None], col, m_chunk, a_stride, s_stride, ape_stride,
                                 RATIO)
    a = tl.where(from_state[:, None], a_state, a_chunk)  # the padding row: 0
    s = tl.where(from_state[:, None], s_state, tl.where(from_chunk[:, None], s_chunk, float("-inf")))
    s = tl.where(inside[None, :], s, 0.0)  # lanes past D: finite, unused

    # pool: per dim a softmax over the window's rows (the token's own row is finite)
    mx = tl.max(s, axis=0)
    ex = tl.exp(s - mx[None, :])
    p = ex / tl.sum(ex, axis=0)[None, :]
    pooled = tl.sum(p * a, axis=0)

    y = finish_entry(pooled, Norm, Cos, Sin, t, cos_stride, sin_stride, eps, D, BLOCK_D, ROPE, NOPE, IS_INDEXER,
                     QUANT, LOG2_D, HAD_SCALE)
    tl.store(Out + t * D + c, y, mask=inside)


@triton.jit(do_not_specialize=["a_stride", "s_stride", "ape_stride", "sa_slot", "sa_row", "ss_slot", "ss_row"])
def c4_state_write_kernel(A, S, Ape, Pos, StateA, StateS, DstSlot, DstRow, a_stride, s_stride, ape_stride, sa_slot,
                          sa_row, ss_slot, ss_row, W: tl.constexpr, BLOCK_W: tl.constexpr, RATIO: tl.constexpr = 0,
                          PDL: tl.constexpr = False):
    """Program t: ``StateA[DstSlot[t], DstRow[t]] = A[t]``, the same of S (rows W wide, as
    ``load_rows`` reads them): the states' in-place writes, a launch after the entries' (which
    read the rows these overwrite)."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    slot = tl.load(DstSlot + t).to(tl.int64)
    row = tl.load(DstRow + t).to(tl.int64)
    c = tl.arange(0, BLOCK_W)
    live = c < W
    a, s = load_rows(A, S, Ape, Pos, t, c, live, a_stride, s_stride, ape_stride, RATIO)
    tl.store(StateA + slot * sa_slot + row * sa_row + c, a, mask=live)
    tl.store(StateS + slot * ss_slot + row * ss_row + c, s, mask=live)
