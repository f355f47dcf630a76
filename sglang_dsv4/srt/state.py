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

The slot -> entry-row side table and each request row's list of entry rows live on the model's
device and are appended by the step itself (``apply_tables``, inside the decode step's CUDA
graph), so a decode step reads no host table and rebuilds nothing from the context. Entry rows
are handed out on the host from lengths alone.

The scheduler's hooks read nothing back from the device: under SGLang's overlap scheduler such a
read waits for the forward in flight. A free (``free_token_slots``) clears the freed slots'
table entries on the device and starts a copy of the rows they owned (and the slots) to the host
without waiting for it (``_PendingFree``); a publish (the radix tree took a request's tokens) and
a fork-point snapshot copy the slot values that key their snapshots the same way
(``_PendingPublish``). They take effect in order once their copies are done (``collect_pending``:
before each step's allocation, waiting only when a pool would otherwise grow). A radix match
finds its snapshot on the tree's nodes (``radix_cache``), not through slot values. The cache
records an event after a forward's last read of ``req_to_token`` (``end_forward``), which the
model can hand the scheduler as the forward's read-done event (patches/read-done-event.md): its
next writes of shared tables then wait for that, not the whole forward. A snapshot a hook takes
is copied at the next forward's start, on the model's stream, since the forward in flight may
still be writing the row (``SlotSnapshot``).

SGLang's hooks reach the cache of their process through ``serving_cache()``, which the plugin
sets once the model has built it (``register_serving_cache``); nothing else is process-wide.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from ..config import V4Config
from ..core.cache import RequestState
from ..core.compiled import on_gpu
from ..core.pages import EntryRowPool
from ..core.slot_state import SlotStateLayout
from ..core.step import RATIOS, StepBatch, StepTables, TablePlan, completing_tokens, entry_width
from ..kernels.backend import AttentionBackend
from ..kernels.dispatch import select_backend
from .pool_sizing import ENTRY_PAGE_ROWS, default_snapshot_budget_bytes

logger = logging.getLogger(__name__)
# SGLang's idle self-check audits the cache (``SglangV4Cache.idle_audit_due``) only after this long
# without a change, and at most this often: the audit scans the pools and the radix tree, and a
# request arriving meanwhile waits for it (110 ms on the flash8 server after a concurrency-64 sweep)
IDLE_AUDIT_QUIET_S = 1.0
IDLE_AUDIT_INTERVAL_S = 10.0
# pending replaced-row tensors (``SglangV4Cache.retire``) before they start a free of their own
MAX_PENDING_ORPHANS = 32
Tensor = torch.Tensor

_SERVING: "SglangV4Cache | None" = None


def register_serving_cache(cache: "SglangV4Cache | None") -> None:
    """Make ``cache`` the one SGLang's hooks in this process reach (the plugin calls this right
    after the model attached its cache to SGLang's pools; one scheduler / TP rank per process)."""
    global _SERVING
    _SERVING = cache


def serving_cache() -> "SglangV4Cache | None":
    """The cache of the model served by this process, or None before it exists."""
    return _SERVING


def on_token_slots_freed(slots: Tensor) -> None:
    if _SERVING is not None:
        _SERVING.free_token_slots(slots)


def on_request_rows_freed(rows: list[int]) -> None:
    if _SERVING is not None:
        _SERVING.release_rows(rows)


@dataclass
class SlotSnapshot:
    """Slot state at position ``num_tokens``; its entries are reachable through the prefix's slots.

    A snapshot a scheduler hook takes (``SglangV4Cache.publish``) is copied on the model's stream
    at the start of the next forward (``pending_row``: the request row to copy then; ``slot_state``
    None until then): under SGLang's overlap scheduler the forward still running may be writing
    that row, and a hook's copy on the scheduler's stream would race with it.

    Owned by a token slot once keyed (``SglangV4Cache.snapshots``); the radix tree may also
    hold it at its position (``radix_cache``). Dropped, it is ``released``: its state goes, and
    nothing resumes from it."""

    num_tokens: int
    slot_state: dict[str, Tensor] | None
    pending_row: int | None = None
    released: bool = False
    key: int | None = None  # the token slot that owns it, once keyed

    def release(self) -> None:
        self.slot_state, self.pending_row, self.released, self.key = None, None, True, None


@dataclass
class _InFlight:
    """Device values on their way to the host in one buffer, copied without a sync; what they
    change takes effect when the cache collects them (``SglangV4Cache.collect_pending``)."""

    host: Tensor                     # int64 on the host (pinned, filled by the copy on a GPU)
    device: Tensor | None            # the copy's source, held until it is done
    done: "torch.cuda.Event | None"  # recorded after the copy; None: a host copy, done at once

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


@dataclass
class _PendingFree(_InFlight):
    """A free: the entry rows its slots owned (per ratio, -1 for none) and, while snapshots may
    sit on them, the freed slots. Until collected the rows count as in use and snapshots on the
    slots as held; nothing keys a new snapshot on a freed slot before its free is collected
    (every keying reads a slot value first, or is a publish, collected in order)."""

    # (ratio, n) segments of ``host``, in order; the slots after them
    counts: list[tuple[int, int]] = field(default_factory=list)
    num_slots: int = 0  # freed slots at ``host``'s end (0: no snapshots to drop)

    def rows(self) -> list[tuple[int, Tensor]]:
        """(ratio, the real entry rows of that segment), in order (the copy must be done)."""
        out, off = [], 0
        for r, n in self.counts:
            seg = self.host[off:off + n]
            out.append((r, seg[seg >= 0]))
            off += n
        return out

    def slots(self) -> Tensor:
        """The freed slots it carries (empty when it carries none)."""
        return self.host[self.host.numel() - self.num_slots:]


@dataclass
class _PendingPublish(_InFlight):
    """A publish: ``host`` is [2, n], the request's own slots of its first n positions and the
    tree's. Collected, ``snap`` (the request's snapshot at n, if any) is keyed on its own slot of
    position n - 1, and snapshots on its own slots the tree replaced move to the tree's."""

    snap: SlotSnapshot | None = None


@dataclass
class _Row:
    state: RequestState
    generation: int


@on_gpu(rows={"pos": (0,), "tok_slot": (0,), "tok_req_slot": (0,), "slots": (0,), "write": (0,)})
def file_entries(pos: Tensor, tok_slot: Tensor, tok_req_slot: Tensor, slots: Tensor, write: Tensor,
                 entry_of_slot: Tensor, req_entries: Tensor, ratio: int, width: int, want_old: bool
                 ) -> tuple[Tensor, Tensor | None]:
    """One ratio's table updates of a step, in place: token t at position p that completes a group
    files its entry row ``write[t]`` under its token slot (``entry_of_slot`` [slots + 1], the last
    element scratch) and as entry (p + 1) // ratio - 1 of its request row ``tok_req_slot[t]``
    (``req_entries`` [rows + 1, max entries], the last row scratch); the other tokens write the
    scratch elements. -> (the request rows ``slots``' first ``width`` entries, int64; the entries
    the slots held before, -1 where none is replaced, when ``want_old``).

    One fused region on the GPU (``core.compiled``): as separate ops it was ~17 launches per
    ratio and step, all on a few integers per token."""
    w32 = write.to(torch.int32)
    done = completing_tokens(pos, ratio)
    slot_idx = torch.where(done, tok_slot.long(), entry_of_slot.shape[0] - 1)
    old = torch.where(done, entry_of_slot[slot_idx], -1) if want_old else None
    entry_of_slot[slot_idx] = w32
    # 2-D indices into the table itself: a scatter through a view of it would be functionalised
    # into a copy of the whole table when traced
    row = torch.where(done, tok_req_slot, req_entries.shape[0] - 1)
    req_entries[row, torch.where(done, (pos + 1) // ratio - 1, 0)] = w32
    return req_entries[slots, :width].long(), old


class SglangV4Cache:
    """Duck-types ``core.cache.V4Cache`` for ``V4Model``, with SGLang owning the lifetimes.

    ``backend`` (a name for ``kernels.dispatch.select_backend`` or an ``AttentionBackend``; "auto":
    FlashMLA where it runs, else torch) fixes how rings and entries are stored: FlashMLA's fp8
    layout or float rows of ``dtype``. Compressor state is ``dtype`` (float32) either way.
    """

    host_entries = False  # the entry tables live on the device, appended by apply_tables

    def __init__(self, cfg: V4Config, num_req_rows: int, num_token_slots: int, max_seq_len: int,
                 snapshot_budget_bytes: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: AttentionBackend | str | None = "auto"):
        self.cfg, self.device, self.max_seq_len = cfg, torch.device(device), max_seq_len
        self.backend = select_backend(backend, cfg, self.device)
        self.c4_index = {layer: i for i, layer in enumerate(cfg.c4_layers)}
        self.c128_index = {layer: i for i, layer in enumerate(cfg.c128_layers)}
        self.layout = SlotStateLayout.of(cfg, self.backend.window_layout(cfg, dtype), dtype)
        self.slot_state = self.layout.alloc(num_req_rows, self.device)  # + the scratch row
        self.num_req_rows, self.num_token_slots = num_req_rows, num_token_slots
        # Every token slot can own at most one entry per ratio; only every r-th position does, so
        # this is the usual need; a tree of many short branches grows the pool.
        self.pools = {r: EntryRowPool(num_token_slots // r + num_req_rows + 1, layouts, self.device)
                      for r, layouts in self.backend.entry_layouts(cfg, ENTRY_PAGE_ROWS, dtype).items()}
        # device side tables (int32; the last element / row is scratch): token slot -> entry row,
        # and per request row its entries' rows in order
        self.entry_of_slot = {r: torch.full((num_token_slots + 1,), -1, dtype=torch.int32, device=self.device)
                              for r in RATIOS}
        self.req_entries = {r: torch.full((num_req_rows + 1, max(max_seq_len // r, 1)), -1, dtype=torch.int32,
                                          device=self.device) for r in RATIOS}
        # (ratio, entry rows) of slots written twice: freed with the next free
        self._orphans: list[tuple[int, Tensor]] = []
        # frees and publishes whose slot values are on their way to the host, oldest first
        self._pending: list[_InFlight] = []
        # entries resumes found missing (``refresh_entries``), counted on the device: 0 or a bug
        self._missing_entries = torch.zeros((), dtype=torch.long, device=self.device)
        # LRU order: least recently taken/matched/restored first
        self.snapshots: OrderedDict[int, SlotSnapshot] = OrderedDict()
        # keys radix matches found since the last step's binds: not evicted before those binds
        # (a later match of the round collects publishes, whose snapshots may evict)
        self._matched: set[int] = set()
        self.snapshot_bytes_each = self.layout.slot_bytes
        self.snapshot_budget_bytes = (snapshot_budget_bytes if snapshot_budget_bytes is not None
                                      else default_snapshot_budget_bytes(num_req_rows, self.snapshot_bytes_each))
        self.rows: dict[int, _Row] = {}
        self.pending_forks: dict[int, tuple[int, list[int]]] = {}  # row -> (generation, positions)
        self._resume_from: dict[int, tuple[int, int, SlotSnapshot]] = {}  # row -> (generation, prefix, snapshot)
        # per request row, its snapshots the radix tree has not placed yet (``take_row_snapshots``)
        self._row_snaps: dict[int, list[SlotSnapshot]] = {}
        self.req_to_token: Tensor | None = None  # SGLang's (``srt.model``), or ``with_own_table``'s
        self._deferred: list[Tensor] | None = None
        self.stats = {"snapshots_taken": 0, "snapshots_restored": 0, "snapshots_dropped": 0,
                      "snapshots_evicted": 0, "prompt_tokens_cached": 0, "prompt_tokens_computed": 0,
                      "integrity_checks": 0, "integrity_failures": 0, "tree_tokens_evicted": 0,
                      "aborts_queued": 0, "aborts_mid_prefill": 0, "aborts_running": 0,
                      "rows_read_back": 0,  # forwards whose rows came from the device (a host sync)
                      "resume_keys_read_back": 0,  # resumes whose snapshot key did (no expect_resume)
                      # the cache's reads of device values outside the idle audit (``_to_host``,
                      # counted on any device): on a GPU each a host sync; the ms the host waited
                      "host_reads": 0, "host_read_ms": 0.0,
                      # collects that had to wait for a free's or publish's copy (a pool ran short)
                      "copy_waits": 0}
        self.metrics = None  # a metrics.V4CacheMetrics refreshed by run_integrity_check, if any
        # changes to the state so far (forward steps, frees, flushes); at the last integrity check,
        # at the last metrics refresh; the change count an idle server last showed, and since when
        self._changes, self._checked_at, self._metrics_at = 0, -1, (-1, -1)
        self._quiet: tuple[int, float] = (-1, 0.0)
        self._last_audit = float("-inf")
        # snapshots published by the hooks, copied at the next forward's start (``SlotSnapshot``)
        self._pending_copies: list[SlotSnapshot] = []
        # SGLang's overlap scheduler fences its next writes of shared buffers (``req_to_token``)
        # on the forward's reads of them: on the whole forward unless the model publishes the
        # event after its last read (``end_forward``). Ours: recorded at the end of
        # ``apply_tables``, external so that a CUDA graph holding the step records it on replay.
        self._tables_read = torch.cuda.Event(external=True) if self.device.type == "cuda" else None
        self._late_table_read = False  # this forward read req_to_token after its tables (a fork snapshot)

    def _to_host(self, t: Tensor) -> Tensor:
        """``t`` on the host. From a GPU that is a host sync, which under SGLang's overlap
        scheduler waits for the step in flight: counted (``host_reads``) and timed
        (``host_read_ms``), so a server run shows what the scheduler's hooks wait."""
        self.stats["host_reads"] += 1  # counted on the CPU too: the tests see what a GPU would sync on
        if t.device.type == "cpu":
            return t
        t0 = time.perf_counter()
        out = t.cpu()
        self.stats["host_read_ms"] += (time.perf_counter() - t0) * 1e3
        return out

    # ---- binding SGLang's rows to request state ---------------------------------------------
    def bind(self, row: int, generation: int, prefix_len: int) -> RequestState:
        """The request state of ``row`` about to process tokens from ``prefix_len`` on.

        A new request in the row (new generation) starts from a reset state or, if its cached
        prefix is non-empty, from the snapshot owned by the token slot at prefix_len - 1.
        """
        if self._pending_copies:  # the forward's first device work: before any row changes
            self._copy_pending_snapshots()
        hint = self._resume_from.pop(row, None)
        bound = self.rows.get(row)
        if bound is not None and bound.generation == generation:
            if bound.state.num_tokens != prefix_len:
                raise RuntimeError(f"request row {row}: state at {bound.state.num_tokens} tokens, "
                                   f"batch continues from {prefix_len}")
            return bound.state
        state = RequestState(slot=row)
        self._row_snaps.pop(row, None)
        for table in self.req_entries.values():
            table[row].fill_(-1)
        if prefix_len == 0:
            self.layout.reset(self.slot_state, row)
        else:
            if hint is not None and hint[:2] == (generation, prefix_len):
                snap = hint[2]  # the radix match's: no read of the device table
            else:
                key = int(self._to_host(self.req_to_token[row, prefix_len - 1]))
                self.collect_pending(wait=True)  # snapshots as of now: none of a freed slot's old owner
                self.stats["resume_keys_read_back"] += 1
                snap = self.snapshots.get(key)
            if snap is None or snap.released or snap.num_tokens != prefix_len:
                raise RuntimeError(f"request row {row}: no snapshot at its cached prefix of {prefix_len} tokens "
                                   "(the radix cache must only match up to snapshot positions)")
            self.layout.copy_in(self.slot_state, row, snap.slot_state)
            self.refresh_entries(row, prefix_len, check=True)
            self.stats["snapshots_restored"] += 1
            self.stats["prompt_tokens_cached"] += prefix_len
        state.num_tokens = prefix_len
        self.rows[row] = _Row(state, generation)
        return state

    def expect_resume(self, row: int, generation: int, prefix_len: int, snap: SlotSnapshot) -> None:
        """The request about to bind ``row`` (``generation``) resumes at ``prefix_len`` from
        ``snap`` (its radix match's): its ``bind`` then reads nothing back from the device.
        Dropped with the row or at that bind."""
        self._resume_from[row] = (generation, prefix_len, snap)

    def matched(self, snap: SlotSnapshot) -> None:
        """A radix match found ``snap``: most recently used, and not evicted before the next
        step's binds (``_evict_snapshots``)."""
        self._matched.add(id(snap))
        if snap.key is not None and self.snapshots.get(snap.key) is snap:
            self.snapshots.move_to_end(snap.key)

    def take_row_snapshots(self, row: int, end: int) -> list[SlotSnapshot]:
        """The snapshots the request in ``row`` took at positions up to ``end`` and the radix tree
        has not placed yet (the tree now holds its first ``end`` tokens: it places them)."""
        snaps = self._row_snaps.get(row, [])
        placed = [s for s in snaps if s.num_tokens <= end and not s.released]
        self._row_snaps[row] = [s for s in snaps if s.num_tokens > end]
        return placed

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

    def refresh_entries(self, row: int, num_tokens: int, check: bool = False) -> None:
        """Row ``row``'s entry lists from the slots of its first ``num_tokens`` positions (a
        request resuming on the tree's slots, or after the tree deduplicated its slots): device
        gathers, no host sync. With ``check`` (a resume) the entries it found missing are counted
        on the device, and ``check_integrity`` fails on any: the radix cache resumes only where
        every completed group has its entry, so a miss is a bug, found by the next audit (after
        every step under SGLang's per-step check) without a sync on the request's path."""
        for r, table in self.req_entries.items():
            n = num_tokens // r
            if not n:
                continue
            slots = self.req_to_token[row, torch.arange(n, device=self.req_to_token.device) * r + r - 1]
            rows = self.entry_of_slot[r][slots.to(self.device).long()]
            table[row, :n] = rows
            if check:
                self._missing_entries += (rows < 0).sum()

    @classmethod
    def with_own_table(cls, cfg: V4Config, num_req_rows: int, num_token_slots: int, max_seq_len: int,
                       **kwargs) -> "SglangV4Cache":
        """A cache with its own request-to-token table (zeros [rows, max_seq_len] int32 on its
        device, as SGLang's ``ReqToTokenPool`` keeps it), for code that drives the cache without
        SGLang: tests, benchmarks, tools. The caller writes each request's token slots into it."""
        cache = cls(cfg, num_req_rows, num_token_slots, max_seq_len, **kwargs)
        cache.req_to_token = torch.zeros(num_req_rows, max_seq_len, dtype=torch.int32, device=cache.device)
        return cache

    # ---- what V4Model asks of a cache (step.V4CacheView) --------------------------------------
    def check_length(self, req: RequestState, num_new: int) -> None:
        end = req.num_tokens + num_new
        if end > self.max_seq_len:
            raise ValueError(f"sequence of {end} tokens exceeds the maximum length {self.max_seq_len}")

    def plan_tables(self, reqs: list[RequestState], starts: list[int], lens: list[int],
                    positions: Tensor) -> TablePlan:
        """Entry rows for the groups this step completes, from the host pools by count (lengths
        are on the host); the device part (``apply_tables``) files them."""
        self._changes += 1
        if self._pending_copies:  # a step without a bind before it (a driver reusing its states)
            self._copy_pending_snapshots()
        # array operations over the step's positions (each request's s..e-1), in numpy (a torch
        # op on the host costs several microseconds; this runs before every step, on the
        # server's critical path): the tokens that complete a group are the e // r - s // r of
        # each request, and the last end is the largest position + 1
        pos = positions.numpy()
        self._matched.clear()  # the step's requests are bound: what they matched is restored
        self.collect_pending()  # the frees and publishes whose copies are done: no wait
        write = {}
        for r, pool in self.pools.items():
            done = completing_tokens(pos, r)
            n = int(np.count_nonzero(done))
            if n > pool.num_free and self._pending:
                self.collect_pending(wait=True)  # rows on their way back before the pool grows
            w = np.full(pos.shape[0], pool.scratch_row, dtype=np.int64)
            if n:
                w[done] = pool.alloc(n).numpy()
            write[r] = torch.from_numpy(w)
        return TablePlan(write, None, self.table_widths(int(pos.max()) + 1))

    def table_widths(self, end: int) -> dict[int, int]:
        return {r: entry_width(end // r, self.req_entries[r].shape[1], self.device) for r in self.pools}

    def apply_tables(self, step: StepBatch, write: dict[int, Tensor], entries: dict[int, Tensor] | None,
                     widths: dict[int, int]) -> StepTables:
        """The completing token slots take their rows: the slot -> row table and the request rows'
        entry lists are appended by scatters whose non-completing tokens (and padding requests,
        at the scratch slot) write the tables' scratch element; then each request's entry rows."""
        pos, b = step.positions, step.tok_req
        req_rows = step.slots[b].clamp(max=self.num_req_rows - 1)  # padding: scratch slot, completes nothing
        tok_slot = self.req_to_token[req_rows.to(self.req_to_token.device),
                                     pos.to(self.req_to_token.device)].to(self.device)
        table, replaced = {}, {}
        for r, w in write.items():
            table[r], old = file_entries(pos, tok_slot, step.slots[b], step.slots, w, self.entry_of_slot[r],
                                         self.req_entries[r], r, widths[r], not step.is_decode)
            if old is not None:  # a slot written again drops its old entry (``retire``)
                replaced[r] = old
        if self._tables_read is not None:
            self._tables_read.record()  # the step's last read of req_to_token (``end_forward``)
        return StepTables(write, table, replaced)

    def end_forward(self) -> "torch.cuda.Event | None":
        """The model's forward is done with the cache (called once per forward): -> the event
        after its last read of SGLang's ``req_to_token`` and last write of the entry tables, for
        SGLang's ``model_runner.shared_read_done_event``; None where it has none (the CPU) or a
        fork-point snapshot read ``req_to_token`` after the tables (then SGLang fences on the
        whole forward). The scheduler's stream waits on it before its next writes of the shared
        tables, and so do the copies our hooks start there (frees, publishes): under the overlap
        scheduler they then finish early in the forward in flight, not at its end."""
        late, self._late_table_read = self._late_table_read, False
        return None if late else self._tables_read

    def retire(self, replaced: dict[int, Tensor]) -> None:
        """The rows a step's slots held before it wrote them again: pending orphans, freed with
        the next freed slots (their copy goes with that free's). Every step that builds its
        tables hands a tensor per ratio, mostly -1 (nothing replaced); with no free in between
        (one long request, extends on one row) every ``MAX_PENDING_ORPHANS`` tensors start a
        free of their own, copied without a sync like a slot free, so the list stays bounded."""
        self._orphans.extend(replaced.items())
        if len(self._orphans) > MAX_PENDING_ORPHANS:
            orphans, self._orphans = self._orphans, []
            self._start_free(orphans)

    # ---- snapshots -----------------------------------------------------------------------
    def take_snapshot(self, req: RequestState) -> None:
        """Snapshot ``req`` at its current position (copied now, on the model's stream), owned by
        its token slot at position - 1 once that slot's value reaches the host: copied without a
        sync, keyed by ``collect_pending`` (as a publish is). The radix tree places it when it
        holds the request's tokens up to there (``take_row_snapshots``)."""
        if req.num_tokens == 0:
            return
        self._late_table_read = self._tables_read is not None  # reads req_to_token past the tables
        snap = SlotSnapshot(req.num_tokens, self.layout.copy_out(self.slot_state, req.slot))
        self._row_snaps.setdefault(req.slot, []).append(snap)
        slot = self.req_to_token[req.slot, req.num_tokens - 1:req.num_tokens].to(self.device).long()
        self._pending.append(_PendingPublish(*self._start_copy([slot, slot], stack=True), snap=snap))

    def _key_snapshot(self, key: int, snap: SlotSnapshot) -> None:
        """``snap`` owned by token slot ``key``, unless the slot owns one already (then ``snap``
        is released: that one holds the same prefix's state)."""
        if snap.released:
            return
        held = self.snapshots.get(key)
        if held is not None:
            if held is not snap:
                snap.release()
            self.snapshots.move_to_end(key)
            return
        snap.key = key
        self.snapshots[key] = snap
        self.stats["snapshots_taken"] += 1
        self._evict_snapshots()

    def _copy_pending_snapshots(self) -> None:
        """Copy the hooks' snapshots still held (their rows unchanged since: only a forward
        changes a row, and this runs at the start of one, on its stream)."""
        live = {id(s) for s in self.snapshots.values()}
        live |= {id(p.snap) for p in self._pending if isinstance(p, _PendingPublish)}  # keyed when collected
        for snap in self._pending_copies:
            if id(snap) in live:
                snap.slot_state = self.layout.copy_out(self.slot_state, snap.pending_row)
            snap.pending_row = None
        self._pending_copies = []

    def _evict_snapshots(self) -> None:
        """Least recently used first, down to the budget, except what a radix match found since
        the last step's binds (``_matched``: its request restores from it in the next step; a
        later match of the same round collects publishes, whose new snapshots evict)."""
        while len(self.snapshots) * self.snapshot_bytes_each > self.snapshot_budget_bytes:
            victim = next((k for k, v in self.snapshots.items() if id(v) not in self._matched), None)
            if victim is None:
                return  # over budget until the next step's binds have restored what they matched
            self.snapshots.pop(victim).release()
            self.stats["snapshots_evicted"] += 1

    def deepest_snapshot(self, path_slots: Tensor) -> tuple[int, int]:
        """(P, key): the largest P such that path_slots[P-1] owns a snapshot at position P, and
        that slot; (0, -1) if none. For drivers without SGLang's tree (tests, benchmarks; the
        served match walks the tree instead): one host copy of the path, after which the
        publishes and frees before it take effect (their copies are done once it has synced)."""
        if not (self.snapshots or self._pending) or path_slots.numel() == 0:
            return 0, -1
        host = self._to_host(path_slots.long())
        self.collect_pending(wait=True)
        if not self.snapshots:
            return 0, -1
        keys = torch.tensor(list(self.snapshots), dtype=torch.long)
        for i in reversed(torch.nonzero(torch.isin(host, keys)).flatten().tolist()):
            key = int(host[i])
            if self.snapshots[key].num_tokens == i + 1:
                self.matched(self.snapshots[key])
                return i + 1, key
        return 0, -1

    def publish(self, req: RequestState | None, old_slots: Tensor, new_slots: Tensor) -> None:
        """The radix tree published a request's first ``len(old_slots)`` positions, keeping its
        own slots (``new_slots``) where it held them already: a snapshot of ``req`` (if given:
        the request at that position) on its slot there, then the snapshots the request made on
        the slots the tree replaced move to the tree's (where those have none). Takes effect when
        the slots' copy to the host is done (``collect_pending``); the snapshot's state is copied
        at the next forward's start either way."""
        snap = None
        if req is not None and req.num_tokens:
            snap = SlotSnapshot(req.num_tokens, None, pending_row=req.slot)
            self._pending_copies.append(snap)
            self._row_snaps.setdefault(req.slot, []).append(snap)
        elif not self.snapshots and not self._pending:
            return
        self._pending.append(_PendingPublish(*self._start_copy([old_slots.long(), new_slots.long()], stack=True),
                                             snap=snap))

    def _apply_publish(self, pending: _PendingPublish) -> None:
        old, new = pending.host[0], pending.host[1]
        if pending.snap is not None:
            self._key_snapshot(int(old[-1]), pending.snap)
        if self.snapshots:
            moved = old != new
            old, new = old[moved], new[moved]
            has = torch.isin(old, torch.tensor(list(self.snapshots), dtype=torch.long))
            for o, n in zip(old[has].tolist(), new[has].tolist()):
                if n not in self.snapshots:
                    moved_snap = self.snapshots[n] = self.snapshots.pop(o)
                    moved_snap.key = n

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
        """SGLang freed these token slots: their entry rows and snapshots go with them. The
        slots' table entries are cleared on the device at once; the rows they owned (and the
        slots, where snapshots may sit on them) are copied to the host without a sync and
        returned to the pools by ``collect_pending``."""
        if slots.numel() == 0:
            return
        if self._deferred is not None:
            self._deferred.append(slots.clone())
            return
        self._changes += 1
        dev_slots = slots.to(self.device).long()
        freed = [(r, self.entry_of_slot[r][dev_slots]) for r in RATIOS] + self._orphans
        self._orphans = []
        for r in RATIOS:  # index_fill_: ``t[idx] = -1`` would copy the -1 to the device, a host sync
            self.entry_of_slot[r].index_fill_(0, dev_slots, -1)
        # the slots too where a snapshot may sit on one once the frees before it are collected
        self._start_free(freed, dev_slots if self.snapshots or self._pending else None)

    def _start_free(self, freed: list[tuple[int, Tensor]], slots: Tensor | None = None) -> None:
        """Queue a free of (ratio, device entry rows, -1 for none) pairs and, with ``slots``, of
        the snapshots on those slots: one copy to the host without a sync (``_PendingFree``)."""
        parts = [rows.long() for _, rows in freed] + ([slots.long()] if slots is not None else [])
        self._pending.append(_PendingFree(*self._start_copy(parts), counts=[(r, rows.numel()) for r, rows in freed],
                                          num_slots=slots.numel() if slots is not None else 0))

    def _start_copy(self, parts: list[Tensor], stack: bool = False
                    ) -> tuple[Tensor, Tensor | None, "torch.cuda.Event | None"]:
        """``parts`` (int64, on the device) concatenated (or stacked) and copied to the host
        without a sync: -> (host buffer, device source, event after the copy) of an ``_InFlight``."""
        dev = torch.stack(parts) if stack else torch.cat(parts)
        if dev.device.type != "cuda":
            return dev, None, None
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, dev, done

    def collect_pending(self, wait: bool = False) -> None:
        """Let the frees and publishes whose copies are done take effect, oldest first (a free
        returns its rows to the host pools and drops the snapshots on its slots; a publish keys
        and moves snapshots); with ``wait``, all of them (waiting for the copies still running:
        a host sync, counted as ``copy_waits`` when it happens)."""
        while self._pending:
            pending = self._pending[0]
            if not pending.ready():
                if not wait:
                    return
                t0 = time.perf_counter()
                pending.wait()
                self.stats["copy_waits"] += 1
                self.stats["host_read_ms"] += (time.perf_counter() - t0) * 1e3
            self._pending.pop(0)
            if isinstance(pending, _PendingPublish):
                self._apply_publish(pending)
                continue
            for r, rows in pending.rows():
                self.pools[r].free(rows)
            for s in pending.slots().tolist():
                snap = self.snapshots.pop(s, None)
                if snap is not None:
                    snap.release()
                    self.stats["snapshots_dropped"] += 1

    def _pending_frees(self) -> list[_PendingFree]:
        """The uncollected frees, their copies waited for (the integrity check's view)."""
        frees = [p for p in self._pending if isinstance(p, _PendingFree)]
        for pending in frees:
            pending.wait()
        return frees

    def _pending_rows(self, ratio: int) -> Tensor:
        """The ratio-``ratio`` rows of uncollected frees (host int64)."""
        out = [rows for p in self._pending_frees() for r, rows in p.rows() if r == ratio]
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)

    def _pending_slots(self) -> Tensor:
        """The freed slots of uncollected frees that carry them (host int64)."""
        parts = [p.slots() for p in self._pending_frees() if p.num_slots]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def _free_rows(self, freed: list[tuple[int, Tensor]]) -> None:
        """Return (ratio, device rows, -1 for none) and the pending orphans to the host pools now:
        one copy (``_to_host``: a host sync on a GPU, which only a cache flush makes)."""
        freed = freed + self._orphans
        self._orphans = []
        host = self._to_host(torch.cat([rows.long() for _, rows in freed]))
        for r, rows in _PendingFree(host, None, None, counts=[(r, t.numel()) for r, t in freed]).rows():
            self.pools[r].free(rows)

    # ---- accounting ----------------------------------------------------------------------
    def clear_token_state(self) -> None:
        """All token slots were released together (cache flush): drop every entry and snapshot."""
        self.collect_pending(wait=True)
        if self._orphans or any(pool.num_used for pool in self.pools.values()):  # not at start-up
            self._free_rows([(r, t[:-1].clone()) for r, t in self.entry_of_slot.items()])  # not the scratch
        for t in self.entry_of_slot.values():
            t.fill_(-1)
        self.stats["snapshots_dropped"] += len(self.snapshots)
        for snap in self.snapshots.values():
            snap.release()
        self.snapshots.clear()
        self._pending_copies = []
        self._changes += 1  # the next idle check runs (and refreshes the gauges)

    def release_rows(self, rows: list[int]) -> None:
        """SGLang freed these request rows: their rings are no longer in use."""
        self._changes += 1
        for row in rows:
            self.rows.pop(row, None)
            self.pending_forks.pop(row, None)
            self._resume_from.pop(row, None)
            self._row_snaps.pop(row, None)

    def check_integrity(self, live_slots: Tensor | None = None, live_rows: list[int] | None = None) -> None:
        """Raise AssertionError unless the side tables and pools agree (callable at any time,
        without a flush; host syncs: not for the step).

        Always: every entry row in use is owned by exactly one token slot, is a pending orphan or
        is on its way back (an uncollected free), and every owned row is in use; each bound
        request row's entries are rows in use; no resume so far found an entry missing
        (``refresh_entries``). With
        ``live_slots`` (the token slots SGLang holds: tree + running requests): every slot owning
        an entry or a snapshot is live. With ``live_rows`` (SGLang's request rows in use): rings
        are held exactly by those rows.
        """
        for r, pool in self.pools.items():
            table = self.entry_of_slot[r][:-1]
            owners = torch.nonzero(table >= 0).flatten()  # device scan; only owned entries come back
            rows = table[owners].long().cpu()
            owners = owners.cpu()
            orphans = torch.cat([o.long().cpu() for rr, o in self._orphans if rr == r] or [torch.empty(0, dtype=torch.long)])
            rows_all = torch.cat((rows, orphans[orphans >= 0], self._pending_rows(r)))
            if rows_all.unique().numel() != rows_all.numel():
                raise AssertionError(f"ratio {r}: an entry row is owned by two token slots")
            in_use = pool.rows_in_use()
            if not torch.equal(rows_all.sort().values, in_use):
                raise AssertionError(f"ratio {r}: {in_use.numel()} entry rows in use, {rows_all.numel()} owned "
                                     "by token slots (a leak or a row handed out twice)")
            if self.rows:  # one gather for all bound rows (this runs after every step in the fuzz)
                bound = sorted(self.rows)
                listed = self.req_entries[r][torch.tensor(bound, device=self.device)].long().cpu()
                freed = (listed >= 0) & ~pool.in_use(listed.clamp_min(0))
                if bool(freed.any()):
                    row = bound[int(torch.nonzero(freed)[0, 0])]
                    raise AssertionError(f"request row {row}: lists a freed ratio-{r} entry row")
            if live_slots is not None:
                dead = owners[~torch.isin(owners, live_slots.long().cpu())]
                if dead.numel():
                    raise AssertionError(f"ratio {r}: {dead.numel()} entries owned by freed token slots, "
                                         f"e.g. slot {int(dead[0])}")
        if live_slots is not None and self.snapshots:
            keys = torch.tensor(list(self.snapshots), dtype=torch.long)
            keys = keys[~torch.isin(keys, self._pending_slots())]  # dropped when their free is collected
            dead = keys[~torch.isin(keys, live_slots.long().cpu())]
            if dead.numel():
                raise AssertionError(f"{dead.numel()} snapshots on freed token slots, e.g. slot {int(dead[0])}")
        if live_rows is not None and set(self.rows) - set(live_rows):
            raise AssertionError(f"rings held by request rows SGLang freed: {sorted(set(self.rows) - set(live_rows))}")
        missing = int(self._missing_entries)
        if missing:
            raise AssertionError(f"requests resumed with {missing} compressed entries missing (a token slot "
                                 "of a completed group owned none: the radix cache matched past them)")
        used = self.usage()
        parts = sum(p.num_used * p.row_bytes for p in self.pools.values())
        held = sum(self.snapshot_bytes_each if s.slot_state is None
                   else sum(t.numel() * t.element_size() for t in s.slot_state.values())
                   for s in self.snapshots.values())  # a pending copy: the bytes it will take
        if used["compressed_bytes"] != int(parts) or used["snapshot_bytes"] != held:
            raise AssertionError(f"byte gauges {used} disagree with their parts")

    def idle_audit_due(self, immediate: bool = False, now: float | None = None) -> bool:
        """Whether SGLang's idle self-check should run ``check_integrity`` now. The audit scans
        the pools (tens of ms at V4-Flash sizes, more with a large tree) and a request arriving
        meanwhile waits for it, so it waits for a quiet spell: something changed since the last
        audit, nothing for ``IDLE_AUDIT_QUIET_S`` (a client's next turn usually comes sooner),
        and the last audit is ``IDLE_AUDIT_INTERVAL_S`` old. ``immediate`` (SGLang's per-step
        check on, as the fuzz tests run): whenever something changed."""
        if self._changes == self._checked_at:
            return False
        if immediate:
            return True
        now = time.monotonic() if now is None else now
        if self._quiet[0] != self._changes:  # the first idle pass since this change
            self._quiet = (self._changes, now)
        return now - self._quiet[1] >= IDLE_AUDIT_QUIET_S and now - self._last_audit >= IDLE_AUDIT_INTERVAL_S

    def refresh_metrics(self) -> None:
        """Bring the metrics' counters and gauges up to date (cheap: no scan), once per change
        and once per audit: an audit changes no state but is counted (``integrity_checks``),
        and the idle pass that found it not yet due has already refreshed for this change."""
        seen = (self._changes, self.stats["integrity_checks"])
        if self.metrics is not None and self._metrics_at != seen:
            self._metrics_at = seen
            self.metrics.update()

    def run_integrity_check(self, live_slots: Tensor | None = None, live_rows: list[int] | None = None,
                            strict: bool | None = None) -> bool:
        """``check_integrity`` as SGLang's self-checks run it: counted (``integrity_checks``,
        ``integrity_failures``), a failure logged and raised if ``strict``; ``strict=None`` (the
        idle check): raised only under SGLang's strict idle memory check
        (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``), as its own leak checks do. Skipped when
        nothing changed since the last check (SGLang checks every idle iteration)."""
        if self._changes == self._checked_at:
            return True
        self.collect_pending(wait=True)  # the audit syncs anyway: the gauges then show the frees
        self._checked_at = self._changes
        self._last_audit = time.monotonic()
        self.stats["integrity_checks"] += 1
        ok = True
        try:
            self.check_integrity(live_slots, live_rows)
        except AssertionError as e:
            ok = False
            self.stats["integrity_failures"] += 1
            logger.error("sglang_dsv4 cache integrity check failed: %s", e)
            if strict is None:
                from sglang.srt.environ import envs  # SGLang's own switch for its idle leak checks

                strict = bool(envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.get())
            if strict:
                raise
        self.refresh_metrics()
        return ok

    def usage(self) -> dict[str, int]:
        """Entries, rings and snapshots held right now (for metrics and leak checks), after the
        frees whose copies are done (``collect_pending``, no wait)."""
        self.collect_pending()
        entries = {r: p.num_used for r, p in self.pools.items()}
        return {"c4_entries": entries[4], "c128_entries": entries[128],
                "compressed_bytes": int(sum(p.num_used * p.row_bytes for p in self.pools.values())),
                "rings_in_use": len(self.rows),
                "snapshots": len(self.snapshots),
                "snapshot_bytes": len(self.snapshots) * self.snapshot_bytes_each}

