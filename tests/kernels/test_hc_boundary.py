"""``kernels.hc_boundary``: a sublayer boundary (``ops.hc_post`` then ``ops.hc_pre`` with its norm)
in two launches against the torch ops, interpreted on the CPU: widths of one K tile, a ragged last
tile, several slices of several tiles, launch 2 in blocks of 128 dims; with the MoE's second output
part and without; the first sublayer's (no output to expand); a row alone against the same row in
a batch (the same bits: the slicing follows the width only). Then a micro model's logits with the
kernel on against off. With the switch off ``ops.hc_boundary`` runs the torch ops."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_boundary

_CASES = """
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_boundary as kernel
from sglang_dsv4.tiny import preset_config
kernel.ENABLED = True
cfg = preset_config("tiny")
g = torch.Generator().manual_seed(0)
worst = 0.0
kernel.FINISH_BLOCK = 128  # launch 2's blocks of dims: several at these widths
for T, D in ((37, 256), (3, 200), (1, 64), (2, 64 * 80)):  # 64 * 80: 40 slices of 2 tiles
    hc = cfg.hc_mult
    h = torch.randn(T, hc, D, generator=g)
    f, f_plus = torch.randn(T, 2 * D, generator=g)[:, :D], torch.randn(T, D, generator=g)  # f strided
    post = torch.rand(T, hc, generator=g) * 2
    comb = torch.softmax(torch.randn(T, hc, hc, generator=g), -1)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05
    base, scale = torch.randn((2 + hc) * hc, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5
    norm = torch.rand(D, generator=g) + 0.5
    for done in (ops.SublayerOutput(f, post, comb), ops.SublayerOutput(f, post, comb, f_plus), None):
        assert kernel.supported(h, fn, norm, cfg, done and done.f, done and done.f_plus)
        got = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
        kernel.ENABLED = False
        want = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
        kernel.ENABLED = True
        assert [t.shape for t in got] == [t.shape for t in want] and all(t.dtype == torch.float32 for t in got)
        assert (done is None) == (got[0] is h)
        worst = max([worst] + [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, want)])
        assert (got[3].sum(-2) - 1).abs().max() < 1e-5  # doubly stochastic, as the torch one
        # a row alone: the same bits as in the batch
        i = T // 2
        alone = ops.hc_boundary(h[i:i + 1].contiguous(), done and ops.SublayerOutput(
            *(t[i:i + 1] if t is not None else None for t in done)), fn, base, scale, cfg, norm)
        if not all(torch.equal(a[0], b[i]) for a, b in zip(alone, got)):
            worst = float("inf")
print("WORST", worst)
"""


@pytest.mark.parametrize("fma_mix", [False, True])
def test_the_kernel_gives_the_torch_ops_boundary(triton_interpreted, fma_mix):
    """The mixes as launch 1's tl.dot and as its column FMAs (``FMA_MIX``, the default)."""
    cases = _CASES.replace("kernel.ENABLED = True\n", f"kernel.ENABLED = True\nkernel.FMA_MIX = {fma_mix}\n", 1)
    assert cases != _CASES  # the switch line went in: else both cases would run the default mixes
    assert triton_interpreted(cases) < 2e-6  # fp32: other summation orders


_MODEL = """
import tempfile, pathlib
import torch
from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.kernels import hc_boundary as kernel
from sglang_dsv4.tiny import build_tiny
ckpt = load_checkpoint(build_tiny("micro", 0, pathlib.Path(tempfile.mkdtemp()) / "ckpt"))
cfg = ckpt.config
ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
logits = []
for on in (False, True):
    kernel.ENABLED = on
    model = V4Model(cfg, ckpt.tensors)
    cache = V4Cache(cfg, max_requests=1, max_total_tokens=256, page_size=64)
    req = cache.new_request()
    out = [model.forward(cache, [req], [ids[:17]])[0]]
    out += [model.forward(cache, [req], [ids[p:p + 1]])[0] for p in range(17, 24)]
    logits.append(torch.cat(out))
err = (logits[1] - logits[0]).norm(dim=-1) / logits[0].norm(dim=-1)
print("median", err.median().item())
print("WORST", err.max().item() if err.median() < 1e-5 else float("inf"))
"""


def test_a_model_with_the_kernel_gives_its_logits(triton_interpreted):
    """Prefill (the torch ops: ``V4Model.boundary_kernel``) then decode of a micro model (every
    boundary through the kernel, the first layer's without an output to expand, the last expanded
    for the head by ``hc_expand``): the logits of the torch ops to float rounding (and a rare
    fp8 / fp4 bin flip of the simulated quantisation)."""
    assert triton_interpreted(_MODEL) < 2e-3


