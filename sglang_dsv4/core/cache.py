"""The two-segment V4 cache: shared compressed entries, per-request rings and compressor state.

Per request (a *slot*):
  - a window ring per layer (main layers, then MTP layers): [W, Dh], position p at row p % W;
  - C4 compressor state per ratio-4 layer: raw (a, s) rows of positions 4*floor(P/4)-4 .. P-1 at
    row p % 8, for the main compressor (width 2*Dh) and the indexer's (width 2*Di);
  - C128 compressor state per ratio-128 layer: an online-softmax accumulator (max, sum, weighted
    sum) of the open group, [3, Dh] — a fixed size whatever P mod 128 is.
Shared (paged, reference-counted, append-only; see ``pages``): compressed entries of ratio-4
layers (main and indexer keys) and of ratio-128 layers, entry j addressed through the request's
page table. A ``Snapshot`` at position P holds a copy of the slot state and references to the
pages of entries below P//r, so any number of requests can resume from P without recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import V4Config
from ..kernels.backend import AttentionBackend
from ..kernels.dispatch import select_backend
from .pages import EntryPagePool
from .slot_state import SlotStateLayout
from .step import RATIOS, StepBatch, StepTables, TablePlan, completing_tokens, entry_width

Tensor = torch.Tensor


class CacheCapacityError(RuntimeError):
    """No free request slot, or the compressed pool cannot hold the request."""


@dataclass
class RequestState:
    """A running request: its slot, how many tokens it has processed, its entry page tables."""

    slot: int
    num_tokens: int = 0
    mtp_num_tokens: int = 0
    tables: dict[int, list[int]] = field(default_factory=lambda: {r: [] for r in RATIOS})
    freed: bool = False


@dataclass
class Snapshot:
    """Everything needed to resume at position ``num_tokens`` besides the shared entries."""

    num_tokens: int
    mtp_num_tokens: int
    slot_state: dict[str, Tensor]
    tables: dict[int, list[int]]
    released: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes this snapshot owns (slot state); the entries it references are shared."""
        return sum(t.numel() * t.element_size() for t in self.slot_state.values())


