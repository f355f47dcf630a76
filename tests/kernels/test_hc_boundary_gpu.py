"""``kernels.hc_boundary`` on the GPU: a sublayer boundary in two launches against the torch ops
it replaces as the GPU runs them (``hc_post``'s region, SGLang's mixes and Sinkhorn where it
imports, the weighted norm's region) at V4-Flash's width (hc 4 x 4096), for 1, 64 and 256 tokens,
with the MoE's second output part and without, and the first sublayer's; float rounding apart
(other summation orders), each row the same bits alone as in the batch, and a CUDA graph's replay
the eager call's bits. Then a tiny model's decode logits with the kernel on against off."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_boundary as kernel
from sglang_dsv4.tiny import preset_config

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(T: int, seed: int, D: int = 4096):
    cfg = preset_config("tiny")
    hc = cfg.hc_mult
    g = torch.Generator().manual_seed(seed)
    dev = lambda t: t.to(DEV)  # noqa: E731
    h = dev(torch.randn(T, hc, D, generator=g))
    f, f_plus = dev(torch.randn(T, D, generator=g)), dev(torch.randn(T, D, generator=g))
    post = dev(torch.rand(T, hc, generator=g) * 2)
    comb = dev(torch.softmax(torch.randn(T, hc, hc, generator=g), -1))
    fn = dev(torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.02)
    base, scale = dev(torch.randn((2 + hc) * hc, generator=g) * 0.5), dev(torch.rand(3, generator=g) + 0.5)
    norm = dev(torch.rand(D, generator=g) + 0.5)
    return cfg, h, (f, post, comb, f_plus), (fn, base, scale, norm)


@pytest.mark.parametrize("fma_mix", [False, True])
@pytest.mark.parametrize("T", [1, 64, 256])
@pytest.mark.parametrize("kind", ["attention", "moe", "first"])
def test_the_kernel_gives_the_torch_ops_boundary(T, kind, fma_mix, monkeypatch):
    """The mixes as launch 1's tl.dot and as its column FMAs (``FMA_MIX``, the default)."""
    monkeypatch.setattr(kernel, "FMA_MIX", fma_mix)
    cfg, h, (f, post, comb, f_plus), (fn, base, scale, norm) = _case(T, T)
    done = None if kind == "first" else ops.SublayerOutput(f, post, comb, f_plus if kind == "moe" else None)
    monkeypatch.setattr(kernel, "MAX_ROWS", 1 << 30)  # the kernel itself, past the rows it takes in a model
    monkeypatch.setattr(kernel, "ENABLED", False)
    want = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
    monkeypatch.setattr(kernel, "ENABLED", True)
    assert kernel.supported(h, fn, norm, cfg, done and done.f, done and done.f_plus)
    got = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
    for a, b in zip(got, want):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
    i = T // 2
    part = done and ops.SublayerOutput(*(t[i:i + 1] if t is not None else None for t in done))
    alone = ops.hc_boundary(h[i:i + 1].contiguous(), part, fn, base, scale, cfg, norm)
    assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, got))


@pytest.mark.parametrize("fma_mix", [False, True])
def test_the_kernel_replays_from_a_graph(fma_mix, monkeypatch):
    monkeypatch.setattr(kernel, "ENABLED", True)
    monkeypatch.setattr(kernel, "FMA_MIX", fma_mix)
    cfg, h, (f, post, comb, f_plus), (fn, base, scale, norm) = _case(64, 0)
    done = ops.SublayerOutput(f, post, comb, f_plus)
    eager = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
    _, h2, (f2, post2, comb2, plus2), _ = _case(64, 1)
    for dst, src in ((h, h2), (f, f2), (post, post2), (comb, comb2), (f_plus, plus2)):
        dst.copy_(src)
    graph.replay()
    want = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert not torch.equal(out[1], eager[1])


def test_a_model_with_the_kernel_gives_its_logits(tiny_gpu, monkeypatch):
    """Prefill and decode of the tiny model: the logits of the default path, as far as this model
    lets rounding-level differences through. Its bf16 matrices round x, and a near-tie of the
    router's top-2 among 16 random experts then flips for a token: that row moves, and every later
    row attending to it (0.4-0.6% of the logits' norm from such a row on, on the H200 in session 35
    and on the CPU with bf16 matrices, interpreted; 0.3-0.6% there without the simulated
    quantisation; the kernel's own outputs within 7e-7 of the default's). The fp32 micro model,
    interpreted (``test_hc_boundary.py``), holds the model to 1e-5; here the bounds are those of the
    step's other rounding-level comparisons (``test_step_gpu.py``)."""
    from sglang_dsv4.core.cache import V4Cache
    from sglang_dsv4.core.model import V4Model

    cfg, w = tiny_gpu
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).to(DEV)
    logits = []
    for on in (False, True):
        monkeypatch.setattr(kernel, "ENABLED", on)
        model = V4Model(cfg, w)
        cache = V4Cache(cfg, max_requests=1, max_total_tokens=512, page_size=64, device=DEV)
        req = cache.new_request()
        out = [model.forward(cache, [req], [ids[:33]])[0]]
        out += [model.forward(cache, [req], [ids[p:p + 1]])[0] for p in range(33, 40)]
        logits.append(torch.cat(out).float())
    err = (logits[1] - logits[0]).norm(dim=-1) / logits[0].norm(dim=-1)
    assert float(err.median()) < 1e-2 and float(err.max()) < 5e-2, err
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("T", [1, 64])
def test_the_kernels_fp8_operands_are_the_quantisers_bytes(T, monkeypatch):
    """At V4-Flash's width: launch 2's fp8 operands of y against ``quantize_act(y)`` as the GPU
    runs it (a fused region), byte for byte; the other outputs those of the call without them."""
    from sglang_dsv4.kernels import fp8_linear
    from sglang_dsv4.kernels.fp8_linear import quantize_act

    monkeypatch.setattr(kernel, "ENABLED", True)
    monkeypatch.setattr(fp8_linear, "SHARED_OPERANDS", True)
    cfg, h, (f, post, comb, f_plus), (fn, base, scale, norm) = _case(T, 7)
    done = ops.SublayerOutput(f, post, comb, f_plus)
    plain = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
    got = ops.hc_boundary(h, done, fn, base, scale, cfg, norm, quantized=True)
    q, s = quantize_act(got[1])
    assert torch.equal(got[4].q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[4].s, s)
    assert all(torch.equal(a, b) for a, b in zip(got[:4], plain))
