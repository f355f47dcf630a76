"""The pool plan charges what ``SglangV4Cache`` really allocates, and refuses budgets it cannot meet."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.config import V4Config
from sglang_dsv4.kernels.dispatch import select_backend
from sglang_dsv4.srt.pool_sizing import ENTRY_SIDE_TABLE_BYTES, plan_pools
from sglang_dsv4.srt.state import SglangV4Cache
from sglang_dsv4.tiny import PRESETS


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("backend", ["torch", "torch-fp8"])  # float rows; FlashMLA's fp8 layout
@pytest.mark.parametrize("preset", ["micro", "tiny"])
def test_plan_matches_the_cache_allocation(preset, backend):
    cfg = V4Config.from_dict(PRESETS[preset])
    rows, slots = 20, 4096
    cache = SglangV4Cache(cfg, rows + 1, slots, max_seq_len=slots, backend=backend)  # as SGLang sizes its rows
    plan = plan_pools(cfg, available_bytes=1 << 34, rows=rows, backend=cache.backend)

    assert plan.row_bytes == _bytes(v[0] for v in cache.slot_state.values())
    assert plan.snapshot_bytes == cache.snapshot_bytes_each  # a snapshot copies a row's state
    assert plan.snapshot_budget_bytes == cache.snapshot_budget_bytes
    # per token slot: one C4 entry per 4 slots, one C128 entry per 128, the two side-table ints
    # (the pools' one scratch page, a constant the step writes discarded entries to, is left out)
    per_entry = {r: _bytes(p.tensors.values()) / (p.capacity + p.page_size) for r, p in cache.pools.items()}
    per_token = per_entry[4] / 4 + per_entry[128] / 128 + _bytes(t[:1] for t in cache.entry_of_slot.values())
    assert plan.token_bytes == pytest.approx(per_token, rel=1e-12)
    assert ENTRY_SIDE_TABLE_BYTES == cache.entry_of_slot[4].element_size() * len(cache.entry_of_slot)


def test_plan_spends_the_budget_rows_and_snapshots_first():
    cfg = V4Config.from_dict(PRESETS["micro"])
    plan = plan_pools(cfg, available_bytes=1 << 30, rows=16, snapshot_budget_mb=8, page_size=64)
    assert plan.snapshot_budget_bytes == 8 << 20
    assert plan.tokens % 64 == 0
    spent = (plan.rows + 1) * plan.row_bytes + plan.snapshot_budget_bytes + plan.tokens * plan.token_bytes
    assert (1 << 30) - 64 * plan.token_bytes < spent <= 1 << 30


def test_plan_refuses_a_budget_without_room_for_tokens():
    cfg = V4Config.from_dict(PRESETS["micro"])
    row = plan_pools(cfg, 1 << 30, rows=4).row_bytes
    with pytest.raises(ValueError, match="max-running-requests"):
        plan_pools(cfg, available_bytes=5 * row, rows=4, snapshot_budget_mb=0)
    assert plan_pools(cfg, available_bytes=5 * row + 1000, rows=4, snapshot_budget_mb=0).tokens > 0


def test_v4_flash_fp8_plan():
    """A realistic budget: 80 GB for V4-Flash's FlashMLA cache (V4Config() defaults), 256 rows,
    default snapshots: 257 rings and 1028 snapshots take ~6.6 GB, the rest buys ~19M token slots.
    The plan charges the layouts' page padding, within 0.2% of ``memory``'s per-row model."""
    from sglang_dsv4.memory import cache_bytes

    flash = V4Config()
    plan = plan_pools(flash, available_bytes=80 * 10**9, backend=select_backend("torch-fp8", flash, "cpu"))
    b = cache_bytes(flash, "fp8")
    assert plan.row_bytes == pytest.approx(b.window_bytes_per_request + b.compressor_state_bytes_per_request, rel=2e-3)
    assert plan.token_bytes == pytest.approx(b.compressed_bytes_per_token + ENTRY_SIDE_TABLE_BYTES, rel=2e-3)
    assert plan.rows == 256 and plan.snapshot_budget_bytes == 1028 * plan.row_bytes
    reserved = (257 + 1028) * plan.row_bytes
    assert plan.tokens == int((80 * 10**9 - reserved) // plan.token_bytes)
    assert 18.5e6 < plan.tokens < 19.5e6


def test_the_default_backend_on_cpu_is_fp32_float_rows():
    # "auto" on a CPU: the torch backend, float32 rows (bit-comparable to the oracle)
    cfg = V4Config.from_dict(PRESETS["micro"])
    cache = SglangV4Cache(cfg, 1, 128, max_seq_len=128)
    assert cache.backend.name == "torch" and cache.slot_state["ring"].dtype == torch.float32
