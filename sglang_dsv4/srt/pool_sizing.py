"""Size SGLang's pools by what our V4 cache stores, not by a generic KV pool it never reads.

SGLang sizes its token pool as ``available bytes // cell size``, with a cell size computed for a
full-attention KV pool of the model's layers. Our model keeps its KV in ``state.SglangV4Cache``:
compressed entries per cached token, and per request row a window ring + compressor state, plus
snapshots under their own budget. So for our architecture:
  - the configurator reserves the rows' rings and the snapshot budget first, then buys token slots
    at our compressed bytes per token, and caps ``max_running_requests`` at the reserved rows;
  - the generic pool is built as SGLang's ``NoOpMHATokenToKVPool`` (placeholder buffers that keep
    the scheduler's capacity accounting, no storage).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import V4Config
from ..kernels.backend import TORCH_BACKEND, AttentionBackend
from ..kernels.dispatch import select_backend
from ..kernels.weight_mode import WEIGHTS_KEY as _WEIGHTS_KEY
from ..core.slot_state import SlotStateLayout

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 256  # upstream's V4 default too; each request row owns a ring
SNAPSHOT_BUDGET_KEY = "dsv4_snapshot_budget_mb"  # read from the HF config (json model overrides)
ATTENTION_BACKEND_KEY = "dsv4_attention_backend"  # likewise: auto | torch | torch-fp8 | flashmla
CUDA_GRAPH_MAX_BS_KEY = "dsv4_cuda_graph_max_bs"  # likewise: decode graphs up to this batch; 0 = off
# likewise: capture the graphs at start-up for requests of up to this many tokens; 0 = on first use
CUDA_GRAPH_PRECAPTURE_KEY = "dsv4_cuda_graph_precapture_len"
WEIGHTS_KEY = _WEIGHTS_KEY  # likewise: auto | bf16 | fp8 (kernels.weight_mode)
DETERMINISTIC_KEY = "dsv4_deterministic"  # likewise: true = V4Model's deterministic mode
ENTRY_PAGE_ROWS = 64  # rows per storage page of the cache's entry pools (FlashMLA's paged layout)
ENTRY_SIDE_TABLE_BYTES = 2 * 4  # per token slot: one int32 entry row per ratio (state.entry_of_slot)


@dataclass(frozen=True)
class V4PoolPlan:
    """How a byte budget splits between request rows, snapshots and token slots."""

    token_bytes: float  # compressed entries + indexer keys + side table, per token slot
    row_bytes: int  # ring + compressor state, per request row
    rows: int  # max_running_requests; SGLang's ReqToTokenPool (and so our cache) holds rows + 1
    snapshot_budget_bytes: int
    tokens: int

    @property
    def snapshot_bytes(self) -> int:
        """One snapshot: a copy of a request row's state, so ``row_bytes``."""
        return self.row_bytes

    def describe(self) -> str:
        return (f"{self.rows + 1} request rows x {self.row_bytes} B + snapshots {self.snapshot_budget_bytes} B "
                f"({self.snapshot_budget_bytes // max(self.snapshot_bytes, 1)} x {self.snapshot_bytes} B) + "
                f"{self.tokens} token slots x {self.token_bytes:.2f} B")


def default_snapshot_budget_bytes(rows: int, snapshot_bytes: int) -> int:
    """Room for four snapshots per request row, at least 64 (the cache's default budget)."""
    return max(64, 4 * rows) * snapshot_bytes


def cache_backend(cfg: V4Config, hf_config, device: torch.device | str) -> AttentionBackend:
    """The attention backend (and so the storage format) of the served model's cache: the
    ``dsv4_attention_backend`` model override, default "auto" (FlashMLA where it runs)."""
    return select_backend(getattr(hf_config, ATTENTION_BACKEND_KEY, None) or "auto", cfg, device)


