"""CUDA graphs of the decode step: one graph per (batch bucket, entry-table widths).

A decode step's kernels depend only on its shapes: the batch (padded up to a bucket with
requests of the scratch slot, which write only scratch rows), the entry-table widths (power-of-two
buckets, ``step.entry_width``) and the storage it reads. So the step is captured once per such
key, from the cache's device-side table work (``V4CacheView.apply_tables``) through the final
norm, and replayed after one host-to-device copy of its inputs.

The host side of a replay is small and flat in the model's depth: the cache's host bookkeeping
(``plan_tables``: entry rows by count), one list of integers per step (positions, slots, ratio-128
segment flags, write rows; padded to the bucket on the host) staged into the graph's input buffer,
the token ids copied beside it, and the replay. Nothing is rebuilt on the device per step. A
graph is dropped when a pool it reads was reallocated (pools grow by whole pages, rarely).

Capture runs a warm-up step on an all-scratch input first (so no request's state moves twice).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import numpy as np
import torch

from .step import (C128, C128Segments, StepBatch, TablePlan, TokenIds, completing_tokens, flat_tokens,
                   token_lens)

if TYPE_CHECKING:
    from .cache import RequestState
    from .model import V4Model
    from .step import V4CacheView

logger = logging.getLogger(__name__)
Tensor = torch.Tensor
_T = TypeVar("_T")
DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# per-request int64 fields of the graph's input buffer, in order (then write rows, entry tables)
_FIELDS = ("positions", "slots", "ends", "carry", "store_slot", "completes", "first_pos")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: Tensor            # [batch] static token ids
    inputs: Tensor         # [n] static int64 inputs (``_FIELDS``, write rows, entry tables)
    streams: Tensor        # [batch, hc, D] final residual streams
    hidden: Tensor         # [batch, D] normed final hidden states (the head's input)


class CapturedSteps:
    """Captured step graphs by cache and shape, in one private memory pool (the decode and the
    extend graphs). Per cache object, weakly: a cache's graphs go with it, and a later cache that
    Python gives the same id() (and the allocator the same addresses) never replays them."""

    def __init__(self):
        self.graphs: weakref.WeakKeyDictionary[V4CacheView, dict[tuple, object]] = weakref.WeakKeyDictionary()
        self.pool = None  # from the first capture on

    def graph_for(self, cache: V4CacheView, shape: tuple, capture_new: Callable[[], _T]) -> tuple[_T, bool]:
        """The graph of ``shape`` over ``cache``'s storage as it is now -> (graph, whether it was
        captured now: ``capture_new()``, into ``self.pool``)."""
        key = (shape, _storage(cache))
        graphs = self.graphs.setdefault(cache, {})
        g = graphs.get(key)
        if g is not None:
            return g, False
        for k in [k for k in graphs if k[0] == shape]:
            del graphs[k]  # its pools were reallocated
        if self.pool is None or not any(self.graphs.values()):
            # The private memory pool lives while a graph captured into it does: once every
            # graph is gone (their caches with them), capturing into the dead pool's handle
            # trips the allocator (an internal assert in capture_begin); a new handle, a new pool.
            self.pool = torch.cuda.graph_pool_handle()
        g = graphs[key] = capture_new()
        return g, True


class DecodeGraphs(CapturedSteps):
    """The captured decode steps of one model over one cache (see module docstring)."""

    def __init__(self, model: V4Model, max_batch: int = 256, buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        super().__init__()
        self.model, self.max_batch = model, max_batch
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (max_batch,)
        self.captured: list[tuple[int, tuple[int, ...]]] = []
        self._aranges: dict[int, Tensor] = {}

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds
            ) -> tuple[Tensor, Tensor] | None:
        """(final streams [b, hc, D], normed hidden [b, D]) of a decode step of ``reqs`` (one new
        token each) by graph replay, for the whole bucket b >= B (rows B.. are padding); None
        when the step is no decode step or has no bucket."""
        B = len(reqs)
        b = self.bucket(B)
        if b is None or token_lens(ids) != [1] * B:
            return None
        starts = [r.num_tokens for r in reqs]
        positions = torch.tensor(starts)
        plan = cache.plan_tables(reqs, starts, [1] * B, positions)
        ratios = sorted(plan.widths)
        widths = tuple(plan.widths[r] for r in ratios)
        g, new = self.graph_for(cache, (b, widths), lambda: self._capture(cache, b, plan.widths, cache.host_entries))
        if new:
            self.captured.append((b, widths))
            logger.info("sglang_dsv4: captured the decode step for batch %d (entry widths %s)", b, widths)
        host = decode_inputs(cache, reqs, positions, plan, b)
        g.inputs.copy_(host.pin_memory(), non_blocking=True)
        g.ids[:B].copy_(flat_tokens(ids).to(g.ids.device, non_blocking=True))
        g.graph.replay()
        return g.streams, g.hidden

    def precapture(self, cache: V4CacheView, max_end: int) -> list[tuple[int, tuple[int, ...]]]:
        """Capture now what ``run`` would capture on first use for steps whose longest request
        ends at up to ``max_end`` tokens: every batch bucket at each of their entry-table widths
        (largest batch first, as SGLang captures, so the pool is sized once). The compiles and
        captures then happen at start-up, not on the first requests of each shape.
        -> the (bucket, widths) captured now."""
        new = []
        for widths in width_classes(cache, max_end):
            key = tuple(widths[r] for r in sorted(widths))
            t0, before = time.perf_counter(), len(new)
            for b in reversed(self.buckets):
                _, captured = self.graph_for(cache, (b, key), lambda: self._capture(cache, b, widths, cache.host_entries))
                if captured:
                    self.captured.append((b, key))
                    new.append((b, key))
            # one line per width class: a start-up that outlasts its caller's wait says how far it got
            logger.info("sglang_dsv4: start-up capture: %d decode graphs at entry widths %s in %.1f s",
                        len(new) - before, widths, time.perf_counter() - t0)
        return new

    def _arange(self, b: int, device: torch.device) -> Tensor:
        if b not in self._aranges:
            self._aranges[b] = torch.arange(b, device=device)
        return self._aranges[b]

    def _capture(self, cache: V4CacheView, b: int, widths: dict[int, int], host_entries: bool) -> _Graph:
        model, dev = self.model, self.model.device
        ratios = sorted(widths)
        n = len(_FIELDS) * b + len(ratios) * b + (sum(b * widths[r] for r in ratios) if host_entries else 0)
        scratch = cache.layout.scratch_slot(cache.slot_state)
        inputs = torch.zeros(n, dtype=torch.long, device=dev)
        ids = torch.zeros(b, dtype=torch.long, device=dev)
        f, write, entries = input_views(inputs, b, widths, host_entries)
        # an all-scratch step: scratch slots, ends 1, scratch write rows, empty entry tables
        f["slots"].fill_(scratch)
        f["store_slot"].fill_(scratch)
        f["ends"].fill_(1)
        for r in ratios:
            write[r].fill_(cache.pools[r].scratch_row)
            if host_entries:
                entries[r].fill_(-1)
        ar = self._arange(b, dev)
        with_c128 = bool(model.cfg.c128_layers)

        def body() -> tuple[Tensor, Tensor]:  # everything from the input buffer on is captured
            step = decode_step(f, ids, ar, scratch, with_c128)
            step.tables = cache.apply_tables(step, write, entries, widths)
            # a decode token's slot is new: nothing replaced, so nothing to retire after a replay
            assert not step.tables.replaced
            h = model.forward_step(cache, step)
            return h, model.head_input(h)

        graph, (streams, hidden) = capture(body, self.pool)
        return _Graph(graph, ids, inputs, streams, hidden)


def width_classes(cache: V4CacheView, max_end: int) -> list[dict[int, int]]:
    """The distinct entry-table widths (``cache.table_widths``) of steps whose longest request
    ends at 1 to ``max_end`` tokens, narrowest first. Widths are powers of two of ``end // r``,
    so the ends 2^k (and ``max_end``) meet every one of them."""
    out: list[dict[int, int]] = []
    end = 1
    while True:
        widths = cache.table_widths(min(end, max_end))
        if widths not in out:
            out.append(widths)
        if end >= max_end:
            return out
        end *= 2


def capture(body: Callable[[], _T], pool) -> tuple[torch.cuda.CUDAGraph, _T]:
    """``body`` run once on a side stream (kernel set-up, compilation: its inputs must touch
    scratch state only), then captured into a graph in ``pool`` -> (the graph, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


def _storage(cache: V4CacheView) -> tuple[int, ...]:
    """The addresses of the cache's reallocatable tensors a captured step reads: its pools'
    (which grow by whole pages) and the request-to-token table (which SGLang or a harness sets)."""
    ptrs = [t.data_ptr() for p in cache.pools.values() for t in p.tensors.values()]
    req_to_token = getattr(cache, "req_to_token", None)
    return tuple(ptrs + ([req_to_token.data_ptr()] if req_to_token is not None else []))


def decode_inputs(cache: V4CacheView, reqs: Sequence[RequestState], starts: Sequence[int] | Tensor,
                  plan: TablePlan, b: int) -> Tensor:
    """A decode step's int64 graph inputs on the host, in ``input_views``' order, padded to ``b``
    requests (the scratch slot at position 0, writing scratch rows, empty entry tables).

    The rows of one [fields, b] numpy table, each filled by one array operation: the host cost
    is a few microseconds whatever the batch (a Python operation per request and field, or a
    torch operation per field, costs more at every size; the step's host time is on the server's
    critical path)."""
    B = len(reqs)
    scratch = cache.layout.scratch_slot(cache.slot_state)
    ratios = sorted(plan.widths)
    nf = len(_FIELDS)
    table = np.empty((nf + len(ratios), b), dtype=np.int64)
    # the padding requests (``_capture``'s all-scratch step)
    table[:, B:] = np.array([0, scratch, 1, 0, scratch, 0, 0] + [cache.pools[r].scratch_row for r in ratios],
                            dtype=np.int64)[:, None]
    p = starts.numpy() if isinstance(starts, Tensor) else np.asarray(starts, dtype=np.int64)
    slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=B)
    in_group = p % C128
    table[0, :B] = p                        # positions
    table[1, :B] = slots                    # slots
    table[2, :B] = p + 1                    # ends
    table[3, :B] = in_group != 0            # carry: the ratio-128 group started before
    table[4, :B] = slots                    # store_slot
    table[5, :B] = completing_tokens(p, C128)  # completes its ratio-128 group
    table[6, :B] = p - in_group             # first_pos of the group
    for i, r in enumerate(ratios):
        table[nf + i, :B] = plan.write[r].numpy()
    host = torch.from_numpy(table.reshape(-1))
    if plan.entries is not None:  # host-built entry tables (the reference cache)
        tabs = [torch.nn.functional.pad(plan.entries[r], (0, 0, 0, b - B), value=-1).flatten() for r in ratios]
        host = torch.cat([host] + tabs)
    return host


