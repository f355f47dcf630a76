"""Expert-sorted rows for the grouped-GEMM MoE paths (bf16 ``torch._grouped_mm``, fp8 Triton).

Each (token, slot) pair routed to a local expert gets a row in a buffer of fixed size, the rows
of one expert forming one group padded to the GEMM's row alignment. Every shape depends only on
host values (pairs, experts, alignment), so there is no host sync and no data-dependent
allocation; pairs routed to another rank's experts get no row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class ExpertRows:
    """Where each pair sits: ``ends[e]`` the end row of expert e's padded group, ``order`` the
    pairs sorted by expert, ``dest[i]`` the row of sorted pair i (``num_rows``: held elsewhere),
    ``pair_of_row[m]`` the pair in row m (P = the number of pairs: a padding row)."""

    ends: Tensor
    order: Tensor
    dest: Tensor
    pair_of_row: Tensor


def expert_rows(chosen: Tensor, first_expert: int, num_experts: int, align: int, num_rows: int) -> ExpertRows:
    """Rows for the pairs of ``chosen`` [T, k] among experts first_expert .. + num_experts - 1;
    ``num_rows`` must leave room for every group's padding."""
    E, P, dev = num_experts, chosen.numel(), chosen.device
    local = chosen.flatten().long() - first_expert
    e = torch.where((local >= 0) & (local < E), local, E)             # E: not held here
    # (torch.bincount syncs on CUDA to size its output: a scatter-add of known size does not)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, e, torch.ones_like(e))[:E]
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(e, stable=True)
    es = e[order]
    esc = es.clamp(max=E - 1)
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[esc]
    dest = torch.where(es < E, ends[esc] - padded[esc] + rank, num_rows)
    pair_of_row = torch.full((num_rows + 1,), P, dtype=torch.long, device=dev)
    pair_of_row[dest] = order
    return ExpertRows(ends, order, dest, pair_of_row[:num_rows])
