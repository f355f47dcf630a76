"""On the CPU a position's result does not depend on how its sequence was chunked: any cut of a
prefill, and decode, give the logits of the uncut prefill bit for bit (``core.step``
CPU_TOKEN_TILE, ``ops.linear``, ``ops.pool_c4_windows``, ``ops.online_softmax_pool``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model

SETTINGS = dict(deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(model: V4Model, ids: torch.Tensor, cuts: list[int], max_len: int) -> tuple[torch.Tensor, V4Cache, object]:
    """Logits of ``ids`` prefilled in pieces ending at ``cuts`` (then the rest)."""
    cache = V4Cache(model.cfg, max_requests=1, max_total_tokens=max_len, max_seq_len=max_len)
    req = cache.new_request()
    out, pos = [], 0
    for c in sorted(set(cuts)) + [ids.numel()]:
        if c > pos:
            out.append(model.forward(cache, [req], [ids[pos:c]])[0])
            pos = c
    return torch.cat(out), cache, req


def _greedy(model: V4Model, cache: V4Cache, req, first: torch.Tensor, n: int) -> list[int]:
    tok, out = first, []
    for _ in range(n):
        out.append(int(tok))
        tok = model.forward(cache, [req], [tok.view(1)])[0][-1].argmax()
    return out


@pytest.mark.parametrize("cut", [[1], [437], [5, 17, 300]])
def test_a_cut_after_the_first_token_changes_nothing(micro, cut):
    """Regression: the server prefills [1, rest] after a cached BOS token. That cut used to move
    the logits of later positions (summation orders that changed with the row count, then a
    discrete choice near a tie amplified it); now they are equal bit for bit."""
    cfg, w = micro
    model = V4Model(cfg, w)
    ids = _ids(700, 11, cfg.vocab_size)
    ref, _, _ = _prefill(model, ids, [], 1024)
    got, _, _ = _prefill(model, ids, cut, 1024)
    assert torch.equal(got, ref)


@given(n=st.integers(512, 2048), cuts=st.lists(st.integers(1, 2047), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
@settings(max_examples=3, **SETTINGS)
def test_micro_any_chunking_equals_uncut_and_greedy_continuations_agree(micro, n, cuts, seed):
    cfg, w = micro
    model = V4Model(cfg, w)
    ids = _ids(n, seed, cfg.vocab_size)
    ref, ref_cache, ref_req = _prefill(model, ids, [], 2400)
    got, cache, req = _prefill(model, ids, [c for c in cuts if c < n], 2400)
    assert torch.equal(got, ref)
    first = ref[-1].argmax()
    assert _greedy(model, cache, req, first, 200) == _greedy(model, ref_cache, ref_req, first, 200)


@given(n=st.integers(512, 1024), cut=st.integers(1, 1023), seed=st.integers(0, 2**16))
@settings(max_examples=1, **SETTINGS)
def test_tiny_any_chunking_equals_uncut(tiny, n, cut, seed):
    """The FlashMLA-shaped preset on the CPU (torch backend): a cut prefill and 16 decode steps
    equal the uncut prefill and its decode bit for bit."""
    cfg, w = tiny
    model = V4Model(cfg, w)
    ids = _ids(n + 16, seed, cfg.vocab_size)
    ref, _, _ = _prefill(model, ids, [], 2048)
    got, cache, req = _prefill(model, ids[:n], [min(cut, n - 1)], 2048)
    dec = [model.forward(cache, [req], [ids[p:p + 1]])[0] for p in range(n, n + 16)]
    got = torch.cat([got] + dec)
    differ = ((got - ref).abs().amax(-1) > 0).nonzero().flatten()
    assert differ.numel() == 0, (f"positions {differ[:8].tolist()} (of {differ.numel()}) differ, by up to "
                                 f"{(got - ref).abs().max().item():.3g}")
