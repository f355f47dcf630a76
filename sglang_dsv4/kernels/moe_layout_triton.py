"""The Triton kernel of ``moe_layout.row_layout`` (imported on first use, as ``index_triton``)."""

import triton
import triton.language as tl

from .pdl_triton import await_predecessor


@triton.jit(do_not_specialize=["P", "M", "first"])  # one compile per (E, A, block sizes)
def moe_row_layout_kernel(Chosen, Gates, TokenOfRow, BlockExpert, DestOfPair, GateOfRow, Work,
                          P, M, first, K, E: tl.constexpr, A: tl.constexpr, P_B: tl.constexpr,
                          E_B: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """``fp8_moe._row_layout`` by one program: the P (token, slot) pairs of ``Chosen`` (flat
    [T * K]) sorted by local expert (``first`` .. ``first`` + E - 1; others are not held here),
    each expert's rows padded to A, the M rows and M / A blocks written whole.

    Counts per expert by one histogram, group ends by a scan; a pair's row is its expert's group
    start plus its rank there, the rank read off one sort of (expert, pair) keys: pairs keep their
    order within a group, as ``expert_rows``' running count keeps it."""
    await_predecessor(PDL)
    i = tl.arange(0, P_B)
    valid = i < P
    e = tl.load(Chosen + i, mask=valid, other=0).to(tl.int32) - first
    held = valid & (e >= 0) & (e < E)
    eh = tl.where(held, e, E)                      # E: held elsewhere
    x = tl.arange(0, E_B)
    cnt = tl.histogram(eh, E_B, mask=valid)
    cnt = tl.where(x < E, cnt, 0)
    padded = (cnt + A - 1) // A * A
    ends = tl.cumsum(padded, 0)
    # sorted position of a pair - (pairs of lower experts) + (its group's first row) = its row
    tl.store(Work + x, ends - padded - (tl.cumsum(cnt, 0) - cnt))
    # block b belongs to the expert whose group holds row b * A: the count of groups ending at or
    # before it (E: past the last group, written -1)
    nb = M // A
    for b0 in range(0, nb, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        before = (ends[None, :] <= (b * A)[:, None]) & (x[None, :] < E)
        be = tl.sum(before.to(tl.int32), 1)
        tl.store(BlockExpert + b, tl.where(be < E, be, -1), mask=b < nb)
    for m0 in range(0, M, CHUNK):  # padding rows; the pairs' rows are written over them below
        m = m0 + tl.arange(0, CHUNK)
        tl.store(TokenOfRow + m, tl.full([CHUNK], -1, tl.int32), mask=m < M)
        tl.store(GateOfRow + m, tl.zeros([CHUNK], tl.float32), mask=m < M)
    tl.debug_barrier()  # Work and the padding are written before any thread reads or overwrites them
    key = tl.sort(tl.where(valid, eh * P_B + i, (E + 1) * P_B + i))
    se = key // P_B
    sp = key % P_B
    sheld = se < E
    dest = i + tl.load(Work + tl.where(sheld, se, 0), mask=sheld, other=0)
    tl.store(DestOfPair + sp, tl.where(sheld, dest, M).to(tl.int64), mask=se <= E)
    tl.store(TokenOfRow + dest, (sp // K).to(tl.int32), mask=sheld)
    tl.store(GateOfRow + dest, tl.load(Gates + sp, mask=sheld, other=0.0).to(tl.float32), mask=sheld)
