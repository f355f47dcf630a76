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
from ..kernels.kv_layout import RowLayout
from .pages import EntryPagePool

Tensor = torch.Tensor
RATIOS = (4, 128)
C4_STATE_ROWS = 8


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


def alloc_slot_state(cfg: V4Config, num_slots: int, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", ring_layout: RowLayout | None = None) -> dict[str, Tensor]:
    """Per-request state tensors, [num_slots, ...] each: what a slot owns and a snapshot copies.

    The rings are float rows of ``dtype`` unless ``ring_layout`` (an attention backend's window
    layout) says otherwise; each ring is one page of that layout.
    """
    Dh, Di, n4, n128 = cfg.head_dim, cfg.index_head_dim, len(cfg.c4_layers), len(cfg.c128_layers)
    n_ring_layers = cfg.num_hidden_layers + cfg.num_mtp_layers

    def zeros(*shape: int) -> Tensor:
        return torch.zeros(num_slots, *shape, dtype=dtype, device=device)

    ring = (zeros(n_ring_layers, cfg.sliding_window, Dh) if ring_layout is None
            else ring_layout.alloc(num_slots, n_ring_layers, device=device))
    return {
        "ring": ring,
        "c4_main_a": zeros(n4, C4_STATE_ROWS, 2 * Dh), "c4_main_s": zeros(n4, C4_STATE_ROWS, 2 * Dh),
        "c4_index_a": zeros(n4, C4_STATE_ROWS, 2 * Di), "c4_index_s": zeros(n4, C4_STATE_ROWS, 2 * Di),
        "c128": zeros(n128, 3, Dh),
    }


def reset_slot_state(slot_state: dict[str, Tensor], slot: int) -> None:
    """State of a request at position 0: only the C128 accumulator needs a value (empty group)."""
    c128 = slot_state["c128"][slot]
    c128[:, 0].fill_(float("-inf"))  # running max
    c128[:, 1:].zero_()              # running sum, weighted sum


class V4Cache:
    """Owns all KV storage of the incremental model for up to ``max_requests`` running requests.

    ``backend`` (an ``AttentionBackend`` or a name for ``kernels.dispatch.select_backend``; default
    "auto": FlashMLA where it can run, else torch) fixes the storage format of the rings and
    compressed entries and the attention kernel; ``dtype`` is that of the compressor state and of
    float storage.
    """

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

        self.slot_state = alloc_slot_state(cfg, max_requests, dtype, self.device,
                                           self.backend.window_layout(cfg, dtype))
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
        reset_slot_state(self.slot_state, req.slot)
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
        on OutOfPagesError nothing has changed.
        """
        for r, pool in self.pools.items():
            need = sum(pool.pages_needed(q.tables[r], q.num_tokens // r, (q.num_tokens + n) // r)
                       for q, n in zip(reqs, num_new))
            if need > pool.num_free:
                raise CacheCapacityError(f"ratio-{r} compressed pool full: need {need} pages, "
                                         f"{pool.num_free} of {pool.num_pages} free")
        return {r: [pool.extend(q.tables[r], q.num_tokens // r, (q.num_tokens + n) // r).to(self.device)
                    for q, n in zip(reqs, num_new)]
                for r, pool in self.pools.items()}

    def entry_rows(self, req: RequestState, ratio: int, num_entries: int) -> Tensor:
        """Storage rows (in ``pools[ratio].tensors``) of the request's entries 0..num_entries-1."""
        return self.pools[ratio].slots(req.tables[ratio], torch.arange(num_entries)).to(self.device)

    # ---- snapshots -----------------------------------------------------------------------
    def snapshot(self, req: RequestState) -> Snapshot:
        """Capture ``req`` at its current position; shares its entries, copies its slot state."""
        snap = Snapshot(
            num_tokens=req.num_tokens, mtp_num_tokens=req.mtp_num_tokens,
            slot_state={k: v[req.slot].clone() for k, v in self.slot_state.items()},
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
        for k, v in snap.slot_state.items():
            self.slot_state[k][req.slot].copy_(v)
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
        return sum(v[0].numel() * v.element_size() for v in self.slot_state.values())

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
