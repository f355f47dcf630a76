"""The Triton kernels of ``c128_pool.pool`` and ``c128_pool.entries`` (imported on first use, as
``index_triton``)."""

import triton
import triton.language as tl

from .c4_entries_triton import finish_entry, load_rows
from .pdl_triton import await_predecessor


@triton.jit
def _load_state(base, row, mask):
    """An online-softmax state's three vectors (max, sum, weighted sum) at ``base``, ``row`` apart;
    lanes outside ``mask``: the empty state (max -inf, sums 0)."""
    m = tl.load(base, mask=mask, other=float("-inf"))
    total = tl.load(base + row, mask=mask, other=0.0)
    acc = tl.load(base + 2 * row, mask=mask, other=0.0)
    return m, total, acc


@triton.jit
def _store_state(base, row, m, total, acc, mask):
    """``_load_state``'s inverse: the three vectors to ``base``, ``row`` apart, lanes in ``mask``."""
    tl.store(base, m, mask=mask)
    tl.store(base + row, total, mask=mask)
    tl.store(base + 2 * row, acc, mask=mask)


@triton.jit
def _absorb(A, S, Ape, Pos, Tok, g, m, total, acc, cols, inside, width, a_stride, s_stride, ape_stride, tok_stride,
            RATIO: tl.constexpr):
    """Segment g's online-softmax state (max, sum, weighted sum over dims ``cols``) through its
    positions in order: ``ops._absorb_position``'s arithmetic, one position at a time, the rows
    as ``c4_entries_triton.load_rows`` reads them (RATIO: their position bias)."""
    for i in range(width):
        t = tl.load(Tok + g * tok_stride + i)
        if t >= 0:  # -1: past the segment's end, the state as it was
            ai, si = load_rows(A, S, Ape, Pos, t, cols, inside, a_stride, s_stride, ape_stride, RATIO)
            m_new = tl.maximum(m, si)
            c_old = tl.exp(m - m_new)
            c_new = tl.exp(si - m_new)
            total = total * c_old + c_new
            acc = acc * c_old + ai * c_new
            m = m_new
    return m, total, acc


@triton.jit
def c128_pool_kernel(A, S, Tok, State, Out, width, d, a_stride, s_stride, tok_stride,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Program (g, j) runs segment g's online-softmax state over dims j*BLOCK_D.. through its
    positions in order: ``ops._absorb_position``'s arithmetic, one position at a time."""
    await_predecessor(PDL)
    g = tl.program_id(axis=0).to(tl.int64)
    cols = tl.program_id(axis=1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < d
    m, total, acc = _load_state(State + g * 3 * d + cols, d, inside)
    m, total, acc = _absorb(A, S, S, Tok, Tok, g, m, total, acc, cols, inside, width, a_stride, s_stride, 0,
                            tok_stride, 0)
    _store_state(Out + g * 3 * d + cols, d, m, total, acc, inside)


@triton.jit(do_not_specialize=["width", "a_stride", "s_stride", "ape_stride", "tok_stride", "st_slot", "st_row",
                               "cos_stride", "sin_stride"])
def c128_entries_kernel(A, S, Ape, Pos, Tok, State, Slots, Carry, Norm, Cos, Sin, Run, Out,
                        width, a_stride, s_stride, ape_stride, tok_stride, st_slot, st_row, cos_stride, sin_stride,
                        eps, D: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, NOPE: tl.constexpr,
                        QUANT: tl.constexpr, RATIO: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Program g: segment g from its start state (row ``Slots[g]`` of ``State`` [slots, 3, D] where
    ``Carry[g]``, else empty: ``ops.c128_start``) through its positions in order (``c128_pool_kernel``'s
    arithmetic; RATIO: the rows' position bias added on load) to its state, stored to ``Run``
    [G, 3, D], and its pooled entry finished (``ops.finish_entries``, the main compressor's) to
    ``Out`` [G, D]. The slot states are written by the next launch: a request's later segment
    writes the row its first one reads."""
    await_predecessor(PDL)
    g = tl.program_id(axis=0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    inside = c < D
    carry = tl.load(Carry + g) != 0
    slot = tl.load(Slots + g).to(tl.int64)
    m, total, acc = _load_state(State + slot * st_slot + c, st_row, inside & carry)  # else empty
    m, total, acc = _absorb(A, S, Ape, Pos, Tok, g, m, total, acc, c, inside, width, a_stride, s_stride, ape_stride,
                            tok_stride, RATIO)
    _store_state(Run + g * 3 * D + c, D, m, total, acc, inside)
    pooled = tl.where(inside, acc / total, 0.0)
    y = finish_entry(pooled, Norm, Cos, Sin, g, cos_stride, sin_stride, eps, D, BLOCK_D, ROPE, NOPE, False, QUANT,
                     1, 1.0)
    tl.store(Out + g * D + c, y, mask=inside)


@triton.jit(do_not_specialize=["st_slot", "st_row"])
def c128_state_write_kernel(Run, State, StoreSlot, Completes, st_slot, st_row, D: tl.constexpr,
                            BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Program g: row ``StoreSlot[g]`` of ``State`` takes segment g's state from ``Run``, or the
    empty state (max -inf, sums 0) where the segment completed its group (``ops.c128_finish``'s
    write)."""
    await_predecessor(PDL)
    g = tl.program_id(axis=0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    inside = c < D
    keep = tl.load(Completes + g) == 0  # a completed group's slot restarts from the empty state
    slot = tl.load(StoreSlot + g).to(tl.int64)
    m, total, acc = _load_state(Run + g * 3 * D + c, D, inside & keep)
    _store_state(State + slot * st_slot + c, st_row, m, total, acc, inside)
