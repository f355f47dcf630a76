"""The deterministic mode (``V4Model(deterministic=True)``) on the CPU: steps cut into pieces of
``DETERMINISTIC_TILE`` rows and padded to it, decode through the prefill kernel, exact indexer
dots. On the CPU the default path is chunk-invariant already, so the mode must change no
result there: it is checked against the default path bit for bit (which exercises the piece
cutting, padding and reassembly), and on the fp8 storage backend a decode step, which then runs
the prefill kernel, must equal the uncut prefill of the same tokens. Its point, the GPU, is
measured by ``benchmarks/chunk_invariance_gpu.py --modes default,deterministic``."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.step import DETERMINISTIC_TILE, tile_pieces


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("lens, tile", [([3, 130, 1, 64], 64), ([1] * 70, 64), ([64], 64), ([5], 8), ([9, 9], 4)])
def test_tile_pieces_cover_the_step_in_order(lens, tile):
    pieces = tile_pieces(lens, tile)
    assert all(0 < sum(hi - lo for _, lo, hi in p) <= tile for p in pieces)
    assert all(sum(hi - lo for _, lo, hi in p) == tile for p in pieces[:-1])  # only the last is short
    flat = [r for p in pieces for r in p]
    assert [i for i, _, _ in flat] == sorted(i for i, _, _ in flat)  # request order
    for i, n in enumerate(lens):
        mine = [(lo, hi) for j, lo, hi in flat if j == i]
        assert mine[0][0] == 0 and mine[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))  # contiguous, in token order
    assert all(len({i for i, _, _ in p}) == len(p) for p in pieces)  # a request once per piece


def _run(model: V4Model, cfg, backend: str, prompts, decode_steps: int, **kw):
    """All prompts prefilled in one step, then ``decode_steps`` batched greedy steps -> logits."""
    cache = V4Cache(cfg, max_requests=len(prompts) + 1, max_total_tokens=8192, max_seq_len=2048, backend=backend)
    reqs = [cache.new_request() for _ in prompts]
    out = model.forward(cache, reqs, prompts, **kw)
    logits = out[0] if kw.get("return_streams") else out
    logits = torch.cat(logits) if not kw.get("flat") else logits
    got = [out]
    ids = [l[-1].argmax().view(1) for l in torch.split(logits, [p.numel() for p in prompts])]
    for _ in range(decode_steps):
        step = model.forward(cache, reqs, ids)
        got.append(step)
        ids = [l[-1].argmax().view(1) for l in step]
    return got


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kw", [{}, {"flat": True}, {"return_streams": True}], ids=["lists", "flat", "streams"])
def test_deterministic_mode_changes_no_result_on_the_cpu(micro, kw):
    """Several requests in one step, longer than a tile together and alone (cut into pieces),
    then decode steps of more requests than a tile holds."""
    cfg, w = micro
    prompts = [_ids(n, s, cfg.vocab_size) for s, n in enumerate([37, 150, 5, 64, 1, 90])]
    prompts += [_ids(3, 100 + s, cfg.vocab_size) for s in range(DETERMINISTIC_TILE)]  # decode: 70 requests
    ref = _run(V4Model(cfg, w), cfg, "torch", prompts, 3, **kw)
    got = _run(V4Model(cfg, w, deterministic=True), cfg, "torch", prompts, 3, **kw)
    assert _equal(got, ref)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_decode_runs_the_prefill_kernel(micro, deterministic):
    """On FlashMLA's fp8 layout (its torch reference kernels) a decode step of 64 requests (one
    tile, and a multiple of the CPU's: no padding request, so a real decode step) runs the
    decode kernel, whose work split depends on the batch on a GPU; the deterministic mode sends
    it through the prefill kernel, and the decoded token's logits equal those of the uncut
    prefill of the same sequence bit for bit."""
    cfg, w = micro
    model = V4Model(cfg, w, deterministic=deterministic)
    n = DETERMINISTIC_TILE
    seqs = [_ids(41 + s % 7, s, cfg.vocab_size) for s in range(n)]
    calls = {"decode": 0, "prefill": 0}

    def fresh(n: int):
        cache = V4Cache(cfg, max_requests=n, max_total_tokens=16384, max_seq_len=256, backend="torch-fp8")
        kernels = cache.backend.kernels
        for name in calls:
            def counted(*a, _fn=getattr(kernels, name), _name=name, **k):
                calls[_name] += 1
                return _fn(*a, **k)
            setattr(kernels, name, counted)
        return cache, [cache.new_request() for _ in range(n)]

    cache, reqs = fresh(n)
    ref = [out[-1] for out in model.forward(cache, reqs, seqs)]
    cache, reqs = fresh(n)
    model.forward(cache, reqs, [s[:-1] for s in seqs])
    calls.update(decode=0, prefill=0)
    got = [out[-1] for out in model.forward(cache, reqs, [s[-1:] for s in seqs])]
    layers = len(cfg.layer_ratios)
    if deterministic:
        assert calls == {"decode": 0, "prefill": layers}
        assert all(torch.equal(g, r) for g, r in zip(got, ref))
    else:
        assert calls == {"decode": layers, "prefill": 0}


def test_pieces_keep_their_outputs_when_a_replay_reuses_its_buffers(micro, monkeypatch):
    """A decode step replayed from a CUDA graph returns views of the graph's output buffers, which
    the next replay of the same graph overwrites: a step cut into pieces must copy each piece's
    outputs (stand-in here: every single-step output is copied into one reused buffer)."""
    cfg, w = micro
    prompts = [_ids(5 + s % 3, 200 + s, cfg.vocab_size) for s in range(DETERMINISTIC_TILE + 6)]
    ref = _run(V4Model(cfg, w), cfg, "torch", prompts, 2, return_hidden=True, flat=True)
    model = V4Model(cfg, w, deterministic=True)
    real, buf = model._forward_once, {}

    def reusing(cache, reqs, ids, return_streams, return_hidden, flat):
        assert not return_streams
        out = real(cache, reqs, ids, return_streams, return_hidden, True)
        b = buf.setdefault(out.shape[1], torch.empty(4 * DETERMINISTIC_TILE, out.shape[1]))
        b[:out.shape[0]] = out
        view = b[:out.shape[0]]
        return view if flat else list(torch.split(view, [t.numel() for t in ids]))

    monkeypatch.setattr(model, "_forward_once", reusing)
    got = _run(model, cfg, "torch", prompts, 2, return_hidden=True, flat=True)
    assert _equal(got, ref)


def test_the_head_gemm_always_sees_the_whole_tile(micro, monkeypatch):
    """A GPU GEMM's result for a row depends on the row count (cuBLAS picks its kernel by it), so
    the deterministic mode runs every head GEMM over exactly one tile of rows, for a prefill's
    short last piece and a decode step of one request alike. The default mode on the CPU runs
    every GEMM over tiles of ``ops.CPU_ROW_TILE`` rows (MKL picks by shape too): 70 rows in 3, 1 in 1."""
    cfg, w = micro
    rows: list[int] = []
    gemm = ops._gemm

    def spy(x, weight):
        if weight is w["head.weight"]:
            rows.append(x.shape[0])
        return gemm(x, weight)

    monkeypatch.setattr(ops, "_gemm", spy)
    for det, want in ((True, [DETERMINISTIC_TILE] * 3), (False, [ops.CPU_ROW_TILE] * 4)):
        rows.clear()
        model = V4Model(cfg, w, deterministic=det)
        cache = V4Cache(cfg, max_requests=1, max_total_tokens=1024, max_seq_len=512)
        req = cache.new_request()
        out = model.forward(cache, [req], [_ids(70, 3, cfg.vocab_size)])[0]  # det: pieces of 64 and 6
        out2 = model.forward(cache, [req], [out[-1].argmax().view(1)])[0]
        assert out.shape[0] == 70 and out2.shape[0] == 1
        assert rows == want, (det, rows)


def test_tiled_linear_gives_every_row_alone_its_result_over_one_tile():
    """Any row count: GEMMs of exactly one tile each, rows equal to the row computed alone."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    for n in (0, 1, 7, 8, 9, 21):
        x = torch.randn(n, 24, generator=g)
        got = ops.tiled_linear(x, w, 8)
        assert got.shape == (n, 40)
        for i in range(n):
            assert torch.equal(got[i], ops.tiled_linear(x[i:i + 1], w, 8)[0])
