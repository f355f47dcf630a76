"""``kernels.c128_pool`` on the GPU: the one-launch pooling against the loop it replaces (its
eager ops and its compiled region), a segment continued across calls to the same bits, graph
replay, and a tiny model's prefill + decode with the kernel against the loop. The rest of the GPU
suite runs the step with the kernel (the default); ``SGLANG_DSV4_C128_POOL=loop`` runs it with the
loop (graph replay = eager, batched = per-request, the deterministic mode's resumed = cold)."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.kernels import c128_pool

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(T: int, d: int, width: int, G: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randn(T, d, generator=g, device=DEV) * 3
    s = torch.randn(T, d, generator=g, device=DEV) * 4
    tok = torch.randint(0, T, (G, width), generator=g, device=DEV)
    tok[0, width // 2:] = -1
    empty = torch.stack((torch.full((d,), float("-inf"), device=DEV), torch.zeros(d, device=DEV),
                         torch.zeros(d, device=DEV)))
    state = torch.cat([empty[None], torch.rand(G - 1, 3, d, generator=g, device=DEV)]) if G > 1 else empty[None]
    return a, s, tok, state


def _loop(a, s, tok, state, width, absorb):
    m, total, acc = state.unbind(1)
    for i in range(width):
        m, total, acc = absorb(m, total, acc, a, s, tok[:, i])
    return torch.stack((m, total, acc), dim=1)


@pytest.mark.parametrize("T,d,width,G", [(32, 512, 32, 1), (2048, 512, 128, 17), (256, 512, 1, 256), (7, 96, 5, 3)])
def test_the_kernel_pools_as_the_loop_it_replaces(T, d, width, G, capsys):
    a, s, tok, state = _case(T, d, width, G, T + width)
    assert c128_pool.supported(a, s, state)
    got = c128_pool.pool(a, s, tok, state, width)
    for name, absorb in (("eager", ops._absorb_position.eager), ("compiled", ops._absorb_position)):
        want = _loop(a, s, tok, state, width, absorb)
        scale = want.abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True) + 1e-30
        err = float(((got - want).abs() / scale).nan_to_num(0.0).max())
        with capsys.disabled():  # whether the bits match too: the default's next step, not a condition
            print(f"\nc128_pool T{T} d{d} w{width} G{G} vs the {name} loop: bit-equal {torch.equal(got, want)}, "
                  f"max error {err:.2e} of the vectors' scale")
        assert err < 1e-6, name


def test_a_segment_continued_across_calls_gives_the_same_bits_and_replays_from_a_graph():
    a, s, tok, state = _case(300, 512, 128, 4, 0)
    whole = c128_pool.pool(a, s, tok, state, 128)
    half = c128_pool.pool(a, s, tok[:, :50].contiguous(), state, 50)
    assert torch.equal(c128_pool.pool(a, s, tok[:, 50:].contiguous(), half, 78), whole)
    out = c128_pool.pool(a, s, tok, state, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = c128_pool.pool(a, s, tok, state, 128)
    a2, s2, _, _ = _case(300, 512, 128, 4, 1)
    a.copy_(a2)
    s.copy_(s2)
    graph.replay()
    assert torch.equal(out, c128_pool.pool(a, s, tok, state, 128))


@pytest.mark.parametrize("switch", ["ENABLED", "ENTRIES"])
def test_a_model_with_the_kernel_opted_in_follows_the_loop(switch, tiny_gpu, serving_rows, monkeypatch):
    """Prefill across ratio-128 group boundaries, then decode, with and without the kernel (the
    pooling alone: ``ENABLED``; the compressor's two launches: ``ENTRIES``, the pooling on)."""
    cfg, w = tiny_gpu
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, cfg.vocab_size, (300,), generator=g).to(DEV)
    tail = torch.randint(0, cfg.vocab_size, (8,), generator=g).to(DEV)

    def run(kernel: bool):
        monkeypatch.setattr(c128_pool, "ENABLED", kernel or switch == "ENTRIES")
        monkeypatch.setattr(c128_pool, "ENTRIES", kernel and switch == "ENTRIES")
        model = V4Model(cfg, w)
        srv = serving_rows(cfg, 2)
        srv.slots(0, 0, 300)
        st = srv.cache.bind(0, 1, 0)
        out = [model.forward(srv.cache, [st], [prompt[:170]])[0], model.forward(srv.cache, [st], [prompt[170:]])[0]]
        for t in tail:
            srv.slots(0, st.num_tokens, 1)
            out.append(model.forward(srv.cache, [st], [t.view(1)])[0])
        return torch.cat(out)

    loop, kernel = run(False), run(True)
    err = (kernel - loop).norm(dim=-1) / loop.norm(dim=-1)
    assert err.max() < 1e-3, f"max rel err {err.max():.3g}"
    assert (kernel.argmax(-1) == loop.argmax(-1)).float().mean() > 0.95


