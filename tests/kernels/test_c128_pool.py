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


_ENTRIES = """
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.core.step import _c128_segments, _pad_segments
from sglang_dsv4.kernels import c128_pool
from sglang_dsv4.tiny import preset_config
c128_pool.ENTRIES = True  # opt-in
g = torch.Generator().manual_seed(0)
worst_plain, worst_step, mismatched, total = 0.0, 0.0, 0, 0
# requests (start, new tokens): decode tokens completing a group or not, a chunk crossing two group
# boundaries (three segments: the first carries the slot's state, the last writes it back), a
# chunk from position 0, a chunk ending on a boundary
for preset in ("micro", "tiny"):
    cfg = preset_config(preset)
    d = cfg.head_dim
    reqs = [(127, 1), (300, 1), (100, 200), (0, 9), (250, 6), (383, 1)]
    starts, lens = torch.tensor([r[0] for r in reqs]), torch.tensor([r[1] for r in reqs])
    row0 = torch.cumsum(torch.cat((torch.zeros(1, dtype=torch.long), lens)), 0)[:-1]
    n_slots = len(reqs) + 3
    slots = torch.randperm(n_slots - 1, generator=g)[:len(reqs)]
    seg = _pad_segments(_c128_segments(starts, lens, row0, slots, n_slots - 1), 4, n_slots - 1)
    seg_slots = slots[torch.searchsorted(row0, seg.last_tok.clamp_min(0), right=True) - 1]
    T = int(lens.sum())
    w = {"attn.compressor.norm.weight": torch.rand(d, generator=g) + 0.5}
    rope = ops.rope_at(seg.first_pos, ops.layer_inv_freqs(cfg, 128))
    a = (torch.randn(T, 2 * d, generator=g) * 2)[:, :d]  # a column slice, as stacked projections
    s = torch.randn(T, d, generator=g) * 3
    state = torch.randn(n_slots, 2, 3, d, generator=g)[:, 1]  # a layer's view
    state[:, 1] = state[:, 1].abs() + 0.5  # sums of exponentials
    for quant in (False, True):
        assert c128_pool.entries_supported(a, s, state, rope, cfg)
        args = (seg.tok, seg.width, seg.carry, seg_slots)
        want_state, got_state = state.clone(), state.clone()
        c128_pool.ENTRIES = False
        want = ops.c128_entries(a, s, *args, want_state, seg.completes, seg.store_slot, w, rope, cfg, quant)
        c128_pool.ENTRIES = True
        got = ops.c128_entries(a, s, *args, got_state, seg.completes, seg.store_slot, w, rope, cfg, quant)
        assert got.shape == want.shape and got.dtype == torch.float32
        # the slots' states (the scratch slot aside): the pooled vectors, within rounding
        scale = want_state[:-1].abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True) + 1e-30
        worst_plain = max(worst_plain, float(((got_state[:-1] - want_state[:-1]).abs() / scale).nan_to_num(0.0).max()))
        if not torch.equal(got_state[:-1].isinf(), want_state[:-1].isinf()):
            worst_plain = float("inf")
        real = torch.isfinite(want).all(-1)  # padding segments pool nothing: 0 / 0
        assert real.sum() >= 8
        got, want = got[real], want[real]
        err = (got - want).abs() / want.abs().amax(-1, keepdim=True)
        coded = cfg.nope_head_dim if quant else 0  # the rope dims stay floats
        worst_plain = max(worst_plain, float(err[:, coded:].max()))
        if quant:
            diff = got[:, :coded] != want[:, :coded]
            mismatched += int(diff.sum())
            total += diff.numel()
            worst_step = max(worst_step, float(err[:, :coded].max()))
    # the GEMMs' bf16 rows with the position bias still to add (ops.compressor_gemms): the torch
    # ops widen them and add it first (the bits of the rows given so), the kernel on load
    positions = torch.cat([torch.arange(p0, p0 + n) for p0, n in reqs])
    w["attn.compressor.ape"] = ape = torch.randn(128, d, generator=g)
    a16, s16 = a.bfloat16(), s.bfloat16()
    assert c128_pool.entries_supported(a16, s16, state, rope, cfg, ape, positions)
    assert not c128_pool.entries_supported(a16, s16, state, rope, cfg)  # bf16 rows need their bias
    tail = (seg.completes, seg.store_slot, w, rope, cfg, False)
    want_state, plain_state, got_state = state.clone(), state.clone(), state.clone()
    c128_pool.ENTRIES = False
    want = ops.c128_entries(a16, s16, *args, want_state, *tail, positions)
    plain = ops.c128_entries(a16.float(), ops.with_position_bias(s16, ape, positions, torch.float32), *args,
                             plain_state, *tail)
    if not (torch.equal(want.nan_to_num(), plain.nan_to_num()) and torch.equal(want_state[:-1], plain_state[:-1])):
        worst_plain = float("inf")
    c128_pool.ENTRIES = True
    got = ops.c128_entries(a16, s16, *args, got_state, *tail, positions)
    scale = want_state[:-1].abs().nan_to_num(0.0, 0.0, 0.0).amax(-1, keepdim=True) + 1e-30
    worst_plain = max(worst_plain, float(((got_state[:-1] - want_state[:-1]).abs() / scale).nan_to_num(0.0).max()))
    real = torch.isfinite(want).all(-1)
    worst_plain = max(worst_plain, float(((got[real] - want[real]).abs()
                                          / want[real].abs().amax(-1, keepdim=True)).max()))
print("mismatched", mismatched, "of", total, "worst step", worst_step)
if mismatched > max(2, 1e-3 * total) or worst_step > 0.5:
    worst_plain = float("inf")
print("WORST", worst_plain)
"""


def test_the_entries_kernel_gives_the_torch_ops_entries_and_states(triton_interpreted):
    """``ops.c128_entries`` through ``c128_pool.entries`` (two launches) against the torch ops it
    replaces (``c128_start``, the pooling, ``c128_finish``), interpreted: segments of decode tokens
    and of chunks across group boundaries (a request's first segment reads the state its last one
    writes), padding segments, quantisation simulated and not, float32 rows and the GEMMs' bf16
    rows with their position bias added by the kernel; the states and float dims within
    rounding, the fp8 codes the same but within rounding of a boundary."""
    assert triton_interpreted(_ENTRIES) < 2e-6


def test_the_entries_kernel_is_opt_in(monkeypatch):
    from sglang_dsv4.core import ops
    from sglang_dsv4.tiny import preset_config

    cfg = preset_config("micro")
    d = cfg.head_dim
    a, state = torch.zeros(4, d), torch.zeros(2, 3, d)
    rope = ops.rope_at(torch.zeros(2, dtype=torch.long), ops.layer_inv_freqs(cfg, 128))
    monkeypatch.setattr(c128_pool, "ENTRIES", False)
    assert not c128_pool.entries_supported(a, a, state, rope, cfg)
    monkeypatch.setattr(c128_pool, "ENTRIES", True)
    assert c128_pool.entries_supported(a, a, state, rope, cfg) == triton_support.INTERPRET
    assert not c128_pool.entries_supported(a.double(), a.double(), state.double(), rope, cfg)
