"""``core.ops`` pieces whose GPU form is a rewrite of a definition: the indexer's top-k by unique
integer keys (``_stable_topk``) against the stable sort it replaces (``_sorted_topk``); the
hyper-connection stream sums as explicit adds (``_stream_sum``) against the einsums."""

from __future__ import annotations

import torch

from sglang_dsv4.core import ops


def _adversarial_scores(g: torch.Generator, rows: int, n: int) -> torch.Tensor:
    """Ties, +0 and -0, -inf and values near the float32 extremes."""
    x = torch.randint(-4, 5, (rows, n), generator=g).float() * 0.25
    zero = x == 0
    x[zero] *= torch.where(torch.rand(int(zero.sum()), generator=g) < 0.5, -1.0, 1.0)
    x[torch.rand(rows, n, generator=g) < 0.05] = float("-inf")
    return torch.where(torch.rand(rows, n, generator=g) < 0.3, torch.randn(rows, n, generator=g) * 1e30, x)


def test_the_keyed_topk_picks_the_stable_sorts_entries_in_its_order():
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        x = _adversarial_scores(g, 5, n)
        assert torch.equal(ops._stable_topk(x, k), ops._sorted_topk(x, k)), (n, k)


def test_select_topk_over_float32_equals_the_sort_with_visibility_and_padding():
    g = torch.Generator().manual_seed(1)
    for n in (3, 700, 2000):
        x = _adversarial_scores(g, 6, n)
        visible = torch.randint(0, n + 1, (6,), generator=g)
        visible[0] = 0
        got = ops.select_topk(x, visible, 512)
        want = ops._sorted_topk(x.masked_fill(torch.arange(n)[None] >= visible[:, None], float("-inf")), 512)
        want = torch.where(torch.arange(want.shape[1])[None] < visible[:, None], want, -1)
        want = torch.nn.functional.pad(want, (0, 512 - want.shape[1]), value=-1)
        assert got.shape == (6, 512) and torch.equal(got, want)
        assert (got[0] == -1).all()


def test_the_unrolled_stream_sums_equal_the_einsums_to_round_off():
    """The GPU's form of hc_weighted_sum / hc_head / hc_post's sums over the hc streams (explicit
    adds, stream order) against the CPU's einsums: both within fp32 round-off of the float64
    sums, and the same bits in float64 for exactly representable operands."""
    g = torch.Generator().manual_seed(2)
    T, hc, D = 37, 4, 300
    h = torch.randn(T, hc, D, generator=g)
    for w in (torch.rand(T, hc, generator=g) + 0.5, torch.rand(T, hc, hc, generator=g)):
        exact = ops._stream_sum(w.double(), h.double(), unrolled=False)
        for unrolled in (False, True):
            got = ops._stream_sum(w, h, unrolled)
            assert got.shape == exact.shape and got.dtype == torch.float32
            assert ((got.double() - exact).abs().amax() / exact.abs().amax()) < 1e-6, unrolled
        # dyadic operands with few bits: every product and partial sum is exact, in any order
        wq, hq = (w * 8).round().double() / 8, (h * 8).round().double() / 8
        assert torch.equal(ops._stream_sum(wq, hq, True), ops._stream_sum(wq, hq, False))
    f, post, comb = torch.randn(T, D, generator=g), torch.rand(T, hc, generator=g), torch.rand(T, hc, hc, generator=g)
    want = post.unsqueeze(-1) * f.unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, h)
    assert torch.equal(ops.hc_post(f, h, post, comb), want)  # the CPU: the einsum, unchanged
