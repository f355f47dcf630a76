"""``kernels.c128_pool``: the one-launch online-softmax pooling gives the torch loop's states
(``ops.online_softmax_pool``; interpreted on the CPU, where numpy's exp rounds apart from torch's
by an ulp: within 1e-6 of each state vector's scale), continues a segment across calls to the same bits (a group split between
prefill chunks), leaves segments past their end as they were, and is opt-in."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels import c128_pool, triton_support

_CASES = """
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import c128_pool
g = torch.Generator().manual_seed(0)
worst = 0.0
for T, d, width, G in ((40, 512, 32, 3), (1, 64, 1, 1), (300, 96, 128, 4), (9, 200, 5, 2)):
    a = torch.randn(T, d, generator=g) * 3
    s = torch.randn(T, 2 * d, generator=g)[:, ::2].contiguous() * 4  # scores; and a strided copy below
    s_wide = torch.randn(T, 2 * d, generator=g)
    tok = torch.randint(0, T, (G, width), generator=g)
    tok[0, width // 2:] = -1  # a segment that ends early
    empty = torch.stack((torch.full((d,), float("-inf")), torch.zeros(d), torch.zeros(d)))
    state = torch.stack([empty] + [torch.randn(3, d, generator=g).abs() for _ in range(G - 1)])
    for rows_s in (s, s_wide[:, :d]):  # contiguous scores, and a view with a row stride of 2d
        want = ops.online_softmax_pool(a, rows_s, tok, state, width)  # the torch loop (not opted in)
        got = c128_pool.pool(a, rows_s, tok, state, width)
        assert torch.isfinite(got[:, 1:]).all()
        # error on each state vector's scale (a weighted sum of mixed signs cancels to near zero
        # in places, where a relative error says nothing); -inf maxima equal exactly
        scale = want.abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True) + 1e-30
        worst = max(worst, float(((got - want).abs() / scale).nan_to_num(0.0).max()))
        # a segment cut in two calls (state carried, as between prefill chunks): the same bits
        k = width // 3
        tail = tok[:, k:].clone()
        half = c128_pool.pool(a, rows_s, tok[:, :k].clone(), state, k)
        again = c128_pool.pool(a, rows_s, tail, half, width - k)
        if not torch.equal(again, got):
            worst = float("inf")
    # a segment with no rows keeps its state exactly
    none = c128_pool.pool(a, s, torch.full((G, width), -1), state, width)
    if not torch.equal(none, state):
        worst = float("inf")
print("WORST", worst)
"""


def test_the_kernel_pools_as_the_torch_loop_and_continues_across_calls(triton_interpreted):
    assert triton_interpreted(_CASES) < 1e-6


def test_the_kernel_is_opt_in_and_checks_its_operands():
    a = torch.zeros(4, 8)
    state = torch.zeros(2, 3, 8)
    assert c128_pool.supported(a, a, state) == triton_support.INTERPRET  # CPU tensors: the torch loop
    assert not c128_pool.supported(a.double(), a.double(), state.double())
    assert not c128_pool.supported(a, a, state.transpose(1, 2).contiguous().transpose(1, 2))
    assert c128_pool.ENABLED is False or c128_pool.preferred(a, a, state) == c128_pool.supported(a, a, state)
    with pytest.raises(ValueError, match="c128_pool"):
        c128_pool.pool(a, a, torch.zeros(2, 3, dtype=torch.long), state, 4)  # width past the token table