def test_the_switch_off_or_more_rows_keep_the_torch_ops(monkeypatch):
    from sglang_dsv4.tiny import preset_config

    cfg = preset_config("micro")
    T, hc, D = 2, cfg.hc_mult, cfg.hidden_size
    h = torch.randn(T, hc, D)
    done = ops.SublayerOutput(torch.randn(T, D), torch.rand(T, hc), torch.rand(T, hc, hc))
    fn, norm = torch.randn((2 + hc) * hc, hc * D), torch.ones(D)
    base, scale = torch.zeros((2 + hc) * hc), torch.ones(3)

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(hc_boundary, "post_pre", refuse)
    h2 = ops.hc_post(done.f, h, done.post, done.comb)
    want = (h2, *ops.hc_pre(h2, fn, base, scale, cfg, norm=norm))
    monkeypatch.setattr(hc_boundary, "runs_on", lambda *a: True)  # as on a GPU: only the switch and the rows decide
    monkeypatch.setattr(hc_boundary, "ENABLED", True)  # whatever the environment switched
    monkeypatch.setattr(hc_boundary, "MAX_ROWS", T)
    assert hc_boundary.supported(h, fn, norm, cfg, done.f)
    # switched off; more rows than MAX_ROWS; the caller's choice (a prefill chunk)
    for switch, rows, allowed in ((False, 64, True), (True, T - 1, True), (True, T, False)):
        monkeypatch.setattr(hc_boundary, "ENABLED", switch)
        monkeypatch.setattr(hc_boundary, "MAX_ROWS", rows)
        got = ops.hc_boundary(h, done, fn, base, scale, cfg, norm, kernel=allowed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(ops.hc_expand(h, done), h2) and ops.hc_expand(h, None) is h


def test_decode_steps_and_deterministic_pieces_take_the_kernel_and_prefill_chunks_do_not():
    """``V4Model.boundary_kernel``: a prefill chunk keeps the torch ops at any length (chunkings of a
    prompt then give the same bits: ``tests/srt/test_state_gpu.py``, which a 40-row chunk through
    the kernel against an 81-row one through the torch ops broke); a decode step may take the
    kernel; the deterministic mode always, its decode and prefill running the same ops."""
    from types import SimpleNamespace

    from sglang_dsv4.core.model import V4Model
    from sglang_dsv4.core.step import StepBatch

    model = V4Model.__new__(V4Model)  # the rule reads the mode and the step's host lengths only
    for deterministic in (False, True):
        model.deterministic = deterministic
        for lens, decode in (([1, 1, 1], True), ([1], True), ([40], False), ([1, 80], False)):
            step = SimpleNamespace(lens_host=lens, derived=lambda key, make: make())  # a fresh step each
            step.is_decode = StepBatch.is_decode.fget(step)
            assert model.boundary_kernel(step) == (decode or deterministic)


_QUANT = """
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_boundary as kernel
from sglang_dsv4.kernels import fp8_linear
from sglang_dsv4.kernels.fp8_linear import quantize_act
from sglang_dsv4.tiny import preset_config
kernel.ENABLED = fp8_linear.SHARED_OPERANDS = True
cfg = preset_config("tiny")
g = torch.Generator().manual_seed(3)
bad = 0
# launch 2's blocks of one group, of two (D a multiple), of four past D (a block's last groups masked)
for T, D, block in ((5, 256, 128), (3, 512, 256), (2, 640, 512)):
    kernel.FINISH_BLOCK = block
    hc = cfg.hc_mult
    h = torch.randn(T, hc, D, generator=g)
    h[0] *= 1e-7  # a row whose groups fall under the amax floor
    h[-1] *= 300.0
    f = torch.randn(T, D, generator=g)
    post = torch.rand(T, hc, generator=g) * 2
    comb = torch.softmax(torch.randn(T, hc, hc, generator=g), -1)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05
    base, scale = torch.randn((2 + hc) * hc, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5
    norm = torch.rand(D, generator=g) + 0.5
    for done in (ops.SublayerOutput(f, post, comb), None):
        plain = ops.hc_boundary(h, done, fn, base, scale, cfg, norm)
        got = ops.hc_boundary(h, done, fn, base, scale, cfg, norm, quantized=True)
        q, s = quantize_act(got[1])
        act = got[4]
        bad += not (torch.equal(act.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(act.s, s))
        bad += not all(torch.equal(a, b) for a, b in zip(got[:4], plain))  # the rest as without
    fp8_linear.SHARED_OPERANDS = False
    bad += ops.hc_boundary(h, None, fn, base, scale, cfg, norm, quantized=True)[4] is not None
    fp8_linear.SHARED_OPERANDS = True
print("WORST", float(bad))
"""


def test_the_kernel_quantises_the_input_it_writes_as_quantize_act(triton_interpreted):
    """``hc_boundary(quantized=True)``: launch 2's fp8 operands of y are ``quantize_act(y)``'s bytes
    and scales (whole blocks, several groups a block, a block's groups past the width; a row under
    the amax floor, a large one), and the other outputs are those of the call without them; the
    switch off, no operands. The torch ops make none (None): the GEMMs quantise x themselves."""
    assert triton_interpreted(_QUANT) == 0.0
    from sglang_dsv4.tiny import preset_config

    cfg = preset_config("micro")
    T, hc, D = 2, cfg.hc_mult, cfg.hidden_size
    h, fn = torch.randn(T, hc, D), torch.randn((2 + hc) * hc, hc * D)
    out = ops.hc_boundary(h, None, fn, torch.zeros((2 + hc) * hc), torch.ones(3), cfg, torch.ones(D), quantized=True)
    assert len(out) == 5 and out[4] is None  # the CPU: the torch ops
