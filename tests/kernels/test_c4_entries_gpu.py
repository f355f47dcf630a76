"""``kernels.c4_entries`` on the GPU: a ratio-4 compressor's entries in two launches give the
compiled torch region's (``ops.c4_entries_torch``) at V4-Flash widths (main 512, indexer 128),
quantisation simulated, for decode steps of 1, 64 and 256 requests and for steps of short and
long chunks (whose state writes overwrite rows other tokens' windows read): the states bit for
bit, the entries within float rounding (Triton's exp and rsqrt are not Inductor's), their fp8 /
fp4 codes the same but where a value lies within rounding of a boundary (then a step apart).
The launches replay from a CUDA graph to the eager call's bits."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.core.model import _c4_window_rows_of
from sglang_dsv4.kernels import c4_entries as kernel
from sglang_dsv4.tiny import preset_config

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(B: int, chunked: bool, kind: str, seed: int):
    """A step of B requests (one token each, or chunks of 1..40 tokens) at random positions, a
    layer's states ([slots + scratch, layers, 8, 2d] viewed at one layer) and the compressor's rows
    -> the arguments of ``ops.c4_entries``."""
    cfg = preset_config("tiny")  # V4-Flash's attention widths
    g = torch.Generator().manual_seed(seed)
    d = cfg.head_dim if kind == "main" else cfg.index_head_dim
    prefix = "attn.compressor" if kind == "main" else "attn.indexer.compressor"
    n = torch.randint(1, 41, (B,), generator=g) if chunked else torch.ones(B, dtype=torch.long)
    starts = torch.randint(0, 5000, (B,), generator=g)
    starts[: B // 4] = torch.randint(0, 8, (B // 4,), generator=g)  # windows reaching before position 0
    positions = torch.cat([torch.arange(p, p + k) for p, k in zip(starts.tolist(), n.tolist())])
    tok_req = torch.repeat_interleave(torch.arange(B), n)
    row0 = torch.cumsum(torch.cat((torch.zeros(1, dtype=torch.long), n)), 0)[:-1]
    n_slots = B + 5
    slots = torch.randperm(n_slots - 1, generator=g)[:B]
    dev = lambda t: t.to(DEV)  # noqa: E731
    idx, dst = _c4_window_rows_of(*map(dev, (positions, tok_req, starts, starts + n, row0, slots)), n_slots - 1)
    rope = ops.rope_at(dev(positions) - 3, ops.layer_inv_freqs(cfg, 4, DEV))
    T = positions.shape[0]
    a = (torch.randn(T, 3 * d, generator=g) * 2).to(DEV)[:, :2 * d]  # a column slice, as stacked projections
    s = (torch.randn(T, 2 * d, generator=g) * 3).to(DEV)
    state_a = torch.randn(n_slots, 3, 8, 2 * d, generator=g).to(DEV)[:, 1]
    state_s = (torch.randn(n_slots, 3, 8, 2 * d, generator=g) * 3).to(DEV)[:, 1]
    w = {f"{prefix}.norm.weight": (torch.rand(d, generator=g) + 0.5).to(DEV)}
    return cfg, (a, s, state_a, state_s, dev(slots), idx, dst, w, prefix, rope, cfg, kind == "index", True)


def _check(got: torch.Tensor, want: torch.Tensor, cfg, is_indexer: bool) -> None:
    coded = want.shape[1] if is_indexer else cfg.nope_head_dim  # main: the rope dims stay floats
    err = (got - want).abs() / want.abs().amax(-1, keepdim=True)
    if coded < want.shape[1]:
        assert float(err[:, coded:].max()) < 2e-6
    diff = got[:, :coded] != want[:, :coded]
    assert int(diff.sum()) <= max(2, 1e-3 * diff.numel()), int(diff.sum())
    assert float(err[:, :coded].max()) <= 0.5  # a step of the format at most


@pytest.mark.parametrize("kind", ["main", "index"])
@pytest.mark.parametrize("B,chunked", [(1, False), (64, False), (256, False), (64, True)])
def test_the_kernel_gives_the_compiled_regions_entries_and_states(B, chunked, kind, monkeypatch):
    monkeypatch.setattr(kernel, "ENABLED", True)
    cfg, args = _case(B, chunked, kind, B + chunked)
    a, s, state_a, state_s, idx, rope = args[0], args[1], args[2], args[3], args[5], args[9]
    assert kernel.supported(a, s, state_a, state_s, idx, rope, cfg, kind == "index")
    sa, ss = state_a.clone(), state_s.clone()
    want = ops.c4_entries_torch(a, s, sa, ss, *args[4:])
    got = ops.c4_entries(*args)
    assert torch.equal(state_a[:-1], sa[:-1]) and torch.equal(state_s[:-1], ss[:-1])  # the scratch slot aside
    _check(got, want, cfg, kind == "index")


@pytest.mark.parametrize("kind", ["main", "index"])
def test_the_kernel_replays_from_a_graph(kind, monkeypatch):
    monkeypatch.setattr(kernel, "ENABLED", True)
    args = _case(64, False, kind, 0)[1]
    a, s, state_a, state_s, slots, idx, dst, w, prefix, rope = args[:10]
    fresh = _case(64, False, kind, 1)[1]
    ops.c4_entries(*args)  # compiled and warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.c4_entries(*args)
    # the next step's inputs in the captured tensors (the states as they were before it)
    norm = f"{prefix}.norm.weight"
    for t, new in zip((a, s, state_a, state_s, slots, idx, *dst, w[norm], *rope),
                      (*fresh[:6], *fresh[6], fresh[7][norm], *fresh[9])):
        t.copy_(new)
    graph.replay()
    eager_a, eager_s = fresh[2].clone(), fresh[3].clone()
    want = ops.c4_entries(fresh[0], fresh[1], eager_a, eager_s, *fresh[4:])
    assert torch.equal(out, want)
    assert torch.equal(state_a[:-1], eager_a[:-1]) and torch.equal(state_s[:-1], eager_s[:-1])


@pytest.mark.parametrize("kind", ["main", "index"])
@pytest.mark.parametrize("B,chunked", [(64, False), (64, True)])
def test_bf16_rows_with_their_bias_give_the_bits_of_the_rows_widened_and_biased(B, chunked, kind, monkeypatch):
    """The compressor GEMMs' bf16 rows with the position bias still to add (``ops.compressor_gemms``,
    the serving step's operands): the kernel widens them and adds the bias on load, the region
    first; each gives the bits it gives the float32 rows with the bias added beforehand
    (``ops.with_position_bias``), entries and states."""
    monkeypatch.setattr(kernel, "ENABLED", True)
    cfg, args = _case(B, chunked, kind, 7 + chunked)
    a, s, state_a, state_s, slots, idx, dst, w, prefix, rope = args[:10]
    g = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 9000, (a.shape[0],), generator=g).to(DEV)
    w[f"{prefix}.ape"] = ape = (torch.randn(4, a.shape[1], generator=g)).to(DEV)
    a16, s16 = a.bfloat16(), s.bfloat16()
    wide = (a16.float(), ops.with_position_bias(s16, ape, positions, torch.float32))
    rest = (slots, idx, dst, w, prefix, rope, cfg, kind == "index", True)
    assert kernel.supported(a16, s16, state_a, state_s, idx, rope, cfg, kind == "index", ape, positions)
    for region in (False, True):
        fn = ops.c4_entries_torch if region else ops.c4_entries
        sa, ss, sa2, ss2 = state_a.clone(), state_s.clone(), state_a.clone(), state_s.clone()
        got = fn(a16, s16, sa, ss, *rest, positions)
        want = fn(*wide, sa2, ss2, *rest)
        assert torch.equal(got, want), region
        assert torch.equal(sa[:-1], sa2[:-1]) and torch.equal(ss[:-1], ss2[:-1]), region
