"""``kernels.hc_mixes``: the split-K mixes kernel (TF32x3 dots on the GPU, IEEE under the
interpreter) against float64 mixes; the CPU keeps the torch GEMM."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.config import V4Config
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_mixes
from sglang_dsv4.tiny import preset_config

_INTERPRETED = r"""
import torch
from sglang_dsv4.config import V4Config
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_mixes
from sglang_dsv4.tiny import preset_config
cfg = preset_config("tiny")
torch.manual_seed(0)
worst = 0.0
for T, D in ((1, 64), (37, 256), (70, 128), (5, 1024)):
    h = torch.randn(T, cfg.hc_mult, D)
    fn = torch.randn((2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * D) * 0.05
    assert hc_mixes.supported(h.flatten(1), fn)
    got = ops.hc_mixes(h, fn, cfg)
    flat = h.flatten(1).double()
    want = (flat @ fn.double().t()) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
print("WORST", worst)
"""


def _exact_mixes(h: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    flat = h.flatten(1).double()
    return (flat @ fn.double().t()) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)


def test_the_split_k_partials_add_up_to_the_mixes_interpreted(triton_interpreted):
    """Several splits and row blocks (T = 1 .. 70), each within fp32 round-off of float64."""
    assert triton_interpreted(_INTERPRETED) < 1e-6


def test_the_split_is_a_power_of_two_dividing_k_into_whole_blocks():
    for tokens in (1, 16, 17, 64, 256, 1000):
        for k in (256, 4096, 16384):
            s = hc_mixes.splits(tokens, k, 132)
            assert s & (s - 1) == 0 and k % (s * hc_mixes.BLOCK_K) == 0
            assert k // s >= hc_mixes.MIN_CHUNK_BLOCKS * hc_mixes.BLOCK_K or s == 1


def test_cpu_tensors_keep_the_torch_gemm():
    if hc_mixes.INTERPRET:
        pytest.skip("under TRITON_INTERPRET=1 CPU tensors reach the kernel by design")
    cfg = preset_config("micro")
    h = torch.randn(3, cfg.hc_mult, cfg.hidden_size)
    fn = torch.randn((2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.hidden_size)
    assert not hc_mixes.supported(h.flatten(1), fn)
    flat = h.flatten(1)
    want = ops.linear(flat, fn) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    assert torch.equal(ops.hc_mixes(h, fn, cfg), want)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 300])
def test_the_gpu_mixes_are_within_fp32_round_off_and_batch_independent_per_split(tokens):
    """V4-Flash width (hc 4 x 4096): within 1e-6 of float64 (relative to the largest), as the
    fp32 cuBLAS GEMM it replaces; hc_head's 4 mixes too. Compiled (``core.compiled``) like the
    step, and captured and replayed in a CUDA graph to the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = V4Config()  # V4-Flash dimensions
    g = torch.Generator(device="cuda").manual_seed(tokens)
    h = torch.randn(tokens, cfg.hc_mult, cfg.hidden_size, generator=g, device="cuda")
    for n in ((2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult):
        fn = torch.randn(n, cfg.hc_mult * cfg.hidden_size, generator=g, device="cuda") * 0.02
        got = ops.hc_mixes(h, fn, cfg)
        want = _exact_mixes(h, fn, cfg.rms_norm_eps)
        assert ((got.double() - want).abs().amax() / want.abs().amax()) < 1e-6
        cuda_old = torch.nn.functional.linear(h.flatten(1), fn) * torch.rsqrt(
            h.flatten(1).pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        assert ((cuda_old.double() - want).abs().amax() / want.abs().amax()) < 1e-6
    graph, static = torch.cuda.CUDAGraph(), h.clone()
    ops.hc_mixes(static, fn, cfg)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = ops.hc_mixes(static, fn, cfg)
    graph.replay()
    assert torch.equal(out, ops.hc_mixes(h, fn, cfg))
