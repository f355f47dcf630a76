"""CUDA graphs of short extends: a few requests' few new tokens (a cache hit's tail, a follow-up
turn, a short prompt), padded to a token bucket and replayed.

A cache hit of 32 tokens on flash8 (8 layers, fp8) spends 6-7 ms in ~1400 kernels of a ~75 ms
forward (session 20, in-process and in the server): the eager extend is host-bound. Its kernels
depend only on shapes once it is laid out like this: T tokens (the B requests' n plus a padding
request of T - n >= 1 at position 0 in the scratch slot, as ``step.pad_step`` pads), B + 1
requests, ``G`` ratio-128 segments of ``W`` positions (the requests' own, then empty ones that
store their state to the scratch slot and complete nothing) and the entry-table widths. So the
step from the cache's device-side table work through the final norm is captured once per (T, B,
widths) and replayed after one host-to-device copy of its inputs, as ``core.graphs`` does for
decode steps.

The host side of a replay: ``plan_tables`` (entry rows for the groups the tokens complete), one
int64 vector of the step's fields (``extend_inputs``) and the token ids before it; after it, the
entry rows the step's tables replaced (a token slot written again) handed to ``cache.retire``:
host bookkeeping that ``apply_tables`` cannot do inside a graph. The same body runs
without capture on any device (``ExtendGraphs.run_uncaptured``): the CPU tests hold it to the
eager step, bit for bit. Not taken: extends of more than ``MAX_REQUESTS`` requests or 1023
tokens (they stay eager), the deterministic mode (its pieces have their own fixed shape),
data-parallel attention (a host exchange starts each step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from .graphs import CapturedSteps, capture, width_classes
from .step import (C128, CPU_TOKEN_TILE, C128Segments, StepBatch, TablePlan, TokenIds, _c128_segments,
                   flat_tokens, token_lens)

if TYPE_CHECKING:
    from .cache import RequestState
    from .model import V4Model
    from .step import V4CacheView

logger = logging.getLogger(__name__)
Tensor = torch.Tensor
# token counts (the requests' tokens + at least one padding token): up to a hit's tail and short
# prompts (a 512-token prompt takes the 1024 bucket); longer extends are GPU-bound enough eagerly
EXTEND_BUCKETS = (32, 64, 128, 256, 512, 1024)
MAX_REQUESTS = 8  # requests of one extend a graph takes (SGLang batches prefills that arrive together)
# per-token int64 fields of the input buffer, in order; then the write rows per ratio [T] each,
# the per-request fields [B + 1] each, the ratio-128 segments, and host-built entry tables if any
_TOKEN_FIELDS = ("positions", "tok_req")
_REQ_FIELDS = ("row0", "slots", "starts", "ends")
_SEG_FIELDS = ("carry", "store_slot", "completes", "last_tok", "first_pos")


@dataclass(frozen=True)
class ExtendShape:
    """The fixed shape of a captured extend: T tokens of B requests (and a padding request), G
    ratio-128 segments of W positions, and the entry tables' widths per ratio."""

    tokens: int
    requests: int
    segments: int
    seg_width: int
    widths: tuple[tuple[int, int], ...]  # (ratio, width), ratios ascending
    host_entries: bool                   # the reference cache builds entry tables on the host

    def size(self) -> int:
        T, B, G, R = self.tokens, self.requests + 1, self.segments, len(self.widths)
        n = len(_TOKEN_FIELDS) * T + R * T + len(_REQ_FIELDS) * B + G * self.seg_width + len(_SEG_FIELDS) * G
        return n + (sum(B * w for _, w in self.widths) if self.host_entries else 0)


