"""The Triton kernel of ``kv_store.store_row_bytes`` (imported on first use, as ``index_triton``)."""

import triton
import triton.language as tl


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
                           NUM_SEGMENTS: tl.constexpr, BLOCK: tl.constexpr):
    """Program t writes row t's byte segments (up to three: source, its row stride, width, base in
    the page, row stride in the page) to its row ``Off[t]`` of page ``Page[t]`` of ``Buf``."""
    t = tl.program_id(axis=0).to(tl.int64)
    page = tl.load(Page + t).to(tl.int64)
    off = tl.load(Off + t).to(tl.int64)
    base = page * page_stride
    _copy_segment(S0 + t * s0_stride, Buf, base + b0, w0, d0, off, BLOCK)
    if NUM_SEGMENTS > 1:
        _copy_segment(S1 + t * s1_stride, Buf, base + b1, w1, d1, off, BLOCK)
    if NUM_SEGMENTS > 2:
        _copy_segment(S2 + t * s2_stride, Buf, base + b2, w2, d2, off, BLOCK)
