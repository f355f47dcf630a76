"""CUDA graphs of the decode step: one graph per (batch bucket, entry-table widths).

A decode step's kernels depend only on its shapes: the batch (padded up to a bucket with
requests of the scratch slot, which write only scratch rows), the entry-table widths (power-of-two
buckets, ``step.entry_width``) and the storage it reads. So the step is captured once per such
key and replayed with the step's index tensors copied into the graph's static inputs. Host work
(``build_step``, ``step_tables``) stays outside the graph. A graph is dropped when a pool it reads
was reallocated (pools grow by whole pages, rarely).

Capture runs a warm-up step on an all-scratch input first (so no request's state moves twice).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .step import C128_FIELDS, C128Segments, StepBatch, StepTables

if TYPE_CHECKING:
    from .model import V4Model
    from .step import V4CacheView

logger = logging.getLogger(__name__)
Tensor = torch.Tensor
DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
_STEP_TENSORS = ("ids", "positions", "tok_req", "row0", "slots", "starts", "ends")


def decode_padded(step: StepBatch, batch: int, scratch_rows: dict[int, int]) -> StepBatch:
    """A decode ``step`` with requests of the scratch slot (position 0, completing nothing) up to
    ``batch`` requests; its tables padded with scratch rows and empty entry lists."""
    pad = batch - step.num_reqs
    if pad <= 0:
        return step
    dev, B = step.ids.device, step.num_reqs
    extra = torch.arange(B, batch, device=dev)
    zeros = torch.zeros(pad, dtype=torch.long, device=dev)

    def cat(x: Tensor, tail: Tensor) -> Tensor:
        return torch.cat((x, tail.to(x.dtype)))

    seg = step.c128
    if seg is not None:
        seg = C128Segments(tok=cat(seg.tok, extra[:, None]), carry=cat(seg.carry, zeros.bool()),
                           store_slot=cat(seg.store_slot, zeros + step.scratch_slot),
                           completes=cat(seg.completes, zeros.bool()), last_tok=cat(seg.last_tok, extra),
                           first_pos=cat(seg.first_pos, zeros), width=seg.width)
    tables = StepTables(
        {r: cat(w, zeros + scratch_rows[r]) for r, w in step.tables.write_rows.items()},
        {r: cat(t, torch.full((pad, t.shape[1]), -1, dtype=t.dtype, device=dev)) for r, t in
         step.tables.entry_rows.items()})
    return StepBatch(ids=cat(step.ids, zeros), positions=cat(step.positions, zeros), tok_req=cat(step.tok_req, extra),
                     row0=cat(step.row0, extra), slots=cat(step.slots, zeros + step.scratch_slot),
                     starts=cat(step.starts, zeros), ends=cat(step.ends, zeros + 1), scratch_slot=step.scratch_slot,
                     starts_host=step.starts_host + [0] * pad, lens_host=step.lens_host + [1] * pad,
                     positions_host=torch.cat((step.positions_host, torch.zeros(pad, dtype=torch.long))),
                     c128=seg, tables=tables, num_real=B)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: StepBatch   # static input tensors the replay reads
    out: Tensor         # static output: final residual streams [batch, hc, D]

    def load(self, step: StepBatch) -> None:
        for name in _STEP_TENSORS:
            getattr(self.inputs, name).copy_(getattr(step, name))
        if step.c128 is not None:
            for name in C128_FIELDS:
                getattr(self.inputs.c128, name).copy_(getattr(step.c128, name))
        for r, w in step.tables.write_rows.items():
            self.inputs.tables.write_rows[r].copy_(w)
            self.inputs.tables.entry_rows[r].copy_(step.tables.entry_rows[r])


class DecodeGraphs:
    """The captured decode steps of one model over one cache (see module docstring)."""

    def __init__(self, model: V4Model, max_batch: int = 256, buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        self.model, self.max_batch = model, max_batch
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (max_batch,)
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: list[tuple[int, tuple[int, ...]]] = []

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, cache: V4CacheView, step: StepBatch) -> Tensor | None:
        """The final streams of a decode ``step`` [B, hc, D] by graph replay, or None when the
        step has no bucket (larger than ``max_batch``): the caller runs it eagerly."""
        b = self.bucket(step.num_reqs)
        if b is None:
            return None
        rows = {r: p.scratch_row for r, p in cache.pools.items()}
        padded = decode_padded(step, b, rows)
        widths = tuple(padded.tables.entry_rows[r].shape[1] for r in sorted(rows))
        storage = tuple(t.data_ptr() for p in cache.pools.values() for t in p.tensors.values())
        key = (b, widths, storage, id(cache))
        g = self.graphs.get(key)
        if g is None:
            self._drop_stale(b, widths, id(cache))
            g = self.graphs[key] = self._capture(cache, padded, rows)
            self.captured.append((b, widths))
            logger.info("sglang_dsv4: captured the decode step for batch %d (entry widths %s)", b, widths)
        g.load(padded)
        g.graph.replay()
        return g.out[:step.num_reqs]

    def _drop_stale(self, b: int, widths: tuple[int, ...], cache_id: int) -> None:
        for k in [k for k in self.graphs if k[0] == b and k[1] == widths and k[3] == cache_id]:
            del self.graphs[k]  # its pools were reallocated

    def _capture(self, cache: V4CacheView, like: StepBatch, scratch_rows: dict[int, int]) -> _Graph:
        static = _scratch_copy(like, scratch_rows)
        model = self.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on scratch rows only (kernel set-up, autotuning)
            model.forward_step(cache, static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = model.forward_step(cache, static)
        return _Graph(graph, static, out)


def _scratch_copy(like: StepBatch, scratch_rows: dict[int, int]) -> StepBatch:
    """Static input tensors of ``like``'s shapes, holding an all-scratch step."""
    B, dev = like.num_reqs, like.ids.device
    ar = torch.arange(B, device=dev)
    zeros = torch.zeros(B, dtype=torch.long, device=dev)
    seg = like.c128
    if seg is not None:
        seg = C128Segments(tok=ar[:, None].clone(), carry=zeros.bool(), store_slot=zeros + like.scratch_slot,
                           completes=zeros.bool(), last_tok=ar.clone(), first_pos=zeros.clone(), width=seg.width)
    tables = StepTables({r: zeros + scratch_rows[r] for r in like.tables.write_rows},
                        {r: torch.full_like(t, -1) for r, t in like.tables.entry_rows.items()})
    return StepBatch(ids=zeros.clone(), positions=zeros.clone(), tok_req=ar.clone(), row0=ar.clone(),
                     slots=zeros + like.scratch_slot, starts=zeros.clone(), ends=zeros + 1,
                     scratch_slot=like.scratch_slot, starts_host=list(like.starts_host),
                     lens_host=list(like.lens_host), positions_host=like.positions_host.clone(), c128=seg,
                     tables=tables, num_real=like.num_real)