def _entries_case(seed: int, chunks: list[tuple[int, int]]):
    """64 decode requests at random positions (8 completing a group) and ``chunks`` (start, new
    tokens) at V4-Flash's width -> (cfg, generator, positions [T], a, s [T, d] float32, state
    [slots + scratch, 3, d] (a layer's view), w, rope, (tok, width, carry, slots), (completes,
    store_slot)) on the GPU: ``ops.c128_entries``' operands but its flags."""
    from sglang_dsv4.core.step import _c128_segments
    from sglang_dsv4.tiny import preset_config

    cfg = preset_config("tiny")
    d = cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    starts = torch.cat((torch.randint(0, 5000, (64,), generator=g), torch.tensor([c[0] for c in chunks])))
    starts[:8] = 127  # decode tokens completing a group
    lens = torch.cat((torch.ones(64, dtype=torch.long), torch.tensor([c[1] for c in chunks])))
    row0 = torch.cumsum(torch.cat((torch.zeros(1, dtype=torch.long), lens)), 0)[:-1]
    n_slots = lens.numel() + 3
    slots = torch.randperm(n_slots - 1, generator=g)[:lens.numel()]
    seg = _c128_segments(starts, lens, row0, slots, n_slots - 1)
    seg_slots = slots[torch.searchsorted(row0, seg.last_tok, right=True) - 1]
    dev = lambda t: t.to(DEV)  # noqa: E731
    T = int(lens.sum())
    positions = dev(torch.cat([torch.arange(p, p + n) for p, n in zip(starts.tolist(), lens.tolist())]))
    a = dev(torch.randn(T, 2 * d, generator=g) * 2)[:, :d]
    s = dev(torch.randn(T, d, generator=g) * 3)
    state = dev(torch.randn(n_slots, 2, 3, d, generator=g))[:, 1]
    state[:, 1] = state[:, 1].abs() + 0.5
    w = {"attn.compressor.norm.weight": dev(torch.rand(d, generator=g) + 0.5)}
    rope = ops.rope_at(dev(seg.first_pos), ops.layer_inv_freqs(cfg, 128, DEV))
    return (cfg, g, positions, a, s, state, w, rope, (dev(seg.tok), seg.width, dev(seg.carry), dev(seg_slots)),
            (dev(seg.completes), dev(seg.store_slot)))


@pytest.mark.parametrize("quant", [False, True])
def test_the_entries_kernel_gives_the_torch_ops_entries_and_states(quant, monkeypatch):
    """``c128_pool.entries`` (opt-in) against ``c128_start`` + the pooling + ``c128_finish`` at
    V4-Flash's width: 64 decode requests (some completing a group) and chunks across group
    boundaries (a request's first segment reads the state its last one writes back)."""
    cfg, _, _, a, s, state, w, rope, args, flags = _entries_case(5, [(100, 200), (250, 6), (0, 130)])
    tail = (*flags, w, rope, cfg, quant)
    want_state, got_state = state.clone(), state.clone()
    monkeypatch.setattr(c128_pool, "ENTRIES", False)
    want = ops.c128_entries(a, s, *args, want_state, *tail)
    monkeypatch.setattr(c128_pool, "ENTRIES", True)
    assert c128_pool.entries_supported(a, s, state, rope, cfg)
    got = ops.c128_entries(a, s, *args, got_state, *tail)
    scale = want_state[:-1].abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True) + 1e-30
    assert float(((got_state[:-1] - want_state[:-1]).abs() / scale).nan_to_num(0.0).max()) < 1e-6
    err = (got - want).abs() / want.abs().amax(-1, keepdim=True)
    coded = cfg.nope_head_dim if quant else 0
    assert float(err[:, coded:].max()) < 2e-6
    if quant:
        diff = got[:, :coded] != want[:, :coded]
        assert int(diff.sum()) <= max(2, 1e-3 * diff.numel()) and float(err[:, :coded].max()) <= 0.5


def test_bf16_rows_with_their_bias_give_the_bits_of_the_rows_widened_and_biased(monkeypatch):
    """The compressor GEMMs' bf16 rows with the position bias still to add (``ops.compressor_gemms``,
    the serving step's operands) through ``c128_pool.entries`` (widened and biased on load) and
    through the torch ops (widened and biased first): each gives the bits it gives the float32
    rows with the bias added beforehand (``ops.with_position_bias``), entries and states."""
    cfg, g, positions, a, s, state, w, rope, args, flags = _entries_case(6, [(100, 200), (250, 6)])
    a16, s16 = a.bfloat16(), s.bfloat16()
    w["attn.compressor.ape"] = ape = torch.randn(128, cfg.head_dim, generator=g).to(DEV)
    tail = (*flags, w, rope, cfg, True)
    wide = (a16.float(), ops.with_position_bias(s16, ape, positions, torch.float32))
    for on in (True, False):
        monkeypatch.setattr(c128_pool, "ENTRIES", on)
        assert c128_pool.entries_supported(a16, s16, state, rope, cfg, ape, positions) == on
        got_state, want_state = state.clone(), state.clone()
        got = ops.c128_entries(a16, s16, *args, got_state, *tail, positions)
        want = ops.c128_entries(*wide, *args, want_state, *tail)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), on
        assert torch.equal(got_state[:-1], want_state[:-1]), on
