"""``kernels.kv_store``: the fp8 layouts' ``write`` through the one-launch row store leaves the
page bytes the torch store leaves (interpreted on the CPU: FlashMLA's V4 rows and the indexer's
keys, pool pages and a ring's strided slice of [slots, layers, page], rows given as storage
rows or as (page, offset) pairs); anything else keeps the torch store."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels import kv_store, triton_support

_CASES = """
import torch
from sglang_dsv4.kernels.kv_layout import IndexFp8Rows, V4Fp8Rows
g = torch.Generator().manual_seed(0)
worst = 0

def torch_store(layout, buf, rows, x):
    page, off = layout.locate(rows)
    data, scales = layout.pack(x)
    layout._data(buf)[page, off] = data
    layout._scales(buf)[page, off] = scales

for layout, dim in ((V4Fp8Rows(64), 512), (V4Fp8Rows(4, nope=128, rope=64), 192),
                    (V4Fp8Rows(4, nope=64, rope=32, rope_dtype=torch.float32), 96), (IndexFp8Rows(64), 128)):
    for ring in (False, True):
        pages, n = 5, 7
        if ring:  # the ring of layer 1 of [slots, 3 layers, page]: a strided page buffer
            whole = torch.randint(0, 256, (pages, 3, layout.page_bytes), generator=g, dtype=torch.uint8)
            ref_whole = whole.clone()
            buf, ref = whole[:, 1], ref_whole[:, 1]
        else:
            buf = torch.randint(0, 256, (pages, layout.page_bytes), generator=g, dtype=torch.uint8)
            ref = buf.clone()
        rows = torch.randperm(pages * layout.page_size, generator=g)[:n]
        x = torch.randn(n, dim, generator=g) * 3
        for where in (rows, (rows // layout.page_size, rows % layout.page_size)):
            layout.write(buf, where, x)
            torch_store(layout, ref, where, x)
            worst += int(not torch.equal(buf, ref))
            if ring:
                worst += int(not torch.equal(whole, ref_whole))
print("WORST", worst)
"""


def test_the_row_store_leaves_the_torch_stores_bytes(triton_interpreted):
    assert triton_interpreted(_CASES) == 0


def test_the_row_store_takes_byte_pages_on_a_device_only():
    pages = torch.zeros(4, 64, dtype=torch.uint8)
    assert kv_store.supported(pages) == triton_support.INTERPRET  # CPU pages: the torch store
    assert not kv_store.supported(pages.view(4, 2, 32)) and not kv_store.supported(pages.float())
    with pytest.raises(ValueError, match="segments"):
        kv_store.store_row_bytes(pages, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [])
    with pytest.raises(ValueError, match="not uint8"):
        kv_store.store_row_bytes(pages, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                 [(torch.zeros(1, 8), 0, 8)])
