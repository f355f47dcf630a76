"""``kernels.hc_split``: SGLang's Triton split + Sinkhorn, run by the Triton interpreter on the CPU,
against the torch ops of ``ops.hc_pre`` it replaces on the GPU; and the torch path where it
cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_split
from sglang_dsv4.tiny import preset_config

REPO = Path(__file__).resolve().parents[2]

_INTERPRETED = r"""
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
assert hc_split.sglang_kernel() is not None, "SGLang's kernel does not import"
got = hc_split.hc_split_sinkhorn(ops.hc_mixes(h, fn, cfg), scale, base, cfg)
assert got is not None
ref = ops.hc_pre_torch(h, fn, base, scale, cfg)
y = ops.hc_weighted_sum(got[0], h)
worst = max((y - ref[0]).abs().max().item(), (got[1] - ref[1]).abs().max().item(),
            (got[2] - ref[2]).abs().max().item())
# the comb matrix is (nearly) doubly stochastic, as the torch one
assert (got[2].sum(-2) - 1).abs().max() < 1e-5
print("WORST", worst)
"""


def test_sglang_split_sinkhorn_equals_the_torch_ops_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    worst = float(r.stdout.split("WORST")[1])
    assert worst < 1e-5, worst  # fp32, the same operations in the same order up to the 4-term sums


def test_cpu_tensors_keep_the_torch_path():
    """Outside the interpreter a CPU tensor never reaches the kernel (the oracle path)."""
    cfg = preset_config("micro")
    mixes = torch.randn(3, (2 + cfg.hc_mult) * cfg.hc_mult)
    if hc_split.INTERPRET:
        return
    assert hc_split.hc_split_sinkhorn(mixes, torch.ones(3), torch.zeros(mixes.shape[1]), cfg) is None
    h = torch.randn(3, cfg.hc_mult, cfg.hidden_size)
    fn = torch.randn(mixes.shape[1], cfg.hc_mult * cfg.hidden_size)
    args = (h, fn, torch.zeros(mixes.shape[1]), torch.ones(3), cfg)
    assert all(torch.equal(a, b) for a, b in zip(ops.hc_pre(*args), ops.hc_pre_torch(*args)))
