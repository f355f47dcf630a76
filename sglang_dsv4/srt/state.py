"""The V4 cache inside SGLang: request rows own slot state, token slots own compressed entries.

SGLang hands each running request a row of ``req_to_token`` (its token slots, one per position)
and keeps finished prefixes' token slots in its radix tree. We attach V4's state to those:
  - slot state (window ring, compressor state) lives in the request's ``req_pool_idx`` row and is
    reset or restored when a new request takes the row (detected by the row's generation);
  - compressed entry j of a sequence belongs to the token slot of position r*j + r - 1 (the token
    that completed the group): a side table maps that slot to a row of the entry pool, and the
    row is freed when SGLang frees the slot;
  - a snapshot of the state at position P belongs to the token slot of position P - 1, and is
    dropped with it. A request whose cached prefix ends at P resumes from that snapshot.
Only the radix tree decides what stays cached; we follow its token-slot lifetimes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import V4Config
from ..core.cache import RATIOS, RequestState, alloc_slot_state, reset_slot_state
from ..core.pages import EntryRowPool
from ..kernels.backend import AttentionBackend
from ..kernels.dispatch import select_backend
from .pool_sizing import ENTRY_PAGE_ROWS, default_snapshot_budget_bytes

logger = logging.getLogger(__name__)
Tensor = torch.Tensor

_ACTIVE: "SglangV4Cache | None" = None


def active_cache() -> "SglangV4Cache | None":
    """The cache of the model served by this process (one per scheduler / TP rank)."""
    return _ACTIVE


def on_token_slots_freed(slots: Tensor) -> None:
    if _ACTIVE is not None:
        _ACTIVE.free_token_slots(slots)


def on_request_rows_freed(rows: list[int]) -> None:
    if _ACTIVE is not None:
        _ACTIVE.release_rows(rows)


@dataclass
class SlotSnapshot:
    """Slot state at position ``num_tokens``; its entries are reachable through the prefix's slots."""

    num_tokens: int
    slot_state: dict[str, Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slot_state.values())


@dataclass
class _Row:
    state: RequestState
    generation: int