def storage_bytes(cfg: V4Config, backend: AttentionBackend) -> tuple[int, float]:
    """(bytes of one request row: rings + compressor state, compressed bytes per token slot) as
    ``state.SglangV4Cache`` allocates them for ``backend`` (its layouts, page padding included)."""
    row = SlotStateLayout.of(cfg, backend.window_layout(cfg, torch.float32)).slot_bytes
    entries = backend.entry_layouts(cfg, ENTRY_PAGE_ROWS, torch.float32)
    token = sum(sum(layout.row_bytes for layout in layouts.values()) / r for r, layouts in entries.items())
    return row, token


def plan_pools(cfg: V4Config, available_bytes: int, rows: int | None = None,
               snapshot_budget_mb: float | None = None, backend: AttentionBackend = TORCH_BACKEND,
               page_size: int = 1) -> V4PoolPlan:
    """Split ``available_bytes`` for our cache stored by ``backend``: rows and snapshots first, the
    rest in token slots (floored to ``page_size``). Raises ValueError when nothing is left."""
    row_bytes, entry_bytes = storage_bytes(cfg, backend)
    rows = rows or DEFAULT_MAX_RUNNING_REQUESTS
    pool_rows = rows + 1  # ReqToTokenPool allocates size + 1 rows; the cache gives each a ring
    snapshots = (default_snapshot_budget_bytes(pool_rows, row_bytes) if snapshot_budget_mb is None
                 else int(snapshot_budget_mb * 2**20))
    token_bytes = entry_bytes + ENTRY_SIDE_TABLE_BYTES
    left = available_bytes - pool_rows * row_bytes - snapshots
    tokens = int(max(left, 0) // token_bytes) // page_size * page_size
    if tokens <= 0:
        raise ValueError(
            f"sglang_dsv4: {available_bytes} B of KV memory cannot hold {pool_rows} request rows "
            f"({row_bytes} B each) and the snapshot budget ({snapshots} B) with any token slots left; "
            f"lower --max-running-requests or {SNAPSHOT_BUDGET_KEY}, or raise --mem-fraction-static")
    return V4PoolPlan(token_bytes, row_bytes, rows, snapshots, tokens)


def _v4_config(kvc) -> V4Config:
    return V4Config.from_dict(kvc.model_config.hf_config.to_dict())


def make_pool_configurator(kvc):
    """A ``MemoryPoolConfigurator`` for our model (built lazily: SGLang is imported only here)."""
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig, MemoryPoolConfigurator
    from sglang.srt.runtime_context import get_schedule

    class V4PoolConfigurator(MemoryPoolConfigurator):
        """Token slots at our per-token bytes, after reserving rows and snapshots."""

        def __init__(self) -> None:
            self.cfg = _v4_config(kvc)
            self.rows = get_schedule().max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
            # with data-parallel attention each rank's scheduler runs its share of the requests
            # (SGLang's KVCacheConfigurator.resolve_max_num_reqs), so it needs its share of rows
            self.rows = max(1, self.rows // max(1, int(getattr(kvc, "attn_dp_size", 1) or 1)))
            self.snapshot_mb = getattr(kvc.model_config.hf_config, SNAPSHOT_BUDGET_KEY, None)
            self.backend = cache_backend(self.cfg, kvc.model_config.hf_config, kvc.device)

        def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
            plan = plan_pools(self.cfg, available_bytes, self.rows, self.snapshot_mb, self.backend, page_size)
            logger.info("sglang_dsv4 pool plan for %d B (%s storage): %s", available_bytes,
                        self.backend.name, plan.describe())
            return MemoryPoolConfig(max_total_num_tokens=plan.tokens)

        def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int,
                                                 page_size: int) -> MemoryPoolConfig:
            return MemoryPoolConfig(max_total_num_tokens=max_total_num_tokens // page_size * page_size)

        def finalize_with_max_running_requests(self, config: MemoryPoolConfig) -> MemoryPoolConfig:
            # SGLang's estimate (up to 4096 rows) would allocate more rings than were reserved.
            if config.max_running_requests is None or config.max_running_requests > self.rows:
                config.max_running_requests = self.rows
            return config

    return V4PoolConfigurator()
