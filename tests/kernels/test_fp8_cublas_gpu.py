"""``kernels.fp8_cublas`` on the GPU (``SGLANG_DSV4_FP8_GEMM=cublas``, the default): cuBLAS's block-scaled
fp8 GEMM against the Triton kernel it would replace, on V4-Flash's dense shapes, eager and
through a compiled caller's torch op (whose fake must give the launch's shape), and in a graph."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv4.kernels import fp8_cublas
from sglang_dsv4.kernels import fp8_linear as fp8_mod
from sglang_dsv4.kernels.fp8_linear import Fp8Weight, fp8_gemm, fp8_linear, quantize_act

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SHAPES = [(1024, 4096), (32768, 1024), (4096, 8192), (4096, 2048)]  # wq_a, wq_b, wo_b, shared w2


def _weight(n: int, k: int, seed: int) -> Fp8Weight:
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = (torch.randn(n, k, generator=g, device=DEV) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-12, -8, (math.ceil(n / 128), math.ceil(k / 128)), generator=g, device=DEV).float())
    return Fp8Weight(q, s)


@pytest.fixture
def cublas(monkeypatch):
    """cuBLAS requested and checked on this device (skipped, with the check's reason, where this
    torch / CUDA has no block-scaled recipe)."""
    monkeypatch.setattr(fp8_cublas, "REQUESTED", True)
    fp8_cublas._checked.clear()
    fp8_mod.prepare(DEV)
    if not fp8_cublas.planned(256, 4096, 8192, DEV):
        pytest.skip("cuBLAS's block-scaled fp8 GEMM did not pass its check here (see the log line)")
    yield
    fp8_cublas._checked.clear()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 17, 64, 256])
def test_cublas_equals_the_triton_kernel_to_rounding(cublas, m, n, k):
    """Where planned (rows in fours, which cuBLASLt takes, and enough of them) cuBLAS; elsewhere
    the Triton kernel."""
    w = _weight(n, k, seed=n + k)
    xq, xs = quantize_act(torch.randn(m, k, device=DEV))
    assert fp8_cublas.planned(m, n, k, DEV) == (m % 4 == 0 and fp8_cublas.faster(m, n))
    got = fp8_gemm(xq, xs, w, torch.float32)  # decided by the switch
    want = fp8_gemm(xq, xs, w, torch.float32, cublas=False)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-4, err  # fp32 accumulation in another order


def test_a_compiled_caller_gets_the_launch_shape_and_a_graph_replays_it(cublas):
    w = _weight(32768, 1024, seed=3)  # wq_b: planned at 64 rows
    x = torch.randn(64, 1024, device=DEV)
    assert fp8_cublas.planned(64, 32768, 1024, DEV)
    eager = fp8_linear(x, w)
    compiled = torch.compile(lambda t: fp8_linear(t, w) * 2)
    torch.testing.assert_close(compiled(x), eager * 2, rtol=0, atol=0)  # the op's fake: [M, N], no partials
    fp8_cublas.REQUESTED = False  # Dynamo guards on the switch: traced again, the Triton kernel's split-K
    try:
        torch.testing.assert_close(compiled(x), fp8_linear(x, w) * 2, rtol=0, atol=0)
    finally:
        fp8_cublas.REQUESTED = True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
