"""The Triton kernel of ``topk.select_topk_rows`` (imported on first use, as ``index_triton``)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N", "K"])  # one compile per (K_P, CHUNK): every width and step
def topk_rows_kernel(Scores, Visible, Out, N, stride_s, stride_o, K, K_P: tl.constexpr, CHUNK: tl.constexpr):
    """Out[t, i] = the column of row t's i-th largest key, i < min(K, N, Visible[t]); -1 past it.

    A key is ``ops._stable_topk``'s: the score's order-preserving bits (invisible columns scored
    -inf, -0 as +0) in the high half, N - 1 - column in the low half; keys are distinct, so the
    top K_P of the row is the top K_P of the chunks' top K_P's, whatever order they merge in.
    Program t walks its row in chunks of CHUNK (>= K_P), keeping the best K_P keys sorted."""
    t = tl.program_id(axis=0).to(tl.int64)
    vis = tl.load(Visible + t).to(tl.int64)
    lowest = -9223372036854775807 - 1  # below every key (the literal 2**63 would not be an int64)
    best = tl.full([K_P], lowest, tl.int64)
    for start in range(0, N, CHUNK):
        j = start + tl.arange(0, CHUNK).to(tl.int64)
        inside = j < N
        x = tl.load(Scores + t * stride_s + j, mask=inside, other=0.0)
        x = tl.where(j < vis, x, float("-inf"))
        x = tl.where(x == 0.0, 0.0, x)
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        packed = (key.to(tl.int64) << 32) + (N - 1 - j)
        packed = tl.where(inside, packed, lowest)
        top = tl.topk(packed, K_P)
        best = tl.topk(tl.reshape(tl.join(best, top), [2 * K_P]), K_P)
    i = tl.arange(0, K_P).to(tl.int64)
    col = (N - 1) - (best & 0x7FFFFFFF)  # the low half: N - 1 - column < 2**31
    col = tl.where((i < vis) & (i < N), col, -1)
    tl.store(Out + t * stride_o + i, col, mask=i < K)
