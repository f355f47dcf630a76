"""The fp8 routed experts' row layout on the GPU as one Triton launch.

``fp8_moe._row_layout`` (a fused torch region) is the layout of the two grouped GEMMs: each
(token, slot) pair's row among its expert's group, padded to the GEMM's block rows. Inductor
cuts its scan, search and scatters into ~14 kernels a layer (112 launches of a flash8 decode
step at batch 1, session-10 census): microseconds each while the whole layout is a few thousand
integers. Here one program computes it (a histogram, a scan, one sort of the pairs), for the
pair counts of a decode step (``MAX_PAIRS``); larger steps keep the torch region. The same
integers and gates (tested against ``_row_layout`` under the interpreter, and on the GPU).
Shapes only decide the launch (CUDA graphs).
"""

from __future__ import annotations

import torch

from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor

MAX_PAIRS = 4096  # one program sorts them all in registers: decode batches (256 x 6 = 1536)
CHUNK = 256       # blocks / rows a loop iteration writes
# Where the one program beats the fused torch region (bench_moe_layout on the H200, session 16,
# k 6: 6 pairs 2.07x / 1.03x / 2.13x at 8 / 32 / 256 experts; 384 pairs 1.86x / 1.11x / 0.63x;
# 1536 pairs 0.72-0.86x): a single program's serial scan loses once the pairs fill the torch
# kernels' grids, sooner the more experts it scans.
FASTER_UP_TO = 128
FASTER_UP_TO_FEW_EXPERTS = (384, 32)  # (pairs, experts): up to 384 pairs with at most 32 experts


def supported(chosen: Tensor) -> bool:
    """Whether ``row_layout`` runs for this routing (a CUDA tensor or the interpreter, at most
    ``MAX_PAIRS`` pairs)."""
    return 0 < chosen.numel() <= MAX_PAIRS and runs_on(chosen, "moe_layout_triton")


def preferred(chosen: Tensor, num_experts: int) -> bool:
    """Whether the step should take ``row_layout`` over the torch region for ``num_experts`` local
    experts: supported, and where it measured faster: at most ``FASTER_UP_TO`` pairs, or
    ``FASTER_UP_TO_FEW_EXPERTS`` (flash43's 8 experts at batch 64: 1.86x)."""
    pairs, (few_pairs, few_experts) = chosen.numel(), FASTER_UP_TO_FEW_EXPERTS
    faster = pairs <= FASTER_UP_TO or (pairs <= few_pairs and num_experts <= few_experts)
    return faster and supported(chosen)


@torch.compiler.disable  # a kernel launch, never traced
def row_layout(chosen: Tensor, gates: Tensor, first_expert: int, num_experts: int, block_m: int,
               num_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``fp8_moe._row_layout``'s result -> (token of each row [M] int32, -1 padding; expert of
    each block [M / block_m] int32, -1 past the last group; row of each pair [P] int64, M for a
    pair held elsewhere; gate of each row [M] float32, 0 for padding)."""
    from .moe_layout_triton import moe_row_layout_kernel

    T, k = chosen.shape
    P, E, M, dev = chosen.numel(), num_experts, num_rows, chosen.device
    if M % block_m:
        raise ValueError(f"row_layout: {M} rows are not whole blocks of {block_m}")
    token_of_row = torch.empty(M, dtype=torch.int32, device=dev)
    block_expert = torch.empty(M // block_m, dtype=torch.int32, device=dev)
    dest_of_pair = torch.empty(P, dtype=torch.int64, device=dev)
    gate_of_row = torch.empty(M, dtype=torch.float32, device=dev)
    e_b = max(pow2(E + 1), 16)
    work = torch.empty(e_b, dtype=torch.int32, device=dev)
    moe_row_layout_kernel[(1,)](chosen.contiguous(), gates.contiguous(), token_of_row, block_expert, dest_of_pair,
                                gate_of_row, work, P, M, first_expert, k, E=E, A=block_m, P_B=max(pow2(P), 16),
                                E_B=e_b, CHUNK=CHUNK, num_warps=8 if P > 1024 else 4, **pdl_options(chosen))
    return token_of_row, block_expert, dest_of_pair, gate_of_row


__all__ = ["row_layout", "supported", "preferred", "MAX_PAIRS", "FASTER_UP_TO", "FASTER_UP_TO_FEW_EXPERTS"]
