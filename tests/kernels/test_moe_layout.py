"""``kernels.moe_layout``: the one-program row layout gives ``fp8_moe._row_layout``'s integers and
gates (interpreted on the CPU: one token, an expert-parallel share with pairs held elsewhere, a
decode batch of 64, block rows of 16 and 64, bf16 gates), and the pair counts it serves."""

from __future__ import annotations

import torch

from sglang_dsv4.kernels import moe_layout, triton_support

_CASES = """
import math
import torch
from sglang_dsv4.kernels import fp8_moe, moe_layout
g = torch.Generator().manual_seed(0)
worst = 0
for T, k, E, first, total, A in [(1, 6, 32, 0, 32, 16), (7, 6, 8, 8, 16, 16), (64, 6, 32, 0, 32, 16),
                                 (64, 6, 32, 0, 32, 64), (3, 2, 4, 0, 4, 16), (20, 6, 256, 0, 256, 16)]:
    chosen = torch.rand(T, total, generator=g).argsort(1)[:, :k].int()
    gates = torch.rand(T, k, generator=g)
    P = chosen.numel()
    M = math.ceil((P + min(P, E) * (A - 1)) / A) * A
    for dt in (torch.float32, torch.bfloat16):
        want = fp8_moe._row_layout.eager(chosen, gates.to(dt), first, E, A, M)
        got = moe_layout.row_layout(chosen, gates.to(dt), first, E, A, M)
        for w, o in zip(want, got):
            worst += int(not (w.dtype == o.dtype and torch.equal(w, o)))
print("WORST", worst)
"""


def test_the_kernel_gives_the_torch_regions_layout(triton_interpreted):
    assert triton_interpreted(_CASES) == 0


def test_the_kernel_serves_decode_pair_counts_only():
    cpu = torch.zeros(256, 6, dtype=torch.int32)
    assert not moe_layout.supported(cpu) or triton_support.INTERPRET  # a CPU tensor: the torch region
    assert moe_layout.MAX_PAIRS >= 256 * 6  # the largest decode bucket's pairs at V4's k


def test_the_step_takes_the_kernel_where_it_measured_faster(monkeypatch):
    """``preferred``: up to 128 pairs whatever the experts; up to 384 (64 tokens of 6) with at
    most 32 local experts (flash43's 8 experts at batch 64: 1.86x on the H200), not with 256
    (0.63x); never past 384 (1536 pairs lost at every expert count)."""
    monkeypatch.setattr(moe_layout, "supported", lambda chosen: True)
    pairs = lambda tokens: torch.zeros(tokens, 6, dtype=torch.int64)  # noqa: E731
    assert moe_layout.preferred(pairs(21), 256) and not moe_layout.preferred(pairs(22), 256)
    assert moe_layout.preferred(pairs(64), 8) and moe_layout.preferred(pairs(64), 32)
    assert not moe_layout.preferred(pairs(64), 256) and not moe_layout.preferred(pairs(65), 8)
    assert not moe_layout.preferred(pairs(256), 8)
