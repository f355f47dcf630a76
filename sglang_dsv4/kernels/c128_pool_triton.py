"""The Triton kernel of ``c128_pool.pool`` (imported on first use, as ``index_triton``)."""

import triton
import triton.language as tl

from .pdl_triton import await_predecessor


@triton.jit
def c128_pool_kernel(A, S, Tok, State, Out, width, d, a_stride, s_stride, tok_stride,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Program (g, j) runs segment g's online-softmax state over dims j*BLOCK_D.. through its
    positions in order: ``ops._absorb_position``'s arithmetic, one position at a time."""
    await_predecessor(PDL)
    g = tl.program_id(axis=0).to(tl.int64)
    cols = tl.program_id(axis=1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < d
    base = State + g * 3 * d + cols
    m = tl.load(base, mask=inside)
    total = tl.load(base + d, mask=inside)
    acc = tl.load(base + 2 * d, mask=inside)
    for i in range(width):
        t = tl.load(Tok + g * tok_stride + i)
        if t >= 0:  # -1: past the segment's end, the state as it was
            ai = tl.load(A + t * a_stride + cols, mask=inside)
            si = tl.load(S + t * s_stride + cols, mask=inside)
            m_new = tl.maximum(m, si)
            c_old = tl.exp(m - m_new)
            c_new = tl.exp(si - m_new)
            total = total * c_old + c_new
            acc = acc * c_old + ai * c_new
            m = m_new
    out = Out + g * 3 * d + cols
    tl.store(out, m, mask=inside)
    tl.store(out + d, total, mask=inside)
    tl.store(out + 2 * d, acc, mask=inside)
