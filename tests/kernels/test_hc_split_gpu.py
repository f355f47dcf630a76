"""``kernels.hc_split.hc_pre_split`` on the GPU (SGLang's fused mixes, split and Sinkhorn, on by
default, ``SGLANG_DSV4_HC_FUSED_PRE=0`` off) against the split it replaces, at V4-Flash width:
equal to rounding, a row's bits the same alone and in a batch, graph replay = eager."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels import hc_split
from sglang_dsv4.tiny import preset_config

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(T: int, D: int = 4096, seed: int = 0):
    cfg = preset_config("flash8")
    g = torch.Generator(device=DEV).manual_seed(seed)
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    h = torch.randn(T, cfg.hc_mult, D, generator=g, device=DEV)
    fn = torch.randn(mix, cfg.hc_mult * D, generator=g, device=DEV) * 0.01
    base = torch.randn(mix, generator=g, device=DEV) * 0.5
    scale = torch.rand(3, generator=g, device=DEV) + 0.5
    return cfg, h, fn, base, scale


@pytest.fixture(autouse=True)
def _needs_sglang():
    if hc_split.sglang_fused_pre() is None or hc_split.sglang_kernel() is None:
        pytest.skip("SGLang's hyper-connection kernels do not import (carry .srt-site)")


@pytest.mark.parametrize("T", [1, 5, 64, 256])
def test_the_fused_pre_equals_the_default_path_to_rounding_and_is_batch_invariant(T):
    cfg, h, fn, base, scale = _case(T)
    want = hc_split.hc_split_sinkhorn(ops.hc_mixes(h, fn, cfg), scale, base, cfg)
    got = hc_split.hc_pre_split(h, fn, scale, base, cfg, enabled=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for i in {0, T // 2, T - 1}:  # K slicing depends on K alone: the same bits in any batch
        alone = hc_split.hc_pre_split(h[i:i + 1], fn, scale, base, cfg, enabled=True)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, got))


def test_the_fused_pre_replays_from_a_graph_as_eager():
    cfg, h, fn, base, scale = _case(64, seed=1)
    eager = hc_split.hc_pre_split(h, fn, scale, base, cfg, enabled=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hc_split.hc_pre_split(h, fn, scale, base, cfg, enabled=True)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
