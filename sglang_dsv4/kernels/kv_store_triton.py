"""The Triton kernel of ``kv_store.store_row_bytes`` (imported on first use, as ``index_triton``)."""

import triton
import triton.language as tl

from .fp8_bits_triton import bf16_bits, ceil_log2, e4m3_bits, e4m3_groups, exp2_int
from .pdl_triton import await_predecessor


@triton.jit
def _copy_segment(Src, Buf, dst, width, dst_stride, off, BLOCK: tl.constexpr):
    """``width`` bytes from ``Src`` (a row's segment) to ``Buf`` + dst + off * dst_stride."""
    j = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        jj = start + j
        v = tl.load(Src + jj, mask=jj < width)
        tl.store(Buf + dst + off * dst_stride + jj, v, mask=jj < width)


@triton.jit
def store_row_bytes_kernel(Buf, Page, Off, page_stride,
                           S0, s0_stride, w0, b0, d0,
                           S1, s1_stride, w1, b1, d1,
                           S2, s2_stride, w2, b2, d2,
                           NUM_SEGMENTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program t writes row t's byte segments (up to three: source, its row stride, width, base in
    the page, row stride in the page) to its row ``Off[t]`` of page ``Page[t]`` of ``Buf``."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    page = tl.load(Page + t).to(tl.int64)
    off = tl.load(Off + t).to(tl.int64)
    base = page * page_stride
    _copy_segment(S0 + t * s0_stride, Buf, base + b0, w0, d0, off, BLOCK)
    if NUM_SEGMENTS > 1:
        _copy_segment(S1 + t * s1_stride, Buf, base + b1, w1, d1, off, BLOCK)
    if NUM_SEGMENTS > 2:
        _copy_segment(S2 + t * s2_stride, Buf, base + b2, w2, d2, off, BLOCK)


# ---- quantise and store in one launch (``kv_store.quantise_store_v4`` / ``quantise_store_index``) ----
# Integer arithmetic on the float bits throughout (``fp8_bits_triton``).

@triton.jit
def quantise_store_v4_kernel(X, x_stride, Buf, Page, Off, page_stride, scales_base,
                             NOPE: tl.constexpr, ROPE: tl.constexpr, TILES_P: tl.constexpr,
                             DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PDL: tl.constexpr = False):
    """Program t: row t of X (nope + rope floats) in FlashMLA's V4 layout (``kv_layout.V4Fp8Rows``)
    at row ``Off[t]`` of page ``Page[t]``: e4m3 nope with one ue8m0 scale per 64 values
    (``quant.fp8_qat``'s rule, amax floored at 1e-4), bf16 rope, zero scale padding."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    page = tl.load(Page + t).to(tl.int64)
    off = tl.load(Off + t).to(tl.int64)
    row = Buf + page * page_stride + off * DATA_BYTES
    tile = tl.arange(0, TILES_P)
    col = tile[:, None] * 64 + tl.arange(0, 64)[None, :]
    live = col < NOPE
    x = tl.load(X + t * x_stride + col, mask=live, other=0.0).to(tl.float32)
    q, e = e4m3_groups(x, 1e-4)
    tl.store(row + col, q, mask=live)
    sb = tl.arange(0, SCALE_BYTES)
    sc = tl.sum(tl.where(tile[:, None] == sb[None, :], (e + 127)[:, None], 0), axis=0)  # byte j: tile j's
    sc = tl.where(sb < NOPE // 64, sc, 0)
    tl.store(Buf + page * page_stride + scales_base + off * SCALE_BYTES + sb, sc.to(tl.uint8))
    j = tl.arange(0, ROPE)
    rb = bf16_bits(tl.load(X + t * x_stride + NOPE + j).to(tl.float32))
    tl.store(row + NOPE + 2 * j, (rb & 0xFF).to(tl.uint8))
    tl.store(row + NOPE + 2 * j + 1, ((rb >> 8) & 0xFF).to(tl.uint8))


@triton.jit
def quantise_store_index_kernel(X, x_stride, Buf, Page, Off, page_stride, scales_base, DIM: tl.constexpr,
                                PDL: tl.constexpr = False):
    """Program t: row t of X as an indexer key (``kv_layout.IndexFp8Rows``): e4m3 values and one
    fp32 power-of-two scale (amax floored at 1e-30), at row ``Off[t]`` of page ``Page[t]``."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    page = tl.load(Page + t).to(tl.int64)
    off = tl.load(Off + t).to(tl.int64)
    j = tl.arange(0, DIM)
    x = tl.load(X + t * x_stride + j).to(tl.float32)
    e = ceil_log2(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30) / 448.0)
    q = tl.minimum(tl.maximum(x / exp2_int(e), -448.0), 448.0)
    tl.store(Buf + page * page_stride + off * DIM + j, e4m3_bits(q))
    s = (e + 127) << 23  # the scale's fp32 bits, little-endian bytes
    b = tl.arange(0, 4)
    tl.store(Buf + page * page_stride + scales_base + off * 4 + b, ((s >> (8 * b)) & 0xFF).to(tl.uint8))
