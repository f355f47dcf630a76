"""``kernels.expert_rows``: the sort-free row layout against its definition, the pairs sorted
stably by expert and each expert's group padded to the alignment."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels.expert_rows import expert_rows


def _by_sort(chosen: torch.Tensor, first: int, E: int, align: int, num_rows: int):
    """The layout from a stable argsort (what expert_rows replaced)."""
    P = chosen.numel()
    local = chosen.flatten().long() - first
    e = torch.where((local >= 0) & (local < E), local, E)
    counts = torch.bincount(e, minlength=E + 1)[:E]
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(e, stable=True)
    dest = torch.full((P,), num_rows, dtype=torch.long)
    for g in range(E):
        members = order[e[order] == g]
        dest[members] = ends[g] - padded[g] + torch.arange(members.numel())
    pair_of_row = torch.full((num_rows,), P, dtype=torch.long)
    held = dest < num_rows
    pair_of_row[dest[held]] = torch.arange(P)[held]
    return ends, dest, pair_of_row


@pytest.mark.parametrize("first, E", [(0, 32), (16, 16), (5, 3)])
def test_rows_equal_the_stable_sorts_layout(first, E):
    g = torch.Generator().manual_seed(first + E)
    A = 16
    for trial in range(40):
        T, k = int(torch.randint(1, 300, (1,), generator=g)), 6
        chosen = torch.rand(T, 32, generator=g).argsort(1)[:, :k]
        if trial % 4 == 0:
            chosen = torch.randint(0, 3, (T, k), generator=g)  # many pairs on few experts
        P = T * k
        M = -(-(P + min(P, E) * (A - 1)) // A) * A
        rows = expert_rows(chosen, first, E, A, M)
        ends, dest, pair_of_row = _by_sort(chosen, first, E, A, M)
        assert torch.equal(rows.ends, ends)
        assert torch.equal(rows.dest_of_pair, dest)
        assert torch.equal(rows.pair_of_row, pair_of_row)
