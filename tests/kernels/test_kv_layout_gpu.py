"""The fp8 KV layouts' fused quantisers on the GPU: compiled (``core.compiled``) they store the
bytes their eager torch ops store, bit for bit, and a V4 row read back is ``quant.fp8_qat``.

    python3 -m pytest -q -m gpu tests/kernels/test_kv_layout_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels import kv_layout, kv_store
from sglang_dsv4.quant import fp8_qat

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _rows(n: int, dim: int) -> torch.Tensor:
    """Random rows over a wide range of magnitudes, with an all-zero row, a row of exact powers of
    two (where the scale's ceil(log2) sits on an integer) and a row below the amax floor."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(n, dim, device=DEV, generator=g) * torch.exp2(torch.randint(-20, 12, (n, 1), device=DEV,
                                                                                  generator=g).float())
    x[0] = 0
    x[1] = 2.0 ** torch.randint(-8, 5, (dim,), device=DEV, generator=g).float()
    x[1, ::64] = 56.0  # each tile's amax / 448 = 2^-3
    x[2] = 1e-7
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("n", [1, 7, 300])
def test_fused_quantisers_store_the_eager_bytes(n):
    v4 = kv_layout.V4Fp8Rows(64)
    x = _rows(max(n, 3), v4.dim)[:n]
    for got, want in zip(kv_layout._v4_fp8_quantise(x, v4.nope, v4.rope_dtype, v4.scale_bytes),
                         kv_layout._v4_fp8_quantise.eager(x, v4.nope, v4.rope_dtype, v4.scale_bytes)):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    k = _rows(max(n, 3), 128)[:n]
    for got, want in zip(kv_layout._index_fp8_quantise(k), kv_layout._index_fp8_quantise.eager(k)):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("n", [1, 7, 300])
def test_fused_round_and_dequantise_give_the_eager_bits(n):
    """The compiled ``round`` (the prefill's chunk rows as stored) and ``unpack`` regions against
    their eager torch ops, and ``round`` against the bytes written and read back."""
    v4 = kv_layout.V4Fp8Rows(64)
    x = _rows(max(n, 3), v4.dim)[:n]
    got = kv_layout._v4_fp8_round(x, v4.nope, v4.rope_dtype)
    assert torch.equal(got, kv_layout._v4_fp8_round.eager(x, v4.nope, v4.rope_dtype))
    data, scales = v4.pack(x)
    q, rope = data[:, :v4.nope].contiguous().view(torch.float8_e4m3fn), data[:, v4.nope:].contiguous().view(torch.bfloat16)
    back = kv_layout._v4_fp8_dequantise(q, rope, scales, v4.num_tiles)
    assert torch.equal(back, kv_layout._v4_fp8_dequantise.eager(q, rope, scales, v4.num_tiles))
    assert torch.equal(got, back)


def test_a_v4_row_written_and_read_on_the_gpu_is_fp8_qat():
    v4 = kv_layout.V4Fp8Rows(64)
    x = _rows(100, v4.dim).float()
    buf = v4.alloc_pool(4, device=DEV)
    rows = torch.randperm(256, device=DEV)[:100]
    v4.write(buf, rows, x)
    back = v4.read(buf, rows)
    assert torch.equal(back[:, :v4.nope], fp8_qat(x[:, :v4.nope]))
    assert torch.equal(back[:, v4.nope:], x[:, v4.nope:].to(torch.bfloat16).float())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_the_row_store_leaves_the_torch_stores_bytes(n, fused, monkeypatch):
    """``kv_store``'s one-launch store (the GPU's ``write``) against the torch store of the same
    packed rows, in a pool's pages and in a ring's strided slice of [slots, layers, page];
    ``fused``: quantised in that launch too (``SGLANG_DSV4_KV_FUSED_WRITE``), against the
    compiled quantiser's bytes (the rows' exact powers of two put the scales' ceil(log2) on an
    integer, where the bit arithmetic and torch's log2 must agree)."""
    monkeypatch.setattr(kv_store, "FUSED_WRITE", fused)
    for layout, dim in ((kv_layout.V4Fp8Rows(64), 512), (kv_layout.IndexFp8Rows(64), 128)):
        x = _rows(max(n, 3), dim)[:n]
        for ring in (False, True):
            whole = torch.randint(0, 256, (8, 3, layout.page_bytes), device=DEV, dtype=torch.uint8)
            ref_whole = whole.clone()
            buf, ref = (whole[:, 1], ref_whole[:, 1]) if ring else (whole[:, 0].contiguous(), ref_whole[:, 0].contiguous())
            rows = torch.randperm(8 * layout.page_size, device=DEV)[:n]
            layout.write(buf, rows, x)
            page, off = layout.locate(rows)
            data, scales = layout.pack(x)
            layout._data(ref)[page, off] = data
            layout._scales(ref)[page, off] = scales
            assert torch.equal(buf, ref) and torch.equal(whole, ref_whole)
