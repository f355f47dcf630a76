"""The lightning indexer's scores read straight from the paged fp8 key rows (GPU).

``score_t(j) = sum_h w_h * relu(<qI_h, K_j>)`` (v4_architecture.md §4.2) over every entry of
token t's request. Scored in torch (``V4Model._select``), each C4 layer gathers its requests'
key rows, dequantises them to fp32 ([B, N, 128]: 4 bytes written and read back per byte stored),
multiplies them in a fp32 GEMM ([B, Hi, N]: written and read back again) and sums the heads: at
V4-Flash dimensions, batch 256 and 16K context, ~2 ms of each C4 layer's decode step (the
session-10 census). This kernel reads each key row once as stored (``IndexFp8Rows``: 128 e4m3 +
one fp32 power-of-two scale), the way DeepGEMM's ``fp8_paged_mqa_logits`` does for SGLang.

It computes the same products: the queries are FP4-QAT'ed (e2m1 values times power-of-two
scales) and the keys are e4m3, so both are exact in bf16 and each tensor-core product is exact;
the row scale is a power of two, applied after the ReLU (``relu(s x) = s relu(x)``, exact). Only
the fp32 sums (the 128-term dots, the head sum) are rounded in another order than the torch
path's cuBLAS GEMM. Each score depends on its own token and entry only (fixed tiles): the same in
any batch. The deterministic mode keeps the torch path's float64 dots (exact: the oracle's
scores).
"""

from __future__ import annotations

import math

import torch

from .fp8_linear import sm_count
from .kv_layout import IndexFp8Rows
from .triton_support import pdl_options, runs_on

Tensor = torch.Tensor

# the tiling: bench_index_scores on the H200 (session 14) put entry tiles of 128 and 8 waves at
# 158 us a call for 256 tokens x 4096 entries of distinct keys (2.4x their bytes), against 194 us
# for tiles of 64 and 4 waves; 38 against 43 us at 64 tokens; the same bits (the per-entry sums
# do not depend on the tile)
BLOCK_N = 128         # entries per dot tile
PROGRAM_WAVES = 8     # programs per SM the launch aims for (each holds its token's queries)


def supported(qi: Tensor, layout) -> bool:
    """Whether ``paged_index_scores`` runs here for keys stored in ``layout``."""
    return isinstance(layout, IndexFp8Rows) and runs_on(qi, "index_triton")


def blocks_per_program(tokens: int, blocks: int, sms: int, waves: int = PROGRAM_WAVES) -> int:
    """Entry blocks each program scores: enough programs to fill ``waves`` waves, as few query
    loads as that allows. Depends on shapes only (CUDA graphs)."""
    want = max(1, math.ceil(tokens * blocks / (waves * sms)))
    return min(want, max(blocks, 1))


@torch.compiler.disable  # a kernel launch, never traced
def paged_index_scores(qi: Tensor, head_weights: Tensor, buf: Tensor, layout: IndexFp8Rows,
                       table: Tensor, tok_req: Tensor, *, block_n: int = BLOCK_N,
                       waves: int = PROGRAM_WAVES, num_warps: int = 4, num_stages: int | None = None) -> Tensor:
    """qi [T, Hi, Di] (QAT'ed), head weights [T, Hi], the layer's key page buffer ``buf``
    ([pages, page_bytes] uint8, ``layout``), the entry table [B, N] (storage rows, -1 none),
    each token's request [T] -> scores [T, N] float32 of every entry of the token's request
    (columns past a request's entries score row 0: the caller masks them). The keywords are the
    launch's tiling (``benchmarks/bench_index_scores.py`` sweeps them); the defaults are what
    the model runs."""
    from .index_triton import index_scores_kernel

    T, Hi, Di = qi.shape
    B, N = table.shape
    P = layout.page_size
    if Di != layout.dim or (P * Di) % 4 or layout.page_bytes % 4:
        raise ValueError(f"paged_index_scores: keys of {layout.dim} dims in pages of {P} rows, queries of {Di}")
    out = torch.empty(T, N, dtype=torch.float32, device=qi.device)
    if T == 0 or N == 0:
        return out
    blocks = -(-N // block_n)
    per = blocks_per_program(T, blocks, sm_count(qi.device), waves)
    flat = buf.reshape(-1, layout.page_bytes)  # the same bytes as e4m3 values and as fp32 scales
    index_scores_kernel[(T, -(-blocks // per))](
        qi.float().contiguous(), head_weights.float().contiguous(), flat.view(torch.float8_e4m3fn),
        flat.view(torch.float32), table.contiguous(), tok_req.contiguous(), out,
        N, per, N, layout.page_bytes, layout.page_bytes // 4,
        HI=Hi, DI=Di, HI_P=_tile(Hi), DI_P=_tile(Di), P=P, BLOCK_N=block_n,
        BF16_DOT=qi.is_cuda, num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
        **pdl_options(out))
    return out


def _tile(n: int) -> int:
    """A dot operand's side: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << max(n - 1, 0).bit_length())
