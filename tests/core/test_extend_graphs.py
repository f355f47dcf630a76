"""The extend graphs' layout (``core.extend_graphs``): a short extend laid out as a graph holds
it (padded to a token bucket, fixed ratio-128 segments and token grid) gives the eager step's
rows and leaves the cache as the eager step does, bit for bit, on the CPU; decode steps after it
agree too. Graph capture itself is covered on the GPU (tests/core/test_extend_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.extend_graphs import ExtendGraphs, extend_inputs, extend_shape, input_views
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.srt.state import SglangV4Cache

MAX_LEN = 640


def _serving(cfg):
    cache = SglangV4Cache.with_own_table(cfg, 4, 4 * MAX_LEN, max_seq_len=MAX_LEN, device="cpu", backend="torch")
    cache.req_to_token.copy_(torch.arange(4 * MAX_LEN).view(4, MAX_LEN) + 1)
    return cache


def _reference(cfg):
    return V4Cache(cfg, max_requests=4, max_total_tokens=4 * MAX_LEN, max_seq_len=MAX_LEN)


def _request(cache):
    if isinstance(cache, V4Cache):
        return cache.new_request()
    return cache.bind(0, 1, 0)


# (prompt tokens before, new tokens): group boundaries of both ratios inside, one bucket's worth
CASES = [(150, 7), (125, 10), (0, 2), (250, 40), (97, 127), (3, 200)]


@pytest.mark.parametrize("make", [_serving, _reference], ids=["serving", "reference"])
@pytest.mark.parametrize("start,n", CASES)
def test_an_extend_laid_out_for_a_graph_equals_the_eager_step(micro, make, start, n):
    cfg, w = micro
    model = V4Model(cfg, w)
    graphs = ExtendGraphs(model)
    g = torch.Generator().manual_seed(start + n)
    prompt = torch.randint(0, cfg.vocab_size, (start,), generator=g)
    new = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    tail = torch.randint(0, cfg.vocab_size, (3,), generator=g)
    outs = []
    for laid_out in (False, True):
        cache = make(cfg)
        req = _request(cache)
        if start:
            model.forward(cache, [req], [prompt])
        if laid_out:
            assert graphs.takes([req], [new])
            streams, hidden = graphs.run_uncaptured(cache, [req], [new])
            req.num_tokens += n
            rows = (hidden[:n], streams[:n])
        else:
            h, s = model.forward(cache, [req], [new], return_hidden=True, return_streams=True)
            rows = (h[0], s[0])
        after = [model.forward(cache, [req], [t.view(1)], return_hidden=True)[0] for t in tail]
        state = {k: v[req.slot].clone() for k, v in cache.slot_state.items()}
        cache.check_integrity()
        outs.append((rows, after, state))
    (rows_e, after_e, state_e), (rows_g, after_g, state_g) = outs
    assert torch.equal(rows_g[0], rows_e[0]) and torch.equal(rows_g[1], rows_e[1])
    assert all(torch.equal(a, b) for a, b in zip(after_g, after_e))
    assert all(torch.equal(state_g[k], state_e[k]) for k in state_e)


def test_the_inputs_pad_with_a_scratch_request_and_empty_segments(micro):
    cfg, _ = micro
    cache = _serving(cfg)
    req = _request(cache)
    scratch = cache.layout.scratch_slot(cache.slot_state)
    plan = cache.plan_tables([req], [0], [20], torch.arange(20))
    shape = extend_shape(32, plan.widths, False, torch.device("cuda"))  # the GPU's shape: no CPU padding
    assert (shape.tokens, shape.segments, shape.seg_width) == (32, 2, 32)
    rows = {r: p.scratch_row for r, p in cache.pools.items()}
    f, write, _ = input_views(extend_inputs(shape, req.slot, 0, 20, plan, scratch, rows), shape)
    assert f["positions"][:20].tolist() == list(range(20)) and (f["positions"][20:] == 0).all()
    assert f["tok_req"].tolist() == [0] * 20 + [1] * 12
    assert f["slots"].tolist() == [req.slot, scratch] and f["ends"].tolist() == [20, 12]
    assert f["row0"].tolist() == [0, 20] and f["starts"].tolist() == [0, 0]
    for r in plan.widths:
        assert torch.equal(write[r][:20], plan.write[r]) and (write[r][20:] == rows[r]).all()
    assert f["seg_tok"][0, :20].tolist() == list(range(20)) and (f["seg_tok"][0, 20:] == -1).all()
    assert (f["seg_tok"][1] == -1).all() and f["seg_store_slot"].tolist() == [req.slot, scratch]
    assert f["seg_completes"].tolist() == [0, 0] and f["seg_carry"].tolist() == [0, 0]
    with pytest.raises(ValueError, match="extend of 32 tokens"):
        extend_inputs(shape, req.slot, 0, 32, plan, scratch, rows)


def test_the_graphs_take_one_request_of_two_or_more_tokens_within_the_buckets(micro):
    cfg, w = micro
    graphs = ExtendGraphs(V4Model(cfg, w))
    cache = _serving(cfg)
    req = _request(cache)
    assert graphs.bucket(31) == 32 and graphs.bucket(32) == 64 and graphs.bucket(255) == 256
    assert graphs.bucket(256) is None and not graphs.takes([req], [torch.zeros(256, dtype=torch.long)])
    assert not graphs.takes([req], [torch.zeros(1, dtype=torch.long)])  # a decode step
    assert graphs.takes([req], [torch.zeros(2, dtype=torch.long)])
    other = cache.bind(1, 1, 0)
    assert not graphs.takes([req, other], [torch.zeros(4, dtype=torch.long)] * 2)
