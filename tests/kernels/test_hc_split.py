"""``kernels.hc_split``: SGLang's Triton split + Sinkhorn, run by the Triton interpreter on the CPU,
against the torch ops of ``ops.hc_pre`` it replaces on the GPU; and the torch path where it
cannot run."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_split
from sglang_dsv4.tiny import preset_config

# a case of tiny's hyper-connections at a small width, for the interpreted scripts below
_CASE = r"""
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_split
from sglang_dsv4.tiny import preset_config
cfg = preset_config("tiny")
torch.manual_seed(0)
T, hc, D = 37, cfg.hc_mult, 64
h = torch.randn(T, hc, D)
fn = torch.randn((2 + hc) * hc, hc * D) * 0.05
base, scale = torch.randn((2 + hc) * hc) * 0.5, torch.rand(3) + 0.5
"""

_INTERPRETED = _CASE + r"""
assert hc_split.sglang_kernel() is not None, "SGLang's kernel does not import"
mixes = ops.hc_mixes(h, fn, cfg)
got = hc_split.hc_split_sinkhorn(mixes, scale, base, cfg)
assert got is not None
ref = ops.hc_split_torch(mixes, base, scale, cfg)
y, y_ref = ops.hc_weighted_sum(got[0], h), ops.hc_weighted_sum(ref[0], h)
worst = max((y - y_ref).abs().max().item(), (got[1] - ref[1]).abs().max().item(),
            (got[2] - ref[2]).abs().max().item())
# the comb matrix is (nearly) doubly stochastic, as the torch one
assert (got[2].sum(-2) - 1).abs().max() < 1e-5
print("WORST", worst)
"""


def test_sglang_split_sinkhorn_equals_the_torch_ops_interpreted(triton_interpreted):
    worst = triton_interpreted(_INTERPRETED)
    assert worst < 1e-5, worst  # fp32, the same operations in the same order up to the 4-term sums


_FUSED_PRE = _CASE + r"""
assert hc_split.sglang_fused_pre() is not None, "SGLang's hc_mix_stats_sinkhorn does not import"
assert hc_split.hc_pre_split(h, fn, scale, base, cfg, enabled=False) is None  # off: the default path
got = hc_split.hc_pre_split(h, fn, scale, base, cfg, enabled=True)
assert got is not None and [t.shape for t in got] == [(T, hc), (T, hc), (T, hc, hc)]
ref = ops.hc_split_torch(ops.hc_mixes(h, fn, cfg), base, scale, cfg)
worst = max((g - r).abs().max().item() for g, r in zip(got, ref))
assert (got[2].sum(-2) - 1).abs().max() < 1e-5  # doubly stochastic, as the torch one
# hc * D not a multiple of the kernel's K tile: the default path
assert hc_split.hc_pre_split(h[..., :60], fn[:, :hc * 60], scale, base, cfg, enabled=True) is None
print("WORST", worst)
"""


def test_sglang_fused_mixes_split_sinkhorn_equals_the_torch_ops_interpreted(triton_interpreted):
    """``hc_pre_split`` (SGLang's mixes GEMM + sum of squares, then RMS scale, split and Sinkhorn:
    two kernels) against the torch mixes and split it replaces, on the interpreter."""
    worst = triton_interpreted(_FUSED_PRE)
    assert worst < 1e-5, worst  # fp32 (another summation order for the 256-long dot products)


def test_cpu_tensors_keep_the_torch_path():
    """Outside the interpreter a CPU tensor never reaches the kernel (the oracle path)."""
    cfg = preset_config("micro")
    mixes = torch.randn(3, (2 + cfg.hc_mult) * cfg.hc_mult)
    if hc_split.INTERPRET:
        pytest.skip("under TRITON_INTERPRET=1 CPU tensors reach the kernel by design")
    assert hc_split.hc_split_sinkhorn(mixes, torch.ones(3), torch.zeros(mixes.shape[1]), cfg) is None
    h0 = torch.randn(3, cfg.hc_mult, 64)
    fn0 = torch.randn(mixes.shape[1], cfg.hc_mult * 64)
    assert hc_split.hc_pre_split(h0, fn0, torch.ones(3), torch.zeros(mixes.shape[1]), cfg, enabled=True) is None
    h = torch.randn(3, cfg.hc_mult, cfg.hidden_size)
    fn = torch.randn(mixes.shape[1], cfg.hc_mult * cfg.hidden_size)
    base, scale = torch.zeros(mixes.shape[1]), torch.ones(3)
    pre, post, comb = ops.hc_split_torch(ops.hc_mixes(h, fn, cfg), base, scale, cfg)
    want = (torch.einsum("th,thd->td", pre, h), post, comb)
    assert all(torch.equal(a, b) for a, b in zip(ops.hc_pre(h, fn, base, scale, cfg), want))
