"""The batched step on the GPU (tiny preset, bf16 matrices, FlashMLA, the serving cache): batched
equals per-request, the grouped-GEMM MoE equals the sorted loop, a decode step never syncs with
the host, and device memory stays flat over many steps."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import branches, compiled, ops
from sglang_dsv4.core.model import V4Model

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _prefill_all(model, srv, prompts):
    """Each prompt prefilled alone in its own row -> the request states."""
    states = []
    for i, p in enumerate(prompts):
        srv.slots(i, 0, p.numel())
        st = srv.cache.bind(i, 1, 0)
        model.forward(srv.cache, [st], [p.to(DEV)])
        states.append(st)
    return states


def _decode(model, srv, rows, states, ids, as_batch: bool = False):
    """One decode step; ``as_batch``: the tokens as one [B, 1] tensor, as the server passes them."""
    for r, st in zip(rows, states):
        srv.slots(r, st.num_tokens, 1)
    return model.forward(srv.cache, states, ids.view(-1, 1) if as_batch else [t.view(1) for t in ids])


def test_batched_decode_equals_each_request_alone(tiny_gpu, serving_rows):
    """Eight requests at different lengths: one batched step per position vs each request
    stepped alone. Same kernels; GEMM row counts differ, so equal to bf16 rounding."""
    cfg, w = tiny_gpu
    model = V4Model(cfg, w)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (3, 60, 127, 128, 129, 200, 257, 300)]
    tails = torch.randint(0, cfg.vocab_size, (len(prompts), 12), generator=g).to(DEV)

    def run(batched: bool):
        srv = serving_rows(cfg, len(prompts) + 1)
        states = _prefill_all(model, srv, prompts)
        out = []
        for t in range(tails.shape[1]):
            if batched:
                out.append(torch.cat(_decode(model, srv, range(len(states)), states, tails[:, t])))
            else:
                out.append(torch.cat([_decode(model, srv, [i], [st], tails[i:i + 1, t])[0]
                                      for i, st in enumerate(states)]))
        srv.cache.check_integrity()
        return torch.stack(out)

    a, b = run(True), run(False)
    err = (a - b).norm(dim=-1) / b.norm(dim=-1)
    assert err.median() < 2e-2, f"median rel err {err.median():.3g}"
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_grouped_gemm_moe_equals_the_sorted_loop(tiny_gpu):
    cfg, w = tiny_gpu
    lw = {k[len("layers.2."):]: v for k, v in w.items() if k.startswith("layers.2.")}
    assert ops.grouped_mm_available(torch.device(DEV), torch.bfloat16)
    x = torch.randn(77, cfg.hidden_size, device=DEV)
    ids = torch.randint(0, cfg.vocab_size, (77,), device=DEV)
    loop = ops.routed_experts(x, ids, lw, cfg, False)
    stacked = dict(lw)
    ops.stack_experts(stacked, range(cfg.n_routed_experts))
    grouped = ops.routed_experts(x, ids, stacked, cfg, False)
    err = (grouped - loop).norm(dim=-1) / loop.norm(dim=-1)
    assert err.max() < 1e-2, f"max rel err {err.max():.3g}"


@pytest.mark.parametrize("streams", [False, True], ids=["one-stream", "branch-streams"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_decode_step_never_syncs_and_memory_stays_flat(tiny_gpu, graphs, streams, serving_rows, monkeypatch):
    """``streams``: a layer's independent chains on side streams (``core.branches``): the forks
    and joins are stream waits, no host sync, and the side streams' blocks are reused, not grown."""
    monkeypatch.setattr(branches, "ENABLED", streams)
    cfg, w = tiny_gpu
    model = V4Model(cfg, w)
    if graphs:
        model.enable_cuda_graphs(max_batch=8)
    srv = serving_rows(cfg, 5, max_len=2048)
    g = torch.Generator().manual_seed(1)
    states = []
    for i in range(4):
        srv.slots(i, 0, 100 + 37 * i)
        st = srv.cache.bind(i, 1, 0)
        model.forward(srv.cache, [st], [torch.randint(0, cfg.vocab_size, (100 + 37 * i,), generator=g).to(DEV)])
        states.append(st)
    ids = torch.randint(0, cfg.vocab_size, (4,), generator=g).to(DEV)
    rows = torch.arange(4, device=DEV)

    def step(ids):
        pos = torch.tensor([st.num_tokens for st in states], device=DEV)
        srv.cache.req_to_token[rows, pos] = torch.arange(srv.next, srv.next + 4, dtype=torch.int32, device=DEV)
        srv.next += 4
        out = model.forward(srv.cache, states, [t.view(1) for t in ids])
        return torch.cat(out).argmax(-1)

    for _ in range(10):
        ids = step(ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model_step_ids = ids
        for _ in range(3):  # the model's step itself: token ids stay on the device
            states_pos = [st.num_tokens for st in states]
            srv.cache.req_to_token[rows, torch.tensor(states_pos).to(DEV, non_blocking=True)] = torch.arange(
                srv.next, srv.next + 4, dtype=torch.int32).to(DEV, non_blocking=True)
            srv.next += 4
            out = model.forward(srv.cache, states, [t.view(1) for t in model_step_ids])
            model_step_ids = torch.cat(out).argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    before, capacity = torch.cuda.memory_allocated(), {r: p.capacity for r, p in srv.cache.pools.items()}
    captures = len(model.graphs.captured) if graphs else 0
    for _ in range(1000):
        ids = step(ids)
        if graphs and len(model.graphs.captured) != captures:  # a wider entry table: a new graph
            captures = len(model.graphs.captured)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()  # flat between captures
    torch.cuda.synchronize()
    growth = torch.cuda.memory_allocated() - before
    assert {r: p.capacity for r, p in srv.cache.pools.items()} == capacity  # room for these entries
    assert growth <= 4096, f"allocated device bytes grew by {growth} over 1000 decode steps"
    srv.cache.check_integrity()


def test_graph_replay_equals_eager_bit_for_bit(tiny_gpu, serving_rows):
    """Eight requests (a bucket: no padding) decoded eagerly and from CUDA graphs, over two
    caches filled identically: the logits are equal, step after step, across a C4 and a C128
    group boundary. The replayed steps take their tokens as one [8, 1] tensor (the server's
    form), the eager ones as a tensor per request."""
    cfg, w = tiny_gpu
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 70, 120, 125, 126, 127, 250, 255)]
    tails = torch.randint(0, cfg.vocab_size, (8, 6), generator=g).to(DEV)
    outs = []
    for graphs in (False, True):
        model = V4Model(cfg, w)
        if graphs:
            model.enable_cuda_graphs(max_batch=16)
        srv = serving_rows(cfg, 9)
        states = _prefill_all(model, srv, prompts)
        outs.append(torch.stack([torch.cat(_decode(model, srv, range(8), states, tails[:, t], as_batch=graphs))
                                 for t in range(tails.shape[1])]))
        if graphs:
            assert model.graphs.captured and model.graphs.captured[0][0] == 8
        srv.cache.check_integrity()
    assert torch.equal(outs[0], outs[1])


