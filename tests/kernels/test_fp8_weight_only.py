"""``kernels.fp8_weight_only`` on the CPU: the fp8 wo_a's product is the bf16 einsum's, and the
Triton kernel (interpreted) rounds it as the einsum does. The GPU: ``test_fp8_gpu.py``
(``test_the_weight_only_wo_a_gives_the_bf16_einsum``, ``test_fp8_wo_a_logits_stay_near_the_bf16_wo_a``)."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels.fp8_linear import Fp8Weight
from sglang_dsv4.kernels.fp8_weight_only import grouped_weight_only_linear
from sglang_dsv4.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise


@pytest.mark.parametrize("T", [1, 5, 130])
def test_weight_only_wo_a_is_the_einsum_of_the_bf16_matrix(T):
    """On the CPU, the fp8 wo_a's product is the bf16 path's: the einsum of the heads in bf16 and
    the matrix dequantised to bf16 (exact: an e4m3 value times a power of two), the same bits."""
    g = torch.Generator().manual_seed(T)
    G, R, K = 4, 256, 384
    w = Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(G * R, K, generator=g) * K ** -0.5))
    x = torch.randn(T, G, K, generator=g) * torch.logspace(-2, 1, K)
    got = grouped_weight_only_linear(x, w)
    w16 = dequantize_fp8_blockwise(w.q, w.scale.to(torch.float8_e8m0fnu)).to(torch.bfloat16)
    assert torch.equal(w16.float(), w.dequantize())  # widening to bf16 loses nothing
    bf16_path = torch.einsum("tgd,grd->tgr", x.to(torch.bfloat16), w16.view(G, R, K)).to(x.dtype)
    assert got.dtype == x.dtype and torch.equal(got, bf16_path)
    with pytest.raises(ValueError, match="does not split into 3 groups"):
        grouped_weight_only_linear(x[:, :3], w)


_WEIGHT_ONLY = r"""
import torch
from sglang_dsv4.kernels import fp8_weight_only as wo
from sglang_dsv4.kernels.fp8_linear import Fp8Weight
from sglang_dsv4.quant import quantize_fp8_blockwise
torch.manual_seed(0)
worst = 0.0
# row blocks of 16 (1, 20 tokens) and 64 (40); K of 8 blocks over few tiles splits (split_k);
# the heads a strided view (x[:, ::2]); forced splits of 1 and 3 (the harness's override)
for T, G, R, K in [(1, 2, 128, 256), (20, 3, 256, 1024), (40, 2, 128, 384)]:
    w = Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(G * R, K) * K ** -0.5))
    x = torch.randn(T, 2 * G, K).to(torch.bfloat16)[:, ::2]
    ref = wo.grouped_weight_only_reference(x, w).float()
    exact = torch.einsum("tgk,grk->tgr", x.double(), w.dequantize(torch.float64).view(G, R, K))
    ulp = exact.abs().clamp_min(exact.abs().amax(-1, keepdim=True) * 1e-3) * 2.0 ** -7  # bf16's spacing <= this
    for splits in (None, 1, 3):
        got = wo.grouped_weight_only(x, w, splits=splits)
        assert got.shape == (T, G, R) and got.dtype == torch.bfloat16
        # rounded once (half a spacing, and the fp32 sums' error), one spacing from the einsum's
        worst = max(worst, ((got.double() - exact).abs() / ulp).max().item() - 0.51,
                    ((got.float() - ref).abs().double() / ulp).max().item() - 1.01)
    # traced (the fused regions): through the op, no graph break, the eager bits
    torch._dynamo.reset()
    eager = wo.grouped_weight_only_linear(x, w)
    traced = torch.compile(lambda a: wo.grouped_weight_only_linear(a, w) + 1, backend="aot_eager",
                           fullgraph=True)(x)
    worst += float(not torch.equal(traced, eager + 1))
print("WORST", worst)
"""


def test_weight_only_wo_a_interpreted(triton_interpreted):
    """The weight-only kernel (``fp8_weight_only``: group g's heads read in place, the fp8 matrix
    widened to bf16) within one bf16 rounding of the exact product and of the einsum, at each
    K split; traced without a graph break (``ops.attention_output`` is a fused region), the
    eager bits."""
    assert triton_interpreted(_WEIGHT_ONLY) <= 0
