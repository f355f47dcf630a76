"""``kernels.moe_layout`` on the GPU: the row layout kernel gives ``fp8_moe._row_layout``'s
integers and gates, eager and compiled, at decode batch sizes, and replays from a CUDA graph.

    python3 -m pytest -q -m gpu tests/kernels/test_moe_layout_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv4.kernels import fp8_moe, moe_layout

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(T: int, k: int, total: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    chosen = torch.rand(T, total, generator=g, device=DEV).argsort(1)[:, :k].int()
    return chosen, torch.rand(T, k, generator=g, device=DEV)


@pytest.mark.parametrize("T,E,first,total", [(1, 32, 0, 32), (64, 32, 0, 32), (256, 32, 0, 32), (256, 8, 0, 8),
                                             (256, 128, 128, 256), (682, 16, 0, 16)])
def test_the_kernel_gives_the_torch_regions_layout(T, E, first, total):
    chosen, gates = _case(T, 6, total, T + E)
    assert moe_layout.supported(chosen)
    A, M = fp8_moe.grouped_rows(chosen.numel(), E)
    for A_ in sorted({A, 16, 64}):
        M_ = math.ceil((chosen.numel() + min(chosen.numel(), E) * (A_ - 1)) / A_) * A_
        got = moe_layout.row_layout(chosen, gates, first, E, A_, M_)
        for fn in (fp8_moe._row_layout.eager, fp8_moe._row_layout):  # eager ops, the fused region
            for w, o in zip(fn(chosen, gates, first, E, A_, M_), got):
                assert w.dtype == o.dtype and torch.equal(w, o), (fn, A_)


def test_the_kernel_replays_from_a_graph():
    chosen, gates = _case(64, 6, 32, 0)
    A, M = fp8_moe.grouped_rows(chosen.numel(), 32)
    moe_layout.row_layout(chosen, gates, 0, 32, A, M)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_layout.row_layout(chosen, gates, 0, 32, A, M)
    new_chosen, new_gates = _case(64, 6, 32, 1)
    chosen.copy_(new_chosen)
    gates.copy_(new_gates)
    graph.replay()
    for w, o in zip(fp8_moe._row_layout.eager(chosen, gates, 0, 32, A, M), out):
        assert torch.equal(w, o)