def test_branch_streams_give_the_same_bits_eager_and_replayed(tiny_gpu, serving_rows, monkeypatch):
    """A layer's chains on side streams (``core.branches``, prefill and decode) against one
    stream: the same kernels on the same inputs, so the same logits bit for bit, eager and from
    CUDA graphs captured over the forks and joins; a race between the streams shows here."""
    cfg, w = tiny_gpu
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 70, 120, 125, 126, 127, 250, 255)]
    tails = torch.randint(0, cfg.vocab_size, (8, 6), generator=g).to(DEV)
    outs = {}
    for streams, graphs in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(branches, "ENABLED", streams)
        model = V4Model(cfg, w)
        if graphs:
            model.enable_cuda_graphs(max_batch=16)
        srv = serving_rows(cfg, 9)
        states = _prefill_all(model, srv, prompts)
        outs[streams, graphs] = torch.stack([torch.cat(_decode(model, srv, range(8), states, tails[:, t],
                                                               as_batch=graphs)) for t in range(tails.shape[1])])
        srv.cache.check_integrity()
    assert torch.equal(outs[True, False], outs[False, False])
    assert torch.equal(outs[True, True], outs[False, False])


def test_one_model_over_caches_made_one_after_another_replays_each_caches_own_graphs(tiny_gpu, serving_rows):
    """A model with graphs serving a cache, then (that cache gone) a new one of the same shape,
    which Python may give the old one's id() and the allocator its addresses: the new cache's
    steps equal the eager ones bit for bit, and the old cache's graphs went with it."""
    import gc

    cfg, w = tiny_gpu
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (40, 130)]
    tails = torch.randint(0, cfg.vocab_size, (2, 4), generator=g).to(DEV)
    eager, graphed = V4Model(cfg, w), V4Model(cfg, w)
    graphed.enable_cuda_graphs(max_batch=4)

    def run(model, rows_len):
        srv = serving_rows(cfg, 3, max_len=rows_len)
        states = _prefill_all(model, srv, prompts)
        out = torch.stack([torch.cat(_decode(model, srv, range(2), states, tails[:, t])) for t in range(4)])
        srv.cache.check_integrity()
        return out

    for rows_len in (1024, 1024, 512):
        want = run(eager, rows_len)
        got = run(graphed, rows_len)
        gc.collect()
        assert torch.equal(got, want), rows_len
        assert len(graphed.graphs.graphs) == 0  # the caches of the finished runs took their graphs along


