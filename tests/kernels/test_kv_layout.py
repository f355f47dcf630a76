"""KV storage layouts on CPU: FlashMLA's V4 fp8 rows are lossless for the model's QAT'ed vectors,
bytes sit where the kernel reads them, and page buffers address rows correctly."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels.kv_layout import FloatRows, IndexFp8Rows, V4Fp8Rows
from sglang_dsv4.quant import fp4_qat, fp8_qat, hadamard


def random_rows(n: int, dim: int, seed: int) -> torch.Tensor:
    """Rows whose 64-value tiles span many magnitudes, plus an all-zero tile and a tiny one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-30, 12, (n, dim // 64, 1), generator=g)
                                                      .float()).repeat_interleave(64, 1).view(n, dim)
    x[0, :64] = 0
    x[1, 64:128] *= 1e-9  # below the 1e-4 amax floor
    return x


def test_v4_roundtrip_equals_fp8_qat_exactly():
    lay = V4Fp8Rows(page_size=16)
    x = random_rows(200, 512, 0)
    got = lay.unpack(*lay.pack(x))
    assert torch.equal(got[:, :448], fp8_qat(x[:, :448], 64))
    assert torch.equal(got[:, 448:], x[:, 448:].bfloat16().float())
    # the model stores already-QAT'ed rows: storing them again changes nothing
    qat = torch.cat((fp8_qat(x[:, :448], 64), x[:, 448:].bfloat16().float()), dim=1)
    assert torch.equal(lay.unpack(*lay.pack(qat)), qat)
    assert torch.equal(lay.round(qat), qat)


def test_v4_scale_bytes_are_ue8m0_of_the_qat_scale():
    lay = V4Fp8Rows(page_size=4)
    x = torch.zeros(1, 512)
    x[0, :64] = 448.0        # scale 1 -> 127
    x[0, 64:128] = 1.0       # 1/448 -> 2^-8 -> 119
    x[0, 128:192] = 500.0    # 500/448 -> 2 -> 128
    _, scales = lay.pack(x)
    assert scales.shape == (1, 8) and scales.dtype == torch.uint8
    assert scales[0, :3].tolist() == [127, 119, 128]
    assert scales[0, 3:7].tolist() == [105] * 4   # zero tiles: floor 1e-4 -> 2^-22
    assert scales[0, 7] == 0                       # pad byte


@pytest.mark.parametrize("page_size, page_bytes", [(64, 37440), (128, 74880), (1, 1152)])
def test_v4_page_bytes_and_where_a_row_lands(page_size, page_bytes):
    lay = V4Fp8Rows(page_size)
    assert lay.page_bytes == page_bytes and page_bytes % 576 == 0 and page_bytes >= 584 * page_size
    buf = lay.alloc_pool(3)
    assert buf.shape == (3, page_bytes) and buf.dtype == torch.uint8
    x = random_rows(2, 512, 1)
    off = page_size - 1
    lay.write(buf, torch.tensor([page_size + off]), x[:1])  # page 1, last offset
    data, scales = lay.pack(x[:1])
    assert torch.equal(buf[1, off * 576:(off + 1) * 576], data[0])
    base = page_size * 576 + off * 8
    assert torch.equal(buf[1, base:base + 8], scales[0])
    touched = torch.zeros_like(buf, dtype=torch.bool)
    touched[1, off * 576:(off + 1) * 576] = True
    touched[1, base:base + 8] = True
    assert not buf[~touched].any()


def test_v4_ring_pages_are_strided_slices_of_slot_major_storage():
    W, slots, layers = 128, 3, 5
    lay = V4Fp8Rows(W)
    ring = lay.alloc(slots, layers)
    layer = ring[:, 2]
    view = lay.flashmla_view(layer)
    assert view.shape == (slots, W, 1, 584)
    assert view.stride() == (layers * lay.page_bytes, 584, 584, 1)
    assert view.data_ptr() == layer.data_ptr()
    x = random_rows(6, 512, 2)
    rows = torch.tensor([0 * W + 5, 1 * W + 127, 2 * W + 0, 2 * W + 64, 1 * W + 0, 0 * W + 6])
    lay.write(layer, rows, x)
    assert torch.equal(lay.read(layer, rows), lay.round(x))
    assert not ring[:, [0, 1, 3, 4]].any()  # other layers untouched


def test_v4_copy_head_copies_only_the_head():
    lay = V4Fp8Rows(page_size=8)
    buf = lay.alloc_pool(2)
    x = random_rows(8, 512, 3)
    lay.write(buf, torch.arange(8), x)
    lay.copy_head(buf, 0, 1, 3)
    assert torch.equal(lay.read(buf, torch.arange(8, 11)), lay.round(x[:3]))
    assert not lay._data(buf)[1, 3:].any() and not lay._scales(buf)[1, 3:].any()


def test_index_fp8_is_exact_for_fp4_qat_keys():
    lay = IndexFp8Rows(page_size=4, dim=128)
    g = torch.Generator().manual_seed(4)
    keys = fp4_qat(hadamard(torch.randn(500, 128, generator=g) * torch.rand(500, 1, generator=g) * 10), 32)
    assert torch.equal(lay.round(keys), keys)
    assert lay.page_bytes == 4 * 132
    buf = lay.alloc_pool(130)
    rows = torch.randperm(520, generator=g)[:500]
    lay.write(buf, rows, keys)
    assert torch.equal(lay.read(buf, rows), keys)
    # any other vector: one e4m3 rounding (3 mantissa bits)
    y = torch.randn(100, 128, generator=g)
    assert ((lay.round(y) - y).abs() <= y.abs().amax(-1, keepdim=True) * 2.0**-4).all()


def test_float_rows_flat_and_paged_buffers_agree():
    lay = FloatRows(page_size=4, dim=3)
    flat, paged = lay.alloc_pool(5), lay.alloc(5)
    assert flat.shape == (20, 3) and paged.shape == (5, 4, 3)
    rows, x = torch.tensor([0, 7, 19]), torch.randn(3, 3)
    lay.write(flat, rows, x)
    lay.write(paged, rows, x)
    assert torch.equal(flat.view(5, 4, 3), paged)
    assert torch.equal(lay.read(paged, rows), x)
    lay.copy_head(flat, 1, 2, 4)
    lay.copy_head(paged, 1, 2, 4)
    assert torch.equal(flat.view(5, 4, 3), paged)
    assert lay.round(x) is x


@pytest.mark.parametrize("rope_dtype", [torch.bfloat16, torch.float32])
def test_v4_round_is_the_bytes_read_back_bit_for_bit(rope_dtype):
    """``round`` computes what ``pack`` stores and ``unpack`` reads, without the bytes: the same
    bits for rows of every scale (zeros, the amax floor, exact powers of two, bf16 inputs)."""
    lay = V4Fp8Rows(page_size=16, rope_dtype=rope_dtype)
    x = random_rows(300, 512, 1)
    x[2] = 2.0 ** torch.randint(-8, 5, (512,), generator=torch.Generator().manual_seed(2)).float()
    x[2, ::64] = 56.0  # each tile's amax / 448 = 2^-3: ceil(log2) on an integer
    for rows in (x, x.bfloat16(), x[:1]):
        want = lay.unpack(*lay.pack(rows)).to(rows.dtype)
        assert torch.equal(lay.round(rows), want)
    assert torch.equal(lay.round(x.view(3, 100, 512)), lay.round(x).view(3, 100, 512))
