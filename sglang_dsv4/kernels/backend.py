"""The attention-backend seam of the core: storage layouts + the sparse attention over them.

``V4Model`` keeps all cache logic (compressor state, indexer top-k, which entries each query may
see) and hands each layer's attention to the cache's backend as an ``AttnBatch``: the queries,
the new tokens' window rows, and per request the compressed entries its queries selected. The
backend stores the new window rows in the request's ring and computes the sink attention of
v4_architecture.md §2.4 over (window ∪ selected entries). Backends differ only in the storage
format (``window_layout`` / ``entry_layouts``) and in the kernel.

``TorchBackend`` is the CPU path and the fallback: ``ops.sparse_attention`` over float rows (fp32
by default, so it reproduces the oracle to round-off). ``sparse_mla.SparseMLABackend`` stores
FlashMLA's fp8 layout and runs FlashMLA (or its torch reference, ``torch_ref``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..config import V4Config
from ..core import ops
from .kv_layout import FloatRows, IndexFp8Rows, RowLayout, V4Fp8Rows

Tensor = torch.Tensor


@dataclass
class AttnSegment:
    """One request's tokens in the batch: rows [row0, row1) at positions start, start + 1, ..."""

    slot: int
    start: int
    row0: int
    row1: int
    comp_idx: Tensor | None = None    # [n, K] indices into entry_rows (entry j), -1 = none
    entry_rows: Tensor | None = None  # [num_entries] storage rows of the request's entries 0..

    @property
    def num_tokens(self) -> int:
        return self.row1 - self.row0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class AttnBatch:
    """One layer's attention over a batch (see module docstring)."""

    q: Tensor                  # [T, H, Dh]
    kv: Tensor                 # [T, Dh] window rows of the new tokens (K = V), QAT'ed
    positions: Tensor          # [T]
    segments: list[AttnSegment]
    ring: Tensor               # this layer's rings: one page of `window` rows per request slot
    ring_layout: RowLayout
    entries: Tensor | None     # this layer's compressed-entry page buffer (ratio > 0)
    entry_layout: RowLayout | None
    sink: Tensor               # [H] attention-sink logits
    scale: float

    @property
    def window(self) -> int:
        return self.ring_layout.page_size


class AttentionBackend(ABC):
    """Storage format + sparse attention kernel of the cache."""

    name: str
    # True when storage keeps only FP8/FP4-QAT'ed vectors exactly (the model must run quant_sim)
    needs_quant_sim: bool = False

    @abstractmethod
    def window_layout(self, cfg: V4Config, dtype: torch.dtype = torch.float32) -> RowLayout:
        """Layout of the window rings (page = one request's ring of ``sliding_window`` rows)."""

    @abstractmethod
    def entry_layouts(self, cfg: V4Config, page_size: int,
                      dtype: torch.dtype = torch.float32) -> dict[int, dict[str, RowLayout]]:
        """Per ratio, the layout of each compressed-entry tensor (``main{l}``, ``index{l}``)."""

    @abstractmethod
    def attend(self, batch: AttnBatch) -> Tensor:
        """Write the new window rows into the rings and return the attention output [T, H, Dh]."""

    def __repr__(self) -> str:
        return self.name


def _entry_layouts(cfg: V4Config, main: RowLayout, index: RowLayout) -> dict[int, dict[str, RowLayout]]:
    return {4: {**{f"main{l}": main for l in cfg.c4_layers}, **{f"index{l}": index for l in cfg.c4_layers}},
            128: {f"main{l}": main for l in cfg.c128_layers}}


def fp8_window_layout(cfg: V4Config, rope_dtype: torch.dtype = torch.bfloat16) -> V4Fp8Rows:
    return V4Fp8Rows(cfg.sliding_window, cfg.nope_head_dim, cfg.qk_rope_head_dim, rope_dtype)


def fp8_entry_layouts(cfg: V4Config, page_size: int,
                      rope_dtype: torch.dtype = torch.bfloat16) -> dict[int, dict[str, RowLayout]]:
    return _entry_layouts(cfg, V4Fp8Rows(page_size, cfg.nope_head_dim, cfg.qk_rope_head_dim, rope_dtype),
                          IndexFp8Rows(page_size, cfg.index_head_dim))


class TorchBackend(AttentionBackend):
    """Float rows of the cache dtype and ``ops.sparse_attention``: the CPU path and the fallback."""

    name = "torch"

    def window_layout(self, cfg: V4Config, dtype: torch.dtype = torch.float32) -> RowLayout:
        return FloatRows(cfg.sliding_window, cfg.head_dim, dtype)

    def entry_layouts(self, cfg: V4Config, page_size: int,
                      dtype: torch.dtype = torch.float32) -> dict[int, dict[str, RowLayout]]:
        return _entry_layouts(cfg, FloatRows(page_size, cfg.head_dim, dtype),
                              FloatRows(page_size, cfg.index_head_dim, dtype))

    def attend(self, b: AttnBatch) -> Tensor:
        W, lay = b.window, b.ring_layout
        o = torch.empty_like(b.q)
        for seg in b.segments:  # per request, vectorised over its tokens
            rows = slice(seg.row0, seg.row1)
            pos, kv = b.positions[rows], b.kv[rows]
            first = max(0, seg.start - W + 1)
            held = torch.arange(first, seg.start, device=pos.device) % W + seg.slot * W
            # keys: ring rows of positions first..start-1, then the chunk's own rows as stored
            keys = torch.cat((lay.read(b.ring, held).to(kv.dtype), lay.round(kv)), dim=0)
            idx = ops.window_indices(pos, W, first)
            if seg.comp_idx is not None:
                entries = b.entry_layout.read(b.entries, seg.entry_rows).to(kv.dtype)
                idx = torch.cat((idx, torch.where(seg.comp_idx >= 0, seg.comp_idx + keys.shape[0], -1)), dim=1)
                keys = torch.cat((keys, entries), dim=0)
            o[rows] = ops.sparse_attention(b.q[rows], keys, idx, b.sink, b.scale)
            write_window(b, seg)
        return o


def write_window(b: AttnBatch, seg: AttnSegment) -> None:
    """Store the segment's last (up to W) window rows at ring row p % W of its slot."""
    W = b.window
    pos = b.positions[seg.row0:seg.row1]
    keep = pos >= seg.end - W
    b.ring_layout.write(b.ring, seg.slot * W + pos[keep] % W, b.kv[seg.row0:seg.row1][keep])


TORCH_BACKEND = TorchBackend()
