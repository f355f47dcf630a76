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


def _request(cache, row: int = 0):
    if isinstance(cache, V4Cache):
        return cache.new_request()
    return cache.bind(row, 1, 0)


# per request (prompt tokens before, new tokens): group boundaries of both ratios inside, one
# bucket's worth; then several requests in one extend, one of them a single token; the two
# largest buckets (a cold 600-token prompt: 1024; two requests of 550 tokens: 1024)
CASES = [[(150, 7)], [(125, 10)], [(0, 2)], [(250, 40)], [(97, 127)], [(3, 200)],
         [(150, 7), (0, 20), (126, 1)], [(255, 3), (10, 100), (127, 30), (60, 5)],
         [(0, 600)], [(130, 300), (0, 250)]]


@pytest.mark.parametrize("make", [_serving, _reference], ids=["serving", "reference"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(f"{s}:{n}" for s, n in c))
def test_an_extend_laid_out_for_a_graph_equals_the_eager_step(micro, make, case):
    cfg, w = micro
    model = V4Model(cfg, w)
    graphs = ExtendGraphs(model)
    g = torch.Generator().manual_seed(sum(s + n for s, n in case))
    prompts = [torch.randint(0, cfg.vocab_size, (s,), generator=g) for s, _ in case]
    new = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for _, n in case]
    tail = torch.randint(0, cfg.vocab_size, (3, len(case)), generator=g)
    outs = []
    for laid_out in (False, True):
        cache = make(cfg)
        reqs = [_request(cache, i) for i in range(len(case))]
        for req, prompt in zip(reqs, prompts):
            if prompt.numel():
                model.forward(cache, [req], [prompt])
        if laid_out:
            assert graphs.takes(reqs, new)
            streams, hidden = graphs.run_uncaptured(cache, reqs, new)
            n = sum(t.numel() for t in new)
            for req, t in zip(reqs, new):
                req.num_tokens += t.numel()
            rows = (hidden[:n], streams[:n])
        else:
            rows = model.forward(cache, reqs, new, return_hidden=True, return_streams=True, flat=True)
        after = [model.forward(cache, reqs, [t.view(1) for t in ids], return_hidden=True, flat=True) for ids in tail]
        state = {k: v[[r.slot for r in reqs]].clone() for k, v in cache.slot_state.items()}
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
    shape = extend_shape(32, 1, plan.widths, False, torch.device("cuda"))  # the GPU's shape: no CPU padding
    assert (shape.tokens, shape.requests, shape.segments, shape.seg_width) == (32, 1, 2, 32)
    rows = {r: p.scratch_row for r, p in cache.pools.items()}
    f, write, _ = input_views(extend_inputs(shape, [req.slot], [0], [20], plan, scratch, rows), shape)
    assert f["positions"][:20].tolist() == list(range(20)) and (f["positions"][20:] == 0).all()
    assert f["tok_req"].tolist() == [0] * 20 + [1] * 12
    assert f["slots"].tolist() == [req.slot, scratch] and f["ends"].tolist() == [20, 12]
    assert f["row0"].tolist() == [0, 20] and f["starts"].tolist() == [0, 0]
    for r in plan.widths:
        assert torch.equal(write[r][:20], plan.write[r]) and (write[r][20:] == rows[r]).all()
    assert f["seg_tok"][0, :20].tolist() == list(range(20)) and (f["seg_tok"][0, 20:] == -1).all()
    assert (f["seg_tok"][1] == -1).all() and f["seg_store_slot"].tolist() == [req.slot, scratch]
    assert f["seg_completes"].tolist() == [0, 0] and f["seg_carry"].tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"extend of \[32\] tokens"):
        extend_inputs(shape, [req.slot], [0], [32], plan, scratch, rows)


def test_the_graphs_take_extends_of_a_few_requests_within_the_buckets(micro):
    cfg, w = micro
    graphs = ExtendGraphs(V4Model(cfg, w), max_requests=3)
    cache = _serving(cfg)
    reqs = [_request(cache, i) for i in range(4)]

    def ids(*lens):
        return [torch.zeros(n, dtype=torch.long) for n in lens]

    assert graphs.bucket(31) == 32 and graphs.bucket(32) == 64 and graphs.bucket(255) == 256
    assert graphs.bucket(512) == 1024 and graphs.bucket(1023) == 1024
    assert graphs.bucket(1024) is None and not graphs.takes(reqs[:1], ids(1024))
    assert not graphs.takes(reqs[:2], ids(1, 1))  # a decode step
    assert graphs.takes(reqs[:1], ids(2)) and graphs.takes(reqs[:3], ids(1, 5, 1))
    assert not graphs.takes(reqs[:2], ids(1000, 24))  # 1024 tokens: no bucket with a padding token
    assert not graphs.takes(reqs, ids(2, 2, 2, 2))  # more requests than it takes


def test_entry_rows_a_laid_out_extend_replaces_are_retired_as_the_eager_steps_are(micro):
    """A request recomputing positions on token slots that already own entries (the slots of a
    finished request): the rows those slots held leave the tables and go back to the pool, from
    the graph's layout (``retire`` after the run) as from the eager step."""
    cfg, w = micro
    model = V4Model(cfg, w)
    graphs = ExtendGraphs(model)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    used = []
    for laid_out in (False, True):
        cache = _serving(cfg)
        first = cache.bind(0, 1, 0)
        model.forward(cache, [first], [prompt])
        cache.release_rows([0])
        cache.req_to_token[1, :40] = cache.req_to_token[0, :40]  # the same slots, owning entries
        again = cache.bind(1, 1, 0)
        before = cache.pools[4].num_used
        if laid_out:
            graphs.run_uncaptured(cache, [again], [prompt[:20]])
            again.num_tokens += 20
        else:
            model.forward(cache, [again], [prompt[:20]])
        assert cache.pools[4].num_used == before + 5  # rows for the 5 groups, the old 5 pending
        cache.check_integrity()
        cache.free_token_slots(torch.tensor([], dtype=torch.long))  # nothing freed: orphans stay pending
        cache.free_token_slots(cache.req_to_token[1, 39:40].long())  # a free takes the orphans along
        cache.check_integrity()
        used.append({r: p.num_used for r, p in cache.pools.items()})
    assert used[0] == used[1] and used[0][4] == 40 // 4 - 1  # the 10 groups' rows, less the freed slot's