def extend_shape(tokens: int, requests: int, widths: dict[int, int], host_entries: bool,
                 device: torch.device) -> ExtendShape:
    """The shape of an extend of ``requests`` requests padded to ``tokens``: segments enough for
    any split of fewer than ``tokens`` new tokens starting anywhere (in each request a group
    boundary at most every 128 positions, one segment more for its start), padded as
    ``step.build_step`` pads them on the CPU (see ``CPU_TOKEN_TILE``)."""
    segments = (tokens - 2) // C128 + 2 * requests
    if device.type == "cpu":
        segments = -(-segments // CPU_TOKEN_TILE) * CPU_TOKEN_TILE
    return ExtendShape(tokens, requests, segments, min(C128, tokens), tuple(sorted(widths.items())), host_entries)


def extend_inputs(shape: ExtendShape, slots: Sequence[int], starts: Sequence[int], lens: Sequence[int],
                  plan: TablePlan, scratch_slot: int, scratch_rows: dict[int, int]) -> Tensor:
    """An extend's int64 inputs on the host, in ``input_views``' order: request i (slot
    ``slots[i]``) brings ``lens[i]`` tokens from position ``starts[i]``; a padding request (the
    scratch slot, every token at position 0, completing nothing) fills the shape's tokens; the
    ratio-128 segments are the requests', then empty ones (no rows; state to the scratch slot)."""
    T, B, G, W = shape.tokens, shape.requests, shape.segments, shape.seg_width
    st, ln = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
    n = int(ln.sum())
    if len(st) != B or (ln < 1).any() or not n < T:
        raise ValueError(f"extend of {list(lens)} tokens in a shape of {B} requests and {T} tokens")
    row0 = np.cumsum(ln) - ln
    tok_req = np.full(T, B, dtype=np.int64)
    tok_req[:n] = np.repeat(np.arange(B), ln)
    positions = np.zeros(T, dtype=np.int64)
    positions[:n] = st[tok_req[:n]] + np.arange(n) - row0[tok_req[:n]]
    parts = [positions, tok_req]
    for r, _ in shape.widths:
        w = np.full(T, scratch_rows[r], dtype=np.int64)
        w[:n] = plan.write[r].numpy()
        parts.append(w)
    parts += [np.append(row0, n), np.append(np.asarray(slots, dtype=np.int64), scratch_slot), np.append(st, 0),
              np.append(st + ln, T - n)]
    seg = _c128_segments(torch.from_numpy(st), torch.from_numpy(ln), torch.from_numpy(row0),
                         torch.tensor(list(slots), dtype=torch.long), scratch_slot)
    g, w = seg.tok.shape
    if g > G or w > W:
        raise ValueError(f"{g} ratio-128 segments of {w} positions exceed the shape's {G} x {W}")
    tok = np.full((G, W), -1, dtype=np.int64)
    tok[:g, :w] = seg.tok.numpy()
    parts.append(tok.reshape(-1))
    empty = {"carry": 0, "store_slot": scratch_slot, "completes": 0, "last_tok": 0, "first_pos": 0}
    for f in _SEG_FIELDS:
        col = np.full(G, empty[f], dtype=np.int64)
        col[:g] = getattr(seg, f).long().numpy()
        parts.append(col)
    if shape.host_entries:  # the reference cache: its tables, and -1 for the padding request
        for r, width in shape.widths:
            tab = np.full((B + 1, width), -1, dtype=np.int64)
            tab[:B] = plan.entries[r].numpy()
            parts.append(tab.reshape(-1))
    out = torch.from_numpy(np.concatenate(parts))
    assert out.numel() == shape.size()
    return out


def input_views(inputs: Tensor, shape: ExtendShape):
    """Views of an extend's input buffer -> (fields by name, write rows, entry tables or None)."""
    T, B, G, W = shape.tokens, shape.requests + 1, shape.segments, shape.seg_width
    f, off = {}, 0

    def take(n: int) -> Tensor:
        nonlocal off
        off += n
        return inputs[off - n:off]

    for name in _TOKEN_FIELDS:
        f[name] = take(T)
    write = {r: take(T) for r, _ in shape.widths}
    for name in _REQ_FIELDS:
        f[name] = take(B)
    f["seg_tok"] = take(G * W).view(G, W)
    for name in _SEG_FIELDS:
        f[f"seg_{name}"] = take(G)
    entries = {r: take(B * w).view(B, w) for r, w in shape.widths} if shape.host_entries else None
    return f, write, entries


def extend_step(f: dict[str, Tensor], ids: Tensor, shape: ExtendShape, scratch_slot: int,
                with_c128: bool) -> StepBatch:
    """The StepBatch over ``input_views``' fields. Its host lists only carry what the step's
    shapes read (B + 1 requests, not a decode step: ``lens_host`` holds placeholders, the token
    grid is the shape's width); the real lengths are values in the device fields."""
    T, B = shape.tokens, shape.requests
    seg = None
    if with_c128:
        seg = C128Segments(tok=f["seg_tok"], carry=f["seg_carry"] != 0, store_slot=f["seg_store_slot"],
                           completes=f["seg_completes"] != 0, last_tok=f["seg_last_tok"],
                           first_pos=f["seg_first_pos"], width=shape.seg_width)
    return StepBatch(ids=ids, positions=f["positions"], tok_req=f["tok_req"], row0=f["row0"], slots=f["slots"],
                     starts=f["starts"], ends=f["ends"], scratch_slot=scratch_slot, starts_host=[0] * (B + 1),
                     lens_host=[T - B] + [1] * B, positions_host=torch.zeros(T, dtype=torch.long), c128=seg,
                     num_real=B, grid_len=T)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: Tensor       # [T] static token ids
    inputs: Tensor    # static int64 inputs (``input_views``)
    streams: Tensor   # [T, hc, D] final residual streams
    hidden: Tensor    # [T, D] normed final hidden states
    replaced: dict[int, Tensor]  # per ratio [T]: the entry rows the step's tables replaced (-1 none)


class ExtendGraphs(CapturedSteps):
    """The captured short extends of one model over one cache (see module docstring)."""

    def __init__(self, model: V4Model, buckets: tuple[int, ...] = EXTEND_BUCKETS, max_requests: int = MAX_REQUESTS):
        super().__init__()
        self.model, self.buckets, self.max_requests = model, tuple(sorted(buckets)), max_requests
        self.captured: list[ExtendShape] = []

    def bucket(self, n: int) -> int | None:
        """The token bucket of an extend of ``n`` tokens (room for at least one padding token)."""
        return next((b for b in self.buckets if b > n), None)

    def takes(self, reqs: Sequence[RequestState], ids: TokenIds) -> bool:
        """Whether ``run`` takes this step: up to ``max_requests`` requests, not all with one token
        (a decode step: its own graphs), within the largest bucket."""
        if not 1 <= len(reqs) <= self.max_requests:
            return False
        lens = token_lens(ids)
        return max(lens) >= 2 and min(lens) >= 1 and self.bucket(sum(lens)) is not None

    def _prepare(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds
                 ) -> tuple[ExtendShape, Tensor, int]:
        lens = token_lens(ids)
        starts = [r.num_tokens for r in reqs]
        positions = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]))
        plan = cache.plan_tables(reqs, starts, lens, positions)
        shape = extend_shape(self.bucket(sum(lens)), len(reqs), plan.widths, cache.host_entries, self.model.device)
        host = extend_inputs(shape, [r.slot for r in reqs], starts, lens, plan,
                             cache.layout.scratch_slot(cache.slot_state),
                             {r: p.scratch_row for r, p in cache.pools.items()})
        return shape, host, sum(lens)

    def _body(self, cache: V4CacheView, shape: ExtendShape, inputs: Tensor, ids: Tensor
              ) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        """The step from the input buffer on: what a graph holds. -> (streams, hidden, the entry
        rows the tables replaced: ``retire``'d after each run, host work a replay does not redo)."""
        model = self.model
        f, write, entries = input_views(inputs, shape)
        step = extend_step(f, ids, shape, cache.layout.scratch_slot(cache.slot_state), bool(model.cfg.c128_layers))
        step.tables = cache.apply_tables(step, write, entries, dict(shape.widths))
        h = model.forward_step(cache, step)
        return h, model.head_input(h), step.tables.replaced

    def run_uncaptured(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds
                       ) -> tuple[Tensor, Tensor]:
        """``run``'s step, laid out as a graph holds it, run directly (any device): -> (streams,
        hidden) of all T rows (the requests' n first, in order)."""
        shape, host, n = self._prepare(cache, reqs, ids)
        dev = self.model.device
        padded = torch.zeros(shape.tokens, dtype=torch.long, device=dev)
        padded[:n] = flat_tokens(ids).to(dev)
        streams, hidden, replaced = self._body(cache, shape, host.to(dev), padded)
        cache.retire({r: t.clone() for r, t in replaced.items()})  # as ``run`` hands them over
        return streams, hidden

    def run(self, cache: V4CacheView, reqs: Sequence[RequestState], ids: TokenIds) -> tuple[Tensor, Tensor] | None:
        """(streams [T, hc, D], hidden [T, D]) of the extend by graph replay (the requests' n rows
        first, in order; the rest padding), or None when ``takes`` declines the step."""
        if not self.takes(reqs, ids):
            return None
        shape, host, n = self._prepare(cache, reqs, ids)
        g, new = self.graph_for(cache, shape, lambda: self._capture(cache, shape))
        if new:
            self.captured.append(shape)
            logger.info("sglang_dsv4: captured the extend step for %d request(s), %d tokens (entry widths %s)",
                        shape.requests, shape.tokens, dict(shape.widths))
        g.inputs.copy_(host.pin_memory(), non_blocking=True)
        g.ids[:n].copy_(flat_tokens(ids).to(g.ids.device, non_blocking=True))
        g.ids[n:].zero_()  # the padding request's tokens: the same whatever the request before
        g.graph.replay()
        cache.retire({r: t.clone() for r, t in g.replaced.items()})  # the next replay overwrites them
        return g.streams, g.hidden

    def precapture(self, cache: V4CacheView, max_end: int, requests: Sequence[int] = (1,)) -> list[ExtendShape]:
        """Capture now what ``run`` would capture on first use for extends of ``requests``
        requests ending at up to ``max_end`` tokens: every token bucket (largest first) at each
        of their entry-table widths. -> the shapes captured now."""
        new = []
        for widths in width_classes(cache, max_end):
            t0, before = time.perf_counter(), len(new)
            for B in requests:
                for T in reversed(self.buckets):
                    if T < B + 1 or B > self.max_requests:
                        continue  # no room for B requests' tokens and the padding request's
                    shape = extend_shape(T, B, widths, cache.host_entries, self.model.device)
                    _, captured = self.graph_for(cache, shape, lambda: self._capture(cache, shape))
                    if captured:
                        self.captured.append(shape)
                        new.append(shape)
            logger.info("sglang_dsv4: start-up capture: %d extend graphs at entry widths %s in %.1f s",
                        len(new) - before, widths, time.perf_counter() - t0)
        return new

    def _capture(self, cache: V4CacheView, shape: ExtendShape) -> _Graph:
        dev = self.model.device
        scratch = cache.layout.scratch_slot(cache.slot_state)
        # an all-padding step for the warm-up and the capture: every request the scratch slot's,
        # one token each at position 0, scratch write rows, empty segments and entry tables
        B = shape.requests
        plan = TablePlan({r: torch.full((B,), cache.pools[r].scratch_row, dtype=torch.long) for r, _ in shape.widths},
                         None, dict(shape.widths))
        if shape.host_entries:
            plan.entries = {r: torch.full((B, w), -1, dtype=torch.long) for r, w in shape.widths}
        host = extend_inputs(shape, [scratch] * B, [0] * B, [1] * B, plan, scratch,
                             {r: p.scratch_row for r, p in cache.pools.items()})
        inputs = host.to(dev)
        ids = torch.zeros(shape.tokens, dtype=torch.long, device=dev)
        graph, (streams, hidden, replaced) = capture(lambda: self._body(cache, shape, inputs, ids), self.pool)
        return _Graph(graph, ids, inputs, streams, hidden, replaced)
