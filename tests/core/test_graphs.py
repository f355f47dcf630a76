"""The decode graphs' host inputs (``core.graphs``): the step a replay reads equals the step the
eager path builds (``step.build_step`` + ``step.step_tables``), and padding requests only ever
touch scratch state. Runs on the CPU: graph capture itself is covered by tests/core/test_step_gpu.py."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core.cache import RequestState, V4Cache
from sglang_dsv4.core.graphs import decode_inputs, decode_step, input_views
from sglang_dsv4.core.step import C128_FIELDS, build_step, step_tables
from sglang_dsv4.srt.state import SglangV4Cache

STARTS = [0, 5, 127, 128, 255, 3, 511]  # group boundaries of both ratios on either side


def _serving(cfg):
    cache = SglangV4Cache.with_own_table(cfg, 8, 8192, max_seq_len=1024, device="cpu", backend="torch")
    cache.req_to_token.copy_(torch.arange(8 * 1024).view(8, 1024))
    return cache


def _reference(cfg):
    return V4Cache(cfg, max_requests=8, max_total_tokens=8192, max_seq_len=1024)


def _requests(cache, starts):
    if isinstance(cache, V4Cache):
        reqs = [cache.new_request() for _ in starts]
        for req, s in zip(reqs, starts):  # entries of the positions before: reserved like a prefill's
            cache.reserve_entries([req], [s])
            req.num_tokens = s
        return reqs
    return [RequestState(slot=i, num_tokens=s) for i, s in enumerate(starts)]


@pytest.mark.parametrize("make", [_serving, _reference], ids=["serving", "reference"])
def test_graph_inputs_equal_the_eager_step_and_pad_with_scratch(tiny, make):
    cfg, _ = tiny
    B, b = len(STARTS), 8
    ids = [torch.tensor([7 + i]) for i in range(B)]
    eager_cache, graph_cache = make(cfg), make(cfg)  # the same state: the same rows are handed out
    reqs_e, reqs_g = _requests(eager_cache, STARTS), _requests(graph_cache, STARTS)
    scratch = eager_cache.layout.scratch_slot(eager_cache.slot_state)

    step = build_step(reqs_e, ids, STARTS, scratch, torch.device("cpu"), with_c128=True)
    step.tables = step_tables(eager_cache, reqs_e, step)

    plan = graph_cache.plan_tables(reqs_g, STARTS, [1] * B, torch.tensor(STARTS))
    inputs = decode_inputs(graph_cache, reqs_g, STARTS, plan, b)
    f, write, entries = input_views(inputs, b, plan.widths, plan.entries is not None)
    g = decode_step(f, torch.cat(ids + [torch.zeros(b - B, dtype=torch.long)]), torch.arange(b), scratch, True)
    tables = graph_cache.apply_tables(g, write, entries, plan.widths)

    real = slice(0, B)
    for name in ("ids", "positions", "tok_req", "row0", "slots", "starts", "ends"):
        assert torch.equal(getattr(g, name)[real], getattr(step, name)), name
    for name in C128_FIELDS:
        assert torch.equal(getattr(g.c128, name)[real], getattr(step.c128, name)[real]), name
    for r in plan.widths:
        assert torch.equal(tables.write_rows[r][real], step.tables.write_rows[r]), r
        assert torch.equal(tables.entry_rows[r][real], step.tables.entry_rows[r]), r
        # padding requests: nothing completes, writes go to the scratch row, no entries
        assert (tables.write_rows[r][B:] == graph_cache.pools[r].scratch_row).all()
        assert (tables.entry_rows[r][B:, 1:] == -1).all()
    pad = slice(B, b)
    assert (g.slots[pad] == scratch).all() and (g.c128.store_slot[pad] == scratch).all()
    assert (g.positions[pad] == 0).all() and not g.c128.completes[pad].any() and not g.c128.carry[pad].any()


def test_captured_steps_reuse_a_shapes_graph_until_the_storage_moves(monkeypatch):
    """``CapturedSteps.graph_for`` (the decode and extend graphs' store): a shape's graph is
    captured once per cache storage, dropped when a pool it reads is reallocated, and a new
    memory pool is taken once every graph is gone (the old one died with them)."""
    import gc

    from sglang_dsv4.core.graphs import CapturedSteps

    handles = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))

    class Pool:
        def __init__(self):
            self.tensors = {"main": torch.zeros(4)}

    class Cache:
        def __init__(self):
            self.pools, self.req_to_token = {4: Pool()}, torch.zeros(2, 8)

    store, cache, made = CapturedSteps(), Cache(), []

    def capture():
        made.append(object())
        return made[-1]

    g, new = store.graph_for(cache, (8, (64,)), capture)
    assert new and store.pool == 0
    assert store.graph_for(cache, (8, (64,)), capture) == (g, False)
    other, new = store.graph_for(cache, (16, (64,)), capture)
    assert new and other is not g and store.pool == 0  # one pool for every shape
    cache.pools[4].tensors["main"] = torch.zeros(8)  # the pool grew: its graphs read old storage
    moved, new = store.graph_for(cache, (8, (64,)), capture)
    assert new and moved is not g and len(store.graphs[cache]) == 2  # the stale (8, ...) graph dropped
    del cache
    gc.collect()
    assert not any(store.graphs.values())
    store.graph_for(Cache(), (8, (64,)), capture)
    assert store.pool == 1 and len(made) == 4


def test_width_classes_are_every_width_a_step_up_to_the_length_takes(tiny):
    """``graphs.width_classes``: the entry-table widths of steps ending at 1..max_end tokens,
    each once, narrowest first (the GPU's power-of-two buckets; on the CPU one width)."""
    from sglang_dsv4.core.graphs import width_classes

    cfg, _ = tiny
    for make in (_serving, _reference):
        cache = make(cfg)
        assert width_classes(cache, 1000) == [cache.table_widths(1000)]  # the CPU: the full width
        cache.device = torch.device("cuda")  # table_widths reads only this: the GPU's buckets
        for max_end in (1, 300, 1000, 1024):
            every = [cache.table_widths(e) for e in range(1, max_end + 1)]
            classes = width_classes(cache, max_end)
            assert classes == [w for i, w in enumerate(every) if w not in every[:i]]
        # ratio 4: 64, 128, then 256 (the tables' cap at 1024 tokens); ratio 128: 64 throughout
        assert [w[4] for w in width_classes(cache, 1024)] == [64, 128, 256]


def test_precapture_takes_every_shape_steps_up_to_the_length_use(tiny, monkeypatch):
    """Start-up capture (``precapture``) covers the decode graph key of every batch and the
    extend shape of one request of every token count, at every length up to ``max_end``, so
    none is captured on its first use; a second call captures nothing. The capture itself is
    the GPU's (``test_step_gpu.py``); here what would be captured is recorded."""
    from types import SimpleNamespace

    from sglang_dsv4.core.extend_graphs import ExtendGraphs, extend_shape
    from sglang_dsv4.core.graphs import DecodeGraphs, width_classes

    cfg, _ = tiny
    cache = _serving(cfg)
    cache.device = torch.device("cuda")  # the GPU's width buckets (table_widths reads only this)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: 0)
    model = SimpleNamespace(device=torch.device("cuda"))
    decode, extend = DecodeGraphs(model, max_batch=64), ExtendGraphs(model)
    monkeypatch.setattr(decode, "_capture", lambda cache, b, widths, host: (b, dict(widths), host))
    monkeypatch.setattr(extend, "_capture", lambda cache, shape: shape)
    keys, shapes = set(decode.precapture(cache, 700)), set(extend.precapture(cache, 700))
    assert len(keys) == len(decode.buckets) * len(width_classes(cache, 700)) == len(decode.captured)
    for end in range(1, 701):
        widths = cache.table_widths(end)
        for batch in (1, 3, 17, 64):
            assert (decode.bucket(batch), tuple(widths[r] for r in sorted(widths))) in keys
        for n in (2, 31, 32, 500, min(end, 1023)):
            if extend.bucket(n) is not None:
                assert extend_shape(extend.bucket(n), 1, widths, False, model.device) in shapes
    assert decode.precapture(cache, 700) == [] and extend.precapture(cache, 700) == []
    assert decode.graphs[cache][next(iter(decode.graphs[cache]))][2] is False  # the device's tables
