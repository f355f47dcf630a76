"""``kernels.route`` on the GPU: the router's selection in one launch against ``ops.route_tokens``
(the fused region where the regions are on) at V4-Flash's width, 8 / 32 / 256 experts, scored and
hash-routed, and from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.config import V4Config
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import route
from sglang_dsv4.tiny import PRESETS

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(E: int, T: int, seed: int):
    cfg = V4Config.from_dict({**PRESETS["micro"], "hidden_size": 4096, "n_routed_experts": E, "num_experts_per_tok": 6})
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, 4096, generator=g, device=DEV)
    gate = torch.randn(E, 4096, generator=g, device=DEV) * 4096 ** -0.5
    bias = torch.randn(E, generator=g, device=DEV) * 0.1
    given = torch.rand(T, E, generator=g, device=DEV).argsort(1)[:, :6].int()
    return cfg, x, gate, bias, given


@pytest.mark.parametrize("E,T", [(8, 1), (8, 64), (32, 256), (256, 256)])
def test_the_kernel_routes_as_the_region(E, T, monkeypatch):
    cfg, x, gate, bias, given = _case(E, T, E + T)
    monkeypatch.setattr(route, "ENABLED", True)
    assert route.preferred(x, gate, 6)
    for b in (bias, given):
        got = route.route_from_logits(x @ gate.t(), b, 6, cfg.routed_scaling_factor)
        want = ops.route_tokens(x, gate, b, cfg)
        same = (got[0] == want[0].long()).all(1)
        # a token routed otherwise has two scores within rounding (none expected at these sizes)
        assert same.float().mean() >= 0.99, same.float().mean().item()
        err = (got[1][same] - want[1][same]).abs().max().item() / cfg.routed_scaling_factor
        assert err < 1e-5, err


def test_the_kernel_replays_from_a_graph(monkeypatch):
    cfg, x, gate, bias, _ = _case(32, 64, 0)
    logits = x @ gate.t()
    out = route.route_from_logits(logits, bias, 6, cfg.routed_scaling_factor)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route.route_from_logits(logits, bias, 6, cfg.routed_scaling_factor)
    logits.copy_(_case(32, 64, 1)[1] @ gate.t())
    graph.replay()
    want = route.route_from_logits(logits, bias, 6, cfg.routed_scaling_factor)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
