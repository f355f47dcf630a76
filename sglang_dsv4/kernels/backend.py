"""The attention-backend seam of the core: storage layouts + the sparse attention over them.

``V4Model`` keeps all cache logic (compressor state, indexer top-k, which entries each query may
see) and hands each layer's attention to the cache's backend as an ``AttnBatch``: the queries,
the new tokens' window rows, the batched step's index tensors, and per token the compressed
entries it selected (entry indices into its request's row of the step's entry table). The
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
from typing import TYPE_CHECKING

import torch

from ..config import V4Config
from ..core import ops
from .kv_layout import FloatRows, IndexFp8Rows, RowLayout, V4Fp8Rows

if TYPE_CHECKING:
    from ..core.step import StepBatch

Tensor = torch.Tensor


def attended_rows(entry_table: Tensor, tok_req: Tensor, comp_idx: Tensor) -> Tensor:
    """Entry indices [T, K] (-1 padded) -> the storage rows in each token's request's table
    ``entry_table`` [B, N] (-1 where none)."""
    rows = entry_table[tok_req].gather(1, comp_idx.clamp_min(0))
    return torch.where(comp_idx >= 0, rows, -1)


@dataclass
class AttnBatch:
    """One layer's attention over a batched step (see module docstring)."""

    q: Tensor                  # [T, H, Dh]
    kv: Tensor                 # [T, Dh] window rows of the new tokens (K = V), QAT'ed
    step: StepBatch            # positions, requests, slots of the step's tokens
    ring: Tensor               # this layer's rings: one page of `window` rows per slot (+ scratch)
    ring_layout: RowLayout
    comp_idx: Tensor | None    # [T, K] entry indices j each token attends (valid leftmost, -1 pad)
    entry_table: Tensor | None  # [B, N] storage rows of each request's entries 0..N-1
    entries: Tensor | None     # this layer's compressed-entry page buffer (ratio > 0)
    entry_layout: RowLayout | None
    sink: Tensor               # [H] attention-sink logits
    scale: float
    decode_kernel: bool = True  # False: a decode step too goes through the prefill kernel (the
    #                             deterministic mode: one kernel for every step, split by nothing)
    ratio: int = 0             # the layer's compress ratio: layers of one ratio attend alike-sized
    #                             sets in a step (the decode kernel's schedule is shared by them)

    @property
    def window(self) -> int:
        return self.ring_layout.page_size

    @property
    def positions(self) -> Tensor:
        return self.step.positions

    def comp_rows(self) -> Tensor | None:
        """[T, K] storage rows of the entries each token attends (-1 none)."""
        if self.comp_idx is None:
            return None
        return attended_rows(self.entry_table, self.step.tok_req, self.comp_idx)

    def window_sources(self) -> tuple[Tensor, Tensor, Tensor]:
        """(ring rows of the step's slots [B*W, Dh] float, the chunk's rows as stored [T, Dh],
        window indices [T, W] into their concatenation, -1 where the position is negative).

        Token t at position p sees positions p-W+1..p: those before its request's chunk from the
        slot's ring (row q % W), the others from the chunk itself."""
        st = self.step
        read_at, idx = st.derived(("window_sources", self.window), lambda: _window_indices(st, self.window))
        ring_rows = self.ring_layout.read(self.ring, read_at)
        return ring_rows, self.ring_layout.round(self.kv), idx

    def write_ring(self) -> None:
        """Store each request's last (up to W) new rows at ring row p % W of its slot (the other
        tokens' rows go to the scratch slot's page)."""
        st = self.step
        self.ring_layout.write(self.ring, st.derived(("ring_writes", self.window), lambda: _ring_writes(st, self.window)),
                               self.kv)


def _window_indices(st: StepBatch, W: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """``AttnBatch.window_sources``' addressing, the same in every layer: (the ring rows to read,
    every row of each request's slot, as (page, offset); window indices [T, W])."""
    B, b, dev = st.num_reqs, st.tok_req, st.positions.device
    read_at = (st.slots[:, None].expand(B, W).flatten(), torch.arange(W, device=dev).repeat(B))
    qpos = st.positions[:, None] - (W - 1) + torch.arange(W, device=dev)
    start = st.starts[b][:, None]
    idx = torch.where(qpos >= start, B * W + st.row0[b][:, None] + qpos - start, b[:, None] * W + qpos % W)
    return read_at, torch.where(qpos >= 0, idx, -1)


def _ring_writes(st: StepBatch, W: int) -> tuple[Tensor, Tensor]:
    """``AttnBatch.write_ring``'s (page = slot, offset = p % W) of each token: the request's slot
    for its last W positions, the scratch slot for the others."""
    pos, b = st.positions, st.tok_req
    return torch.where(pos >= st.ends[b] - W, st.slots[b], st.scratch_slot), pos % W


class AttentionBackend(ABC):
    """Storage format + sparse attention kernel of the cache."""

    name: str
    # True when storage keeps only FP8/FP4-QAT'ed vectors exactly (the model must run quant_sim)
    needs_quant_sim: bool = False
    # the queries' dtype the kernel takes (the model rounds q to it in its fused projection);
    # None: the activations' own
    query_dtype: torch.dtype | None = None

    @abstractmethod
    def window_layout(self, cfg: V4Config, dtype: torch.dtype = torch.float32) -> RowLayout:
        """Layout of the window rings (page = one request's ring of ``sliding_window`` rows)."""

    @abstractmethod
    def entry_layouts(self, cfg: V4Config, page_size: int,
                      dtype: torch.dtype = torch.float32) -> dict[int, dict[str, RowLayout]]:
        """Per ratio, the layout of each compressed-entry tensor (``main{l}``, ``index{l}``)."""

    @abstractmethod
    def attend(self, batch: AttnBatch) -> Tensor:
        """Write the new window rows into the rings and return the attention output [T, H, Dh],
        in the kernel's output dtype (the model widens it to the activations' dtype)."""

    def index_scores(self, qi: Tensor, head_weights: Tensor, keys: Tensor, layout: RowLayout,
                     entry_table: Tensor, tok_req: Tensor) -> Tensor | None:
        """The indexer's scores [T, N] of each token's request's entries (``entry_table`` [B, N])
        computed over the stored key rows ``keys`` by a fused kernel of this storage, or None:
        the model scores them in torch (``V4Model._select``, the CPU and deterministic path)."""
        return None

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

    BLOCK = 256  # tokens per gather block: bounds the [block, W + K, Dh] keys, not a loop over requests

    def attend(self, b: AttnBatch) -> Tensor:
        ring_rows, chunk, widx = b.window_sources()
        src = torch.cat((ring_rows.to(chunk.dtype), chunk))
        crow = b.comp_rows()
        out = torch.empty_like(b.q)
        for t0 in range(0, b.q.shape[0], self.BLOCK):
            wi = widx[t0:t0 + self.BLOCK]
            keys, valid = src[wi.clamp_min(0)], wi >= 0
            if crow is not None:
                cr = crow[t0:t0 + self.BLOCK]
                ek = b.entry_layout.read(b.entries, cr.clamp_min(0).flatten()).view(cr.shape[0], cr.shape[1], -1)
                keys, valid = torch.cat((keys, ek.to(keys.dtype)), 1), torch.cat((valid, cr >= 0), 1)
            out[t0:t0 + self.BLOCK] = ops.sink_attention(b.q[t0:t0 + self.BLOCK], keys, valid, b.sink, b.scale)
        b.write_ring()  # after the ring rows were read
        return out


TORCH_BACKEND = TorchBackend()