class SglangV4Cache:
    """Duck-types ``core.cache.V4Cache`` for ``V4Model``, with SGLang owning the lifetimes.

    ``backend`` (a name for ``kernels.dispatch.select_backend`` or an ``AttentionBackend``; "auto":
    FlashMLA where it runs, else torch) fixes how rings and entries are stored: FlashMLA's fp8
    layout or float rows of ``dtype``. Compressor state is ``dtype`` (float32) either way.
    """

    def __init__(self, cfg: V4Config, num_req_rows: int, num_token_slots: int, max_seq_len: int,
                 snapshot_budget_bytes: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: AttentionBackend | str | None = "auto"):
        global _ACTIVE
        self.cfg, self.device, self.max_seq_len = cfg, torch.device(device), max_seq_len
        self.backend = select_backend(backend, cfg, self.device)
        self.c4_index = {layer: i for i, layer in enumerate(cfg.c4_layers)}
        self.c128_index = {layer: i for i, layer in enumerate(cfg.c128_layers)}
        self.slot_state = alloc_slot_state(cfg, num_req_rows, dtype, self.device,
                                           self.backend.window_layout(cfg, dtype))
        # Every token slot can own at most one entry per ratio; only every r-th position does, so
        # this is the usual need; a tree of many short branches grows the pool.
        self.pools = {r: EntryRowPool(num_token_slots // r + num_req_rows + 1, layouts, self.device)
                      for r, layouts in self.backend.entry_layouts(cfg, ENTRY_PAGE_ROWS, dtype).items()}
        self.entry_of_slot = {r: torch.full((num_token_slots,), -1, dtype=torch.long) for r in RATIOS}
        # LRU order: least recently taken/matched/restored first
        self.snapshots: OrderedDict[int, SlotSnapshot] = OrderedDict()
        self.snapshot_bytes_each = sum(v[0].numel() * v.element_size() for v in self.slot_state.values())
        self.snapshot_budget_bytes = (snapshot_budget_bytes if snapshot_budget_bytes is not None
                                      else default_snapshot_budget_bytes(num_req_rows, self.snapshot_bytes_each))
        self.rows: dict[int, _Row] = {}
        self.pending_forks: dict[int, tuple[int, list[int]]] = {}  # row -> (generation, positions)
        self.req_to_token: Tensor | None = None
        self._deferred: list[Tensor] | None = None
        self.stats = {"snapshots_taken": 0, "snapshots_restored": 0, "snapshots_dropped": 0,
                      "snapshots_evicted": 0, "prompt_tokens_cached": 0, "prompt_tokens_computed": 0}
        _ACTIVE = self

    # ---- binding SGLang's rows to request state ---------------------------------------------
    def bind(self, row: int, generation: int, prefix_len: int) -> RequestState:
        """The request state of ``row`` about to process tokens from ``prefix_len`` on.

        A new request in the row (new generation) starts from a reset state or, if its cached
        prefix is non-empty, from the snapshot owned by the token slot at prefix_len - 1.
        """
        bound = self.rows.get(row)
        if bound is not None and bound.generation == generation:
            if bound.state.num_tokens != prefix_len:
                raise RuntimeError(f"request row {row}: state at {bound.state.num_tokens} tokens, "
                                   f"batch continues from {prefix_len}")
            return bound.state
        state = RequestState(slot=row)
        if prefix_len == 0:
            reset_slot_state(self.slot_state, row)
        else:
            key = int(self.req_to_token[row, prefix_len - 1])
            snap = self.snapshots.get(key)
            if snap is None or snap.num_tokens != prefix_len:
                raise RuntimeError(f"request row {row}: no snapshot at its cached prefix of {prefix_len} tokens "
                                   "(the radix cache must only match up to snapshot positions)")
            for k, v in snap.slot_state.items():
                self.slot_state[k][row].copy_(v)
            self.snapshots.move_to_end(key)
            self.stats["snapshots_restored"] += 1
            self.stats["prompt_tokens_cached"] += prefix_len
        state.num_tokens = prefix_len
        self.rows[row] = _Row(state, generation)
        return state

    def want_snapshot(self, row: int, generation: int, position: int) -> None:
        """Ask for a snapshot when the request in ``row`` passes ``position`` (a divergence point)."""
        gen, positions = self.pending_forks.get(row, (generation, []))
        if gen != generation:
            positions = []
        if position not in positions:
            self.pending_forks[row] = (generation, positions + [position])

    def fork_points(self, row: int, generation: int, start: int, end: int) -> list[int]:
        """Positions in (start, end] where the request in ``row`` wants a snapshot."""
        gen, positions = self.pending_forks.get(row, (None, []))
        return sorted(p for p in positions if gen == generation and start < p <= end)

    def _slots(self, row: int, positions: Tensor) -> Tensor:
        """Token slots of ``positions`` in request row ``row``, as int64 on the host (where the
        side tables live; SGLang keeps ``req_to_token`` on the model's device)."""
        return self.req_to_token[row, positions.to(self.req_to_token.device)].long().cpu()

    # ---- what V4Model asks of a cache ----------------------------------------------------
    def check_length(self, req: RequestState, num_new: int) -> None:
        end = req.num_tokens + num_new
        if end > self.max_seq_len:
            raise ValueError(f"sequence of {end} tokens exceeds the maximum length {self.max_seq_len}")

    def reserve_entries(self, reqs: list[RequestState], num_new: list[int]) -> dict[int, list[Tensor]]:
        """Entry rows for the groups each request completes, owned by the completing token slots."""
        out: dict[int, list[Tensor]] = {r: [] for r in RATIOS}
        for req, n in zip(reqs, num_new):
            for r, pool in self.pools.items():
                first, last = req.num_tokens // r, (req.num_tokens + n) // r
                slots = self._slots(req.slot, torch.arange(first, last) * r + r - 1)
                old = self.entry_of_slot[r][slots]
                pool.free(old[old >= 0])  # a slot written again (recompute) drops its old entry
                rows = pool.alloc(last - first)
                self.entry_of_slot[r][slots] = rows
                out[r].append(rows)
        return out

    def entry_rows(self, req: RequestState, ratio: int, num_entries: int) -> Tensor:
        slots = self._slots(req.slot, torch.arange(num_entries) * ratio + ratio - 1)
        rows = self.entry_of_slot[ratio][slots]
        if num_entries and bool((rows < 0).any()):
            j = int(torch.nonzero(rows < 0)[0])
            raise RuntimeError(f"request row {req.slot}: compressed entry {j} (ratio {ratio}) missing "
                               f"for token slot {int(slots[j])}")
        return rows

    # ---- snapshots -----------------------------------------------------------------------
    def take_snapshot(self, req: RequestState) -> None:
        """Snapshot ``req`` at its current position, owned by its token slot at position - 1."""
        if req.num_tokens == 0:
            return
        key = int(self.req_to_token[req.slot, req.num_tokens - 1])
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return
        self.snapshots[key] = SlotSnapshot(
            req.num_tokens, {k: v[req.slot].clone() for k, v in self.slot_state.items()})
        self.stats["snapshots_taken"] += 1
        self._evict_snapshots()

    def _evict_snapshots(self) -> None:
        """Least recently used first, down to the budget. Safe between scheduler steps: a request
        matches, binds and restores within one step, and evictions run after its bind."""
        while len(self.snapshots) * self.snapshot_bytes_each > self.snapshot_budget_bytes and self.snapshots:
            self.snapshots.popitem(last=False)
            self.stats["snapshots_evicted"] += 1

    def deepest_snapshot(self, path_slots: Tensor) -> int:
        """Largest P such that path_slots[P-1] owns a snapshot at position P (0 if none)."""
        if not self.snapshots or path_slots.numel() == 0:
            return 0
        keys = torch.tensor(list(self.snapshots), dtype=torch.long)
        hits = torch.nonzero(torch.isin(path_slots.long().cpu(), keys)).flatten().tolist()
        for i in reversed(hits):
            key = int(path_slots[i])
            if self.snapshots[key].num_tokens == i + 1:
                self.snapshots.move_to_end(key)  # matched: most recently used
                return i + 1
        return 0

    def move_snapshots(self, old_slots: Tensor, new_slots: Tensor) -> None:
        """The radix tree kept its own slots for positions a request recomputed: snapshots and
        entries the request made there move to the tree's slots (where those have none)."""
        for old, new in zip(old_slots.tolist(), new_slots.tolist()):
            if old != new and old in self.snapshots and new not in self.snapshots:
                self.snapshots[new] = self.snapshots.pop(old)

    @contextmanager
    def deferred_frees(self) -> Iterator[None]:
        """Hold slot frees until the block ends, so snapshots can move off slots being freed."""
        self._deferred = []
        try:
            yield
        finally:
            pending, self._deferred = self._deferred, None
            for slots in pending:
                self.free_token_slots(slots)

    def free_token_slots(self, slots: Tensor) -> None:
        if slots.numel() == 0:
            return
        if self._deferred is not None:
            self._deferred.append(slots.clone())
            return
        slots = slots.long().cpu()
        for r, pool in self.pools.items():
            rows = self.entry_of_slot[r][slots]
            pool.free(rows[rows >= 0])
            self.entry_of_slot[r][slots] = -1
        if self.snapshots:
            for s in slots.tolist():
                if self.snapshots.pop(s, None) is not None:
                    self.stats["snapshots_dropped"] += 1

    # ---- accounting ----------------------------------------------------------------------
    def clear_token_state(self) -> None:
        """All token slots were released together (cache flush): drop every entry and snapshot."""
        for r, pool in self.pools.items():
            rows = self.entry_of_slot[r]
            pool.free(rows[rows >= 0])
            rows.fill_(-1)
        self.stats["snapshots_dropped"] += len(self.snapshots)
        self.snapshots.clear()

    def release_rows(self, rows: list[int]) -> None:
        """SGLang freed these request rows: their rings are no longer in use."""
        for row in rows:
            self.rows.pop(row, None)
            self.pending_forks.pop(row, None)

    def usage(self) -> dict[str, int]:
        """Entries, rings and snapshots held right now (for metrics and leak checks)."""
        entries = {r: p.num_used for r, p in self.pools.items()}
        return {"c4_entries": entries[4], "c128_entries": entries[128],
                "compressed_bytes": int(sum(p.num_used * p.row_bytes for p in self.pools.values())),
                "rings_in_use": len(self.rows),
                "snapshots": len(self.snapshots),
                "snapshot_bytes": len(self.snapshots) * self.snapshot_bytes_each}
