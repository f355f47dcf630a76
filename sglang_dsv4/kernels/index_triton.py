"""The Triton kernel of ``index_scores.paged_index_scores`` (imported on first use, as ``fp8_triton``)."""

import triton
import triton.language as tl

from .pdl_triton import await_predecessor


@triton.jit(do_not_specialize=["N", "BLOCKS_PER", "page_bytes", "page_words"])  # one compile per layout
def index_scores_kernel(
    Q, Wh, Keys, Scales, Table, TokReq, Out,
    N, BLOCKS_PER, stride_tab, page_bytes, page_words,
    HI: tl.constexpr, DI: tl.constexpr, HI_P: tl.constexpr, DI_P: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, BF16_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Out[t, n] = scale(r) * sum_h Wh[t, h] * relu(<Q[t, h], key(r)>), r = Table[TokReq[t], n]
    (storage row; a negative row reads row 0, to be masked by the caller). key(r): the e4m3 row
    of ``IndexFp8Rows`` (page r // P, offset r % P), scale(r) its fp32 power of two. Program
    (t, j) scores blocks j*BLOCKS_PER .. of BLOCK_N entries with the token's queries held."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    pj = tl.program_id(axis=1)
    req = tl.load(TokReq + t).to(tl.int64)
    h = tl.arange(0, HI_P)
    d = tl.arange(0, DI_P)
    hm, dm = h < HI, d < DI
    # the QAT'ed queries (e2m1 times power-of-two block scales) and the e4m3 keys are exact in
    # bf16: the tensor-core products are exact, only the fp32 sums are rounded (BF16_DOT=False:
    # fp32 operands, for the interpreter, whose bf16 dot is not numpy's)
    q = tl.load(Q + t * (HI * DI) + h[:, None] * DI + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    if BF16_DOT:
        q = q.to(tl.bfloat16)
    w = tl.load(Wh + t * HI + h, mask=hm, other=0.0)
    for i in range(0, BLOCKS_PER):
        n = (pj * BLOCKS_PER + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        row = tl.load(Table + req * stride_tab + n, mask=nm, other=0).to(tl.int64)
        row = tl.maximum(row, 0)
        page, off = row // P, row % P
        k = tl.load(Keys + page[:, None] * page_bytes + off[:, None] * DI + d[None, :],
                    mask=nm[:, None] & dm[None, :], other=0.0)
        s = tl.load(Scales + page * page_words + (P * DI) // 4 + off, mask=nm, other=0.0)
        if BF16_DOT:
            dots = tl.dot(q, tl.trans(k.to(tl.bfloat16)))  # [HI_P, BLOCK_N], fp32
        else:
            dots = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * s
        tl.store(Out + t * N + n, score, mask=nm)