def input_views(inputs: Tensor, b: int, widths: dict[int, int], host_entries: bool):
    """Views of a graph's input buffer -> (per-request fields, write rows, entry tables or None)."""
    f = dict(zip(_FIELDS, inputs[:len(_FIELDS) * b].view(len(_FIELDS), b)))
    off = len(_FIELDS) * b
    ratios = sorted(widths)
    write = {}
    for r in ratios:
        write[r] = inputs[off:off + b]
        off += b
    entries = None
    if host_entries:
        entries = {}
        for r in ratios:
            entries[r] = inputs[off:off + b * widths[r]].view(b, widths[r])
            off += b * widths[r]
    return f, write, entries


def decode_step(f: dict[str, Tensor], ids: Tensor, ar: Tensor, scratch: int, with_c128: bool) -> StepBatch:
    """The decode StepBatch over the input views ``f`` (one token per request: ``ar`` = arange)."""
    b = ar.numel()
    seg = None
    if with_c128:  # one segment per request: its own token
        seg = C128Segments(tok=ar[:, None], carry=f["carry"] != 0, store_slot=f["store_slot"],
                           completes=f["completes"] != 0, last_tok=ar, first_pos=f["first_pos"], width=1)
    return StepBatch(ids=ids, positions=f["positions"], tok_req=ar, row0=ar, slots=f["slots"],
                     starts=f["positions"], ends=f["ends"], scratch_slot=scratch, starts_host=[0] * b,
                     lens_host=[1] * b, positions_host=torch.zeros(b, dtype=torch.long), c128=seg)
