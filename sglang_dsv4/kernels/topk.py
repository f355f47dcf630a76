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

Rows wider than a chunk (a C4 layer past 16K tokens of context: 4096 entries) can be split
(``_select_split``, opt-in ``SGLANG_DSV4_TOPK_SPLIT=1``; off, the step takes ``torch.topk``): a
program a chunk keeps that chunk's top k, then the same kernel picks the row's top k among the
chunks' candidates. The keys are distinct, so the row's top k is among
them; the candidates stand in chunk order, each chunk's in key order, so between equal scores a
lower position is a lower column and the second pass breaks ties as the whole row would. Two
launches of one program per chunk instead of one program walking the whole row four times (and
instead of ``torch.topk``, ~95 us a call for one row of 16384 entries on an H100, session 33);
candidates wider than a chunk split again.
"""

from __future__ import annotations

import os

import torch

from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor

# entries a program reduces at once by default (at least k; at most the row's power of two).
# bench_topk on the H200 (session 16), rows of 4096, k 512: radix select with chunk 4096 27.7 /
# 28.3 / 59.2 us at 1 / 64 / 256 rows (torch.topk over the keys 70.2 / 86.1 / 178.8; bitonic
# 56.8 / 57.4 / 118.1; radix with chunk 8192 52-110)
MAX_CHUNK = 4096
# rows wider than a chunk split (module docstring); opt-in: its GPU tests passed on an H200 (session
# 35), its step at 64K is not yet timed; off, they keep torch.topk
SPLIT = os.environ.get("SGLANG_DSV4_TOPK_SPLIT", "0") == "1"


def supported(scores: Tensor) -> bool:
    """Whether ``select_topk_rows`` runs for these scores (float32 CUDA tensors, or the interpreter)."""
    return scores.dtype == torch.float32 and scores.dim() == 2 and runs_on(scores, "topk_triton")


def splits(width: int, k: int) -> bool:
    """Whether ``select_topk_rows`` splits rows of ``width`` for a top ``k`` (``_select_split``):
    switched on (``SGLANG_DSV4_TOPK_SPLIT=1``, opt-in), wider than a chunk, and k at most half a
    chunk (the candidates then narrow the row)."""
    return SPLIT and width > MAX_CHUNK and 2 * pow2(k) <= MAX_CHUNK


def preferred(scores: Tensor, k: int) -> bool:
    """Whether the step should take ``select_topk_rows`` over ``torch.topk``: supported, and rows
    of at most ``MAX_CHUNK`` (one chunk a pass) or split (``splits``). The H200, session 16: rows
    of 4096 2.5-3x faster (bench_topk); a flash8 step at 16K context with one program walking
    rows past 4096 (two chunks a pass) 0.228 ms over its 3 calls at batch 1 against torch's
    0.157 ms (census), hence the split."""
    return (scores.shape[-1] <= MAX_CHUNK or splits(scores.shape[-1], k)) and supported(scores)


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
    if chunk is None and T and k and splits(N, k):
        return _select_split(scores, num_visible, k, num_warps, method)
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


def _select_split(scores: Tensor, num_visible: Tensor, k: int, num_warps: int | None, method: str) -> Tensor:
    """``select_topk_rows`` of rows wider than a chunk (module docstring): each chunk's top k,
    then the top k of those candidates, mapped back to the row's columns."""
    T, N = scores.shape
    C = MAX_CHUNK
    S = -(-N // C)
    if N != S * C:  # whole chunks (entry widths are powers of two: no copy in a step)
        scores = torch.nn.functional.pad(scores, (0, S * C - N))
    base = torch.arange(S, device=scores.device) * C
    vis = (num_visible.to(torch.int64).clamp_max(N)[:, None] - base).clamp(0, C)  # [T, S] visible in each chunk
    local = select_topk_rows(scores.contiguous().view(T * S, C), vis.flatten(), k, None, num_warps, method)
    cols = torch.where(local >= 0, local + base.repeat(T)[:, None], -1).view(T, S * k)
    cand = torch.where(cols >= 0, scores.gather(1, cols.clamp_min(0)), float("-inf"))
    every = torch.full((T,), S * k, dtype=torch.int64, device=scores.device)
    pos = select_topk_rows(cand, every, k, None, num_warps, method)          # candidates wider than a chunk split again
    return torch.where(pos >= 0, cols.gather(1, pos.clamp_min(0)), -1)


__all__ = ["select_topk_rows", "supported", "preferred", "splits", "MAX_CHUNK"]