class V4Cache:
    """Owns all KV storage of the incremental model for up to ``max_requests`` running requests.

    ``backend`` (an ``AttentionBackend`` or a name for ``kernels.dispatch.select_backend``; default
    "auto": FlashMLA where it can run, else torch) fixes the storage format of the rings and
    compressed entries and the attention kernel; ``dtype`` is that of the compressor state and of
    float storage.
    """

    host_entries = True  # plan_tables builds each step's entry tables from the page tables

    def __init__(self, cfg: V4Config, max_requests: int = 8, max_total_tokens: int = 65536,
                 page_size: int = 64, max_seq_len: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: AttentionBackend | str | None = "auto"):
        self.cfg, self.page_size, self.device = cfg, page_size, torch.device(device)
        self.backend = select_backend(backend, cfg, self.device)
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        self.c4_index = {layer: i for i, layer in enumerate(cfg.c4_layers)}
        self.c128_index = {layer: i for i, layer in enumerate(cfg.c128_layers)}

        self.layout = SlotStateLayout.of(cfg, self.backend.window_layout(cfg, dtype), dtype)
        self.slot_state = self.layout.alloc(max_requests, self.device)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests
        # a token budget's worth of full pages, plus one partly filled page per running request
        pages = {r: -(-max_total_tokens // (r * page_size)) + max_requests for r in RATIOS}
        self.pools = {r: EntryPagePool(pages[r], page_size, layouts, dtype, self.device)
                      for r, layouts in self.backend.entry_layouts(cfg, page_size, dtype).items()}
        self.live_requests: dict[int, RequestState] = {}
        self.live_snapshots: list[Snapshot] = []

    # ---- requests ------------------------------------------------------------------------
    def new_request(self) -> RequestState:
        """Take a free slot for a request that starts at position 0."""
        if not self._free_slots:
            raise CacheCapacityError(f"all {self.max_requests} request slots are in use")
        req = RequestState(slot=self._free_slots.pop())
        self.layout.reset(self.slot_state, req.slot)
        self.live_requests[req.slot] = req
        return req

    def free_request(self, req: RequestState) -> None:
        """Return the slot and drop the request's references to shared pages."""
        if req.freed:
            raise AssertionError(f"request in slot {req.slot} freed twice")
        req.freed = True
        for r, table in req.tables.items():
            self.pools[r].decref(table)
            table.clear()
        del self.live_requests[req.slot]
        self._free_slots.append(req.slot)

    def check_length(self, req: RequestState, num_new: int) -> None:
        end = req.num_tokens + num_new
        if end > self.max_seq_len:
            raise ValueError(f"sequence of {end} tokens exceeds the maximum length {self.max_seq_len} "
                             f"({req.num_tokens} cached + {num_new} new)")

    def reserve_entries(self, reqs: list[RequestState], num_new: list[int]) -> dict[int, list[Tensor]]:
        """Make room for the entries each request completes in this forward.

        -> {ratio: [storage rows of entries completed, per request]}. Checks every pool first, so
        on CacheCapacityError nothing has changed.
        """
        for r, pool in self.pools.items():
            need = sum(pool.pages_needed(q.tables[r], q.num_tokens // r, (q.num_tokens + n) // r)
                       for q, n in zip(reqs, num_new))
            if need > pool.num_free:
                raise CacheCapacityError(f"ratio-{r} compressed pool full: need {need} pages, "
                                         f"{pool.num_free} of {pool.num_pages} free")
        return {r: [pool.extend(q.tables[r], q.num_tokens // r, (q.num_tokens + n) // r)
                    for q, n in zip(reqs, num_new)]
                for r, pool in self.pools.items()}

    def plan_tables(self, reqs: list[RequestState], starts: list[int], lens: list[int],
                    positions: Tensor) -> TablePlan:
        """The step's tables from the page tables, all built on the host (this is the reference)."""
        reserved = self.reserve_entries(list(reqs), lens)
        write, table, widths = {}, {}, {}
        widths_of_end = self.table_widths(max(s + n for s, n in zip(starts, lens)))
        for r, pool in self.pools.items():
            rows = torch.full((positions.numel(),), pool.scratch_row, dtype=torch.long)
            done = completing_tokens(positions, r)
            rows[done] = torch.cat(reserved[r]) if reserved[r] else rows[done]
            width = widths_of_end[r]
            t = torch.full((len(reqs), width), -1, dtype=torch.long)
            for i, (q, s, n) in enumerate(zip(reqs, starts, lens)):
                m = (s + n) // r
                t[i, :m] = self.entry_rows(q, r, m)
            write[r], table[r], widths[r] = rows, t, width
        return TablePlan(write, table, widths)

    def table_widths(self, end: int) -> dict[int, int]:
        return {r: entry_width(end // r, self.max_seq_len // r, self.device) for r in self.pools}

    def apply_tables(self, step: StepBatch, write: dict[int, Tensor], entries: dict[int, Tensor] | None,
                     widths: dict[int, int]) -> StepTables:
        return StepTables(write, entries)

    def retire(self, replaced: dict[int, Tensor]) -> None:
        """Nothing to take back: a request's positions always get rows of their own here."""

    def entry_rows(self, req: RequestState, ratio: int, num_entries: int) -> Tensor:
        """Storage rows (in ``pools[ratio].tensors``) of the request's entries 0..num_entries-1."""
        return self.pools[ratio].slots(req.tables[ratio], torch.arange(num_entries))

    # ---- snapshots -----------------------------------------------------------------------
    def snapshot(self, req: RequestState) -> Snapshot:
        """Capture ``req`` at its current position; shares its entries, copies its slot state."""
        snap = Snapshot(
            num_tokens=req.num_tokens, mtp_num_tokens=req.mtp_num_tokens,
            slot_state=self.layout.copy_out(self.slot_state, req.slot),
            tables={r: list(t) for r, t in req.tables.items()})
        for r, t in snap.tables.items():
            self.pools[r].incref(t)
        self.live_snapshots.append(snap)
        return snap

    def restore(self, snap: Snapshot) -> RequestState:
        """A new request that continues exactly where ``snap`` was taken."""
        if snap.released:
            raise AssertionError("restore from a released snapshot")
        req = self.new_request()
        self.layout.copy_in(self.slot_state, req.slot, snap.slot_state)
        req.num_tokens, req.mtp_num_tokens = snap.num_tokens, snap.mtp_num_tokens
        req.tables = {r: list(t) for r, t in snap.tables.items()}
        for r, t in req.tables.items():
            self.pools[r].incref(t)
        return req

    def release(self, snap: Snapshot) -> None:
        if snap.released:
            raise AssertionError("snapshot released twice")
        snap.released = True
        for r, t in snap.tables.items():
            self.pools[r].decref(t)
        self.live_snapshots.remove(snap)

    # ---- accounting ----------------------------------------------------------------------
    def slot_state_bytes(self) -> int:
        """Bytes of one request's own state (ring + compressor state)."""
        return self.layout.slot_bytes

    def check_integrity(self) -> None:
        """free slots + live requests == all slots; page refcounts == holders."""
        if len(self._free_slots) + len(self.live_requests) != self.max_requests:
            raise AssertionError("request slots leaked")
        for r, pool in self.pools.items():
            holders = [q.tables[r] for q in self.live_requests.values()]
            holders += [s.tables[r] for s in self.live_snapshots]
            pool.check_integrity(holders)

    def is_idle(self) -> bool:
        """No request, no snapshot, every page free."""
        return (not self.live_requests and not self.live_snapshots
                and all(p.num_free == p.num_pages for p in self.pools.values()))