@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_the_attention_casts_inside_the_fused_projections_give_the_same_bits(tiny_gpu, tokens):
    """q rounded to FlashMLA's bf16 inside ``project_q`` and the kernel's bf16 output widened
    inside ``attention_output`` (one fused region each on the GPU) give the bits of the separate
    casts they replace: the eager ``q.to(bf16)`` and ``o.to(float32)`` around the kernel."""
    cfg, w = tiny_gpu
    lw = ops.layer_view(w, "layers.0")
    g = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, cfg.hidden_size, generator=g, device=DEV)
    pos = torch.randint(0, 70000, (tokens,), generator=g, device=DEV)
    rope = ops.rope_at(pos, ops.layer_inv_freqs(cfg, 0, DEV))
    q, qr = ops.project_q(x, lw, rope, cfg, torch.bfloat16)
    q_was, qr_was = ops.project_q(x, lw, rope, cfg)
    assert q.dtype == torch.bfloat16 and torch.equal(q, q_was.to(torch.bfloat16))
    if compiled.ENABLED:
        # qr (the indexer's latent) takes no cast: compiled, the two variants of the region may
        # fuse its ops differently (the 37-token case on the H200, 2026-12-05): equal to rounding
        torch.testing.assert_close(qr, qr_was, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(qr, qr_was)
    o = torch.randn(tokens, cfg.num_attention_heads, cfg.head_dim, generator=g, device=DEV).to(torch.bfloat16)
    got = ops.attention_output(o, lw, rope, cfg, torch.float32)
    assert torch.equal(got, ops.attention_output(o.float(), lw, rope, cfg))


def test_graphs_captured_at_start_up_replay_as_those_captured_on_first_use(tiny_gpu, serving_rows, eager_regions):
    """``V4Model.precapture_graphs`` (a server's start-up, ``--dsv4-cuda-graph-precapture-len``)
    captures every batch bucket's decode step and every token bucket's one-request extend at
    each width up to the length; the steps after it capture nothing new and equal, bit for bit,
    a model whose graphs were captured on first use (the fused regions eager: ``eager_regions``,
    since the start-up captures run many shapes first, and with them other compiled variants)."""
    cfg, w = tiny_gpu
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (20, 130, 300)]
    tails = torch.randint(0, cfg.vocab_size, (3, 4), generator=g).to(DEV)
    outs = []
    for early in (True, False):
        model = V4Model(cfg, w)
        model.enable_cuda_graphs(max_batch=4, extend=True)
        srv = serving_rows(cfg, 4)
        if early:
            decode, extend = model.precapture_graphs(srv.cache, 512)
            assert sorted({b for b, _ in decode}) == [1, 2, 4] and extend
            counts = len(model.graphs.captured), len(model.extend_graphs.captured)
        states = _prefill_all(model, srv, prompts)  # extends of one request, < 1024 tokens
        out = [torch.cat(_decode(model, srv, range(3), states, tails[:, t], as_batch=True)) for t in range(4)]
        if early:
            assert (len(model.graphs.captured), len(model.extend_graphs.captured)) == counts
        outs.append(torch.stack(out))
        srv.cache.check_integrity()
    assert torch.equal(outs[0], outs[1])
