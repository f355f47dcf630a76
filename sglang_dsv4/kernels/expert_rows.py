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
    """Where each pair sits: ``ends[e]`` the end row of expert e's padded group, ``dest_of_pair[i]``
    the row of pair i (``num_rows`` for a pair not held here), ``pair_of_row[m]`` the pair in row
    m (P = the number of pairs: a padding row). Within a group the pairs keep their order."""

    ends: Tensor
    dest_of_pair: Tensor
    pair_of_row: Tensor


def expert_rows(chosen: Tensor, first_expert: int, num_experts: int, align: int, num_rows: int) -> ExpertRows:
    """Rows for the pairs of ``chosen`` [T, k] among experts first_expert .. + num_experts - 1;
    ``num_rows`` must leave room for every group's padding.

    A pair's rank in its group is the count of earlier pairs routed to the same expert, a
    running count over a one-hot [P, E + 1] (no sort: a few fused kernels on a GPU where a stable
    argsort is a dozen, for the P of a decode step; int32 keeps a long prefill's table small)."""
    E, P, dev = num_experts, chosen.numel(), chosen.device
    local = chosen.flatten().long() - first_expert
    e = torch.where((local >= 0) & (local < E), local, E)             # E: not held here
    seen = torch.cumsum((e[:, None] == torch.arange(E + 1, device=dev)).to(torch.int32), 0, dtype=torch.int32)
    counts = seen[-1, :E].long()
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    rank = seen.gather(1, e[:, None]).squeeze(1).long() - 1
    esc = e.clamp(max=E - 1)
    dest = torch.where(e < E, ends[esc] - padded[esc] + rank, num_rows)
    pair_of_row = torch.full((num_rows + 1,), P, dtype=torch.long, device=dev)
    pair_of_row[dest] = torch.arange(P, device=dev)
    return ExpertRows(ends, dest, pair_of_row[:num_rows])
