"""``EntryRowPool``: rows handed out and freed one by one, in paged layouts, growing on demand."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core.pages import EntryRowPool
from sglang_dsv4.kernels.kv_layout import FloatRows, V4Fp8Rows


def test_rows_alloc_free_and_reuse():
    pool = EntryRowPool(10, {"k": FloatRows(4, 3)})
    assert pool.capacity == 12 and pool.num_free == 12  # whole pages of 4 rows
    a = pool.alloc(5)
    assert a.unique().numel() == 5 and pool.num_used == 5
    pool.write("k", a, torch.arange(15.0).view(5, 3))
    assert torch.equal(pool.read("k", a[2:3]), torch.tensor([[6.0, 7.0, 8.0]]))
    pool.free(a[:2])
    b = pool.alloc(2)
    assert set(b.tolist()) == set(a[:2].tolist())  # freed rows come back first
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(torch.cat((a[2:3], a[2:3])))
    pool.free(torch.cat((a[2:], b)))
    assert pool.num_used == 0


def test_growth_keeps_rows_and_contents():
    layout = V4Fp8Rows(2, nope=64, rope=16)
    pool = EntryRowPool(2, {"main": layout})
    rows = pool.alloc(2)
    x = torch.randn(2, 80)
    pool.write("main", rows, x)
    more = pool.alloc(5)  # past capacity: the pool grows by whole pages
    assert pool.capacity >= 7 and not set(more.tolist()) & set(rows.tolist())
    assert torch.equal(pool.read("main", rows), layout.round(x))
    # whole pages, plus the scratch page (last)
    assert pool.tensors["main"].shape == (pool.capacity // 2 + 1, layout.page_bytes)
    assert pool.scratch_row == pool.capacity
