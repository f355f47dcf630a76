"""The Triton kernel of ``topk.select_topk_rows`` (imported on first use, as ``index_triton``)."""

import triton
import triton.language as tl

from .pdl_triton import await_predecessor


@triton.jit(do_not_specialize=["N", "K"])  # one compile per (K_P, CHUNK): every width and step
def topk_rows_kernel(Scores, Visible, Out, N, stride_s, stride_o, K, K_P: tl.constexpr, CHUNK: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Out[t, i] = the column of row t's i-th largest key, i < min(K, N, Visible[t]); -1 past it.

    A key is ``ops._stable_topk``'s: the score's order-preserving bits (invisible columns scored
    -inf, -0 as +0) in the high half, N - 1 - column in the low half; keys are distinct, so the
    top K_P of the row is the top K_P of the chunks' top K_P's, whatever order they merge in.
    Program t walks its row in chunks of CHUNK (>= K_P), keeping the best K_P keys sorted."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    vis = tl.load(Visible + t).to(tl.int64)
    lowest = -9223372036854775807 - 1  # below every key (the literal 2**63 would not be an int64)
    best = tl.full([K_P], lowest, tl.int64)
    end = tl.minimum(vis, N)  # the visible columns: the score rows are wider (bucketed widths)
    for start in range(0, end, CHUNK):
        j = start + tl.arange(0, CHUNK).to(tl.int64)
        _, packed, inside = _row_keys(Scores, t, stride_s, vis, N, j)
        packed = tl.where(inside, packed, lowest)
        top = tl.topk(packed, K_P)
        best = tl.topk(tl.reshape(tl.join(best, top), [2 * K_P]), K_P)
    i = tl.arange(0, K_P).to(tl.int64)
    col = (N - 1) - (best & 0x7FFFFFFF)  # the low half: N - 1 - column < 2**31
    col = tl.where((i < vis) & (i < N), col, -1)
    tl.store(Out + t * stride_o + i, col, mask=i < K)


@triton.jit
def _row_keys(Scores, t, stride_s, vis, N, j):
    """Row t's keys at columns j: (the score's orderable bits as int64 in [0, 2**32), the packed
    int64 key of ``ops._stable_topk``, whether j is a visible column). Only visible columns are
    read: an invisible one's key (-inf's bits) ranks below every visible one's, so it can only
    fill positions >= the visible count, which are -1."""
    inside = (j < N) & (j < vis)
    x = tl.load(Scores + t * stride_s + j, mask=inside, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    u = key.to(tl.int64) + 2147483648
    return u, (key.to(tl.int64) << 32) + (N - 1 - j), inside


@triton.jit(do_not_specialize=["N", "K"])
def topk_radix_kernel(Scores, Visible, Out, Work, N, stride_s, stride_o, K, K_P: tl.constexpr, CHUNK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """``topk_rows_kernel``'s result by a radix select: four histogram passes over the row find
    the K'-th largest visible score's bits (K' = min(K, visible)) and how many of its ties to take (the lowest
    columns: the keys' order), one pass writes the K' chosen keys to row t of ``Work`` [T, K_P],
    and a sort of those K_P orders them."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    vis = tl.load(Visible + t).to(tl.int64)
    lowest = -9223372036854775807 - 1
    end = tl.minimum(vis, N)  # the visible columns: the score rows are wider (bucketed widths)
    kk = tl.minimum(K, end)
    remaining = kk
    prefix = (t * 0).to(tl.int64)  # the score bits chosen so far, digit by digit
    d = tl.arange(0, 256)
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # constexpr: p is a static_range index
        hist = tl.zeros([256], tl.int32)
        for start in range(0, end, CHUNK):
            j = start + tl.arange(0, CHUNK).to(tl.int64)
            u, packed, inside = _row_keys(Scores, t, stride_s, vis, N, j)
            match = inside & ((u >> (shift + 8)) == prefix)
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
        at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # rows with this digit or above
        digit = tl.sum((at_least >= remaining).to(tl.int32), 0) - 1
        remaining -= tl.sum(tl.where(d == digit, at_least - hist, 0), 0)
        prefix = (prefix << 8) + digit
    # the chosen: bits above the threshold, and the first `remaining` columns at it
    i = tl.arange(0, K_P)
    tl.store(Work + t * K_P + i, tl.full([K_P], lowest, tl.int64))
    tl.debug_barrier()
    taken = (t * 0).to(tl.int64)
    ties = (t * 0).to(tl.int64)
    for start in range(0, end, CHUNK):
        j = start + tl.arange(0, CHUNK).to(tl.int64)
        u, packed, inside = _row_keys(Scores, t, stride_s, vis, N, j)
        tie = inside & (u == prefix)
        tie_rank = ties + tl.cumsum(tie.to(tl.int64), 0) - tie.to(tl.int64)
        sel = inside & ((u > prefix) | (tie & (tie_rank < remaining)))
        pos = taken + tl.cumsum(sel.to(tl.int64), 0) - sel.to(tl.int64)
        tl.store(Work + t * K_P + pos, packed, mask=sel)
        taken += tl.sum(sel.to(tl.int64), 0)
        ties += tl.sum(tie.to(tl.int64), 0)
    tl.debug_barrier()
    best = tl.sort(tl.load(Work + t * K_P + i), descending=True)
    col = (N - 1) - (best & 0x7FFFFFFF)
    col = tl.where((i < vis) & (i < N) & (i < kk), col, -1)
    tl.store(Out + t * stride_o + i, col, mask=i < K)
