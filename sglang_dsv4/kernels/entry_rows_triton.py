"""The Triton kernel of ``entry_rows.decode_entry_rows`` (imported on first use)."""

import triton
import triton.language as tl

from .pdl_triton import await_predecessor


@triton.jit(do_not_specialize=["K", "WIDTH", "stride_table", "stride_idx"])
def decode_entry_rows_kernel(Table, TokReq, Idx, Rows, Counts, K, WIDTH, stride_table, stride_idx,
                             BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program t: Rows[t, j] = Table[TokReq[t], Idx[t, j]] where Idx[t, j] >= 0 (j < K), else -1
    (j < WIDTH: the padding too); Counts[t] = how many Idx[t, :K] are >= 0."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    req = tl.load(TokReq + t).to(tl.int64)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, WIDTH, BLOCK):
        j = start + tl.arange(0, BLOCK)
        idx = tl.load(Idx + t * stride_idx + j, mask=j < K, other=-1).to(tl.int64)
        valid = idx >= 0
        row = tl.load(Table + req * stride_table + idx, mask=valid, other=-1)
        tl.store(Rows + t * WIDTH + j, tl.where(valid, row, -1).to(tl.int32), mask=j < WIDTH)
        count += valid.to(tl.int32)
    tl.store(Counts + t, tl.sum(count, 0))
