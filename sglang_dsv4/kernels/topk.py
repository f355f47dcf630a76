"""The indexer's top-k on the GPU as one Triton kernel: a program per token row.

``ops.select_topk`` takes one ``torch.topk`` over unique int64 keys (the score's order-preserving
bits, then n - 1 - column: the stable sort's choice and order). On the GPU that top-k is a radix
select of several passes and launches: ~53 us a call for one row of 4096 entries at batch 1 (4
launches), 108 launches and 0.37 ms a step at batch 256 over 3 C4 layers (flash8 censuses,
sessions 11 and 14). Here each row's keys are formed in registers, a radix select of four
256-bin histogram passes finds the k-th key, one pass gathers the chosen and one sort of k orders
them (or, ``method="bitonic"``, Triton's ``tl.topk`` keeps the best k chunk by chunk): one launch,
the same keys, so the same columns in the same order (tested against ``ops.select_topk``'s
torch path under the interpreter, and on the GPU). Shapes only decide the launch (CUDA graphs).
The step takes it for rows of one chunk (``preferred``); wider rows keep ``torch.topk``.
"""

from __future__ import annotations

import torch

from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor

# entries a program reduces at once by default (at least k; at most the row's power of two).
# bench_topk on the H200 (session 16), rows of 4096, k 512: radix select with chunk 4096 27.7 /
# 28.3 / 59.2 us at 1 / 64 / 256 rows (torch.topk over the keys 70.2 / 86.1 / 178.8; bitonic
# 56.8 / 57.4 / 118.1; radix with chunk 8192 52-110)
MAX_CHUNK = 4096


def supported(scores: Tensor) -> bool:
    """Whether ``select_topk_rows`` runs for these scores (float32 CUDA tensors, or the interpreter)."""
    return scores.dtype == torch.float32 and scores.dim() == 2 and runs_on(scores, "topk_triton")


def preferred(scores: Tensor) -> bool:
    """Whether the step should take ``select_topk_rows`` over ``torch.topk``: supported, and rows
    of at most ``MAX_CHUNK`` (one chunk a pass). The H200, session 16: rows of 4096 2.5-3x faster
    (bench_topk); a flash8 step at 16K context (rows past 4096, 4097+ visible: two chunks a pass)
    0.228 ms over its 3 calls at batch 1 against torch's 0.157 ms (census)."""
    return scores.shape[-1] <= MAX_CHUNK and supported(scores)


@torch.compiler.disable  # a kernel launch, never traced
def select_topk_rows(scores: Tensor, num_visible: Tensor, k: int, chunk: int | None = None,
                     num_warps: int | None = None, method: str = "radix") -> Tensor:
    """``ops.select_topk(scores, num_visible, k)``: per row the columns of its top-min(k, visible)
    scores among j < num_visible (ties: lower column first), in order, -1 padded -> [T, k] int64.
    ``chunk``: entries a program reduces at once (a power of two >= k; default: ``MAX_CHUNK``,
    or the row's power of two if smaller, or k's if larger); ``num_warps``: the program's warps;
    ``method``: "radix" (the default, 2-3x faster than "bitonic" on the H200: four histogram passes
    find the k-th key, one pass gathers the chosen, one sort orders them) or "bitonic" (the best k
    kept by ``tl.topk`` chunk by chunk). ``benchmarks/bench_topk.py`` sweeps all three."""
    from .topk_triton import topk_radix_kernel, topk_rows_kernel

    T, N = scores.shape
    out = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    if T == 0 or k == 0:
        return out
    kp = pow2(k)
    chunk = max(kp, min(MAX_CHUNK, pow2(N)) if chunk is None else chunk)
    if chunk & (chunk - 1):
        raise ValueError(f"select_topk_rows: chunk {chunk} is not a power of two")
    warps = num_warps or (8 if chunk >= 2048 else 4)
    if method == "radix":
        work = torch.empty(T, kp, dtype=torch.int64, device=scores.device)
        topk_radix_kernel[(T,)](scores.contiguous(), num_visible.contiguous(), out, work, N, N, k, k,
                                K_P=kp, CHUNK=chunk, num_warps=warps, **pdl_options(out))
    elif method == "bitonic":
        topk_rows_kernel[(T,)](scores.contiguous(), num_visible.contiguous(), out, N, N, k, k,
                               K_P=kp, CHUNK=chunk, num_warps=warps, **pdl_options(out))
    else:
        raise ValueError(f"select_topk_rows: no method {method!r}")
    return out


__all__ = ["select_topk_rows", "supported", "preferred", "MAX_CHUNK"]
