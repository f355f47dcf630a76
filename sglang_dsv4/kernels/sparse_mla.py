"""The FlashMLA-shaped backend: V4 fp8 storage, attention through a ``SparseKernels`` object.

Block addressing (what the kernels see):
  - window: the ring of request slot s is page s of the layer's ring buffer (page size W = 128),
    so position p is row ``s * W + p % W``; the ring buffer is [slots, layers, page_bytes] and
    the kernel gets the layer's slice (page stride = layers * page_bytes, no copy);
  - compressed entries: the pool's pages (page size = the pool's page size), entry j of a request
    is storage row ``entry_rows[j]`` = page * P + offset, exactly FlashMLA's index convention.

A batch where every request brings one token is a decode step: the new rows are written to the
rings first (the ring then holds p-W+1..p) and ``decode`` reads the ring as the main cache and the
entries as the extra cache, indices padded to a multiple of 64 with -1. Any other batch (prefill
chunks, mixed) goes through ``prefill`` over a bf16 workspace: per request the ring rows before the
chunk, the chunk's own rows as stored, and the request's entries, with rebased indices.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..config import V4Config
from ..core import ops
from .backend import AttentionBackend, AttnBatch, AttnSegment, fp8_entry_layouts, fp8_window_layout, write_window
from .kv_layout import RowLayout

Tensor = torch.Tensor
INDEX_BLOCK = 64  # the kernels consume indices in blocks of 64


class SparseKernels(Protocol):
    """The two FlashMLA entry points (``torch_ref.TorchSparseKernels`` documents the semantics)."""

    name: str

    def decode(self, q: Tensor, cache: Tensor, layout: Any, indices: Tensor, lengths: Tensor | None,
               sink: Tensor, scale: float, extra_cache: Tensor | None = None, extra_layout: Any = None,
               extra_indices: Tensor | None = None, extra_lengths: Tensor | None = None) -> Tensor: ...

    def prefill(self, q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor: ...


def _pad_cols(x: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-1)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class SparseMLABackend(AttentionBackend):
    """V4 fp8 storage + FlashMLA's sparse decode / prefill (or their torch reference).

    ``precision="fp32"`` (torch reference kernels only) keeps the rope part of stored rows, the
    queries and the prefill workspace in fp32, so that the model matches the oracle to round-off:
    a CPU check of all the addressing above. FlashMLA itself takes bf16 ("bf16", the default).
    """

    needs_quant_sim = True

    def __init__(self, kernels: SparseKernels, name: str | None = None, precision: str = "bf16"):
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"unknown precision {precision!r} (bf16 or fp32)")
        self.kernels = kernels
        self.name = name or f"sparse-mla[{kernels.name}, {precision}]"
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def window_layout(self, cfg: V4Config, dtype: torch.dtype = torch.float32) -> RowLayout:
        return fp8_window_layout(cfg, self.dtype)

    def entry_layouts(self, cfg: V4Config, page_size: int,
                      dtype: torch.dtype = torch.float32) -> dict[int, dict[str, RowLayout]]:
        return fp8_entry_layouts(cfg, page_size, self.dtype)

    def attend(self, b: AttnBatch) -> Tensor:
        if all(seg.num_tokens == 1 for seg in b.segments):
            return self._decode(b)
        return self._prefill(b)

    # ---- decode ---------------------------------------------------------------------------------
    def _decode(self, b: AttnBatch) -> Tensor:
        W, dev = b.window, b.q.device
        rows = torch.tensor([s.row0 for s in b.segments], device=dev)
        slots = torch.tensor([s.slot for s in b.segments], device=dev)
        pos = b.positions[rows]
        b.ring_layout.write(b.ring, slots * W + pos % W, b.kv[rows])
        lo = (pos - W + 1).clamp_min(0)
        key_pos = lo[:, None] + torch.arange(W, device=dev)  # valid ones first: lengths apply
        idx = torch.where(key_pos <= pos[:, None], slots[:, None] * W + key_pos % W, -1)
        extra: dict[str, Any] = {}
        if b.entries is not None:
            ext = self._entry_indices(b.segments, dev)
            extra = dict(extra_cache=b.entries, extra_layout=b.entry_layout,
                         extra_indices=ext.to(torch.int32).unsqueeze(1).contiguous(),
                         extra_lengths=(ext >= 0).sum(-1).to(torch.int32))
        out = self.kernels.decode(b.q[rows].to(self.dtype).unsqueeze(1), b.ring, b.ring_layout,
                                  idx.to(torch.int32).unsqueeze(1).contiguous(),
                                  (pos - lo + 1).to(torch.int32), b.sink.float().contiguous(), b.scale, **extra)
        o = torch.empty_like(b.q)
        o[rows] = out[:, 0].to(b.q.dtype)
        return o

    @staticmethod
    def _entry_indices(segments: list[AttnSegment], dev: torch.device) -> Tensor:
        """Storage rows of each request's selected entries [B, K], valid ones leftmost, -1 padded."""
        per_req = []
        for seg in segments:
            comp = seg.comp_idx[0]
            if seg.entry_rows.numel():
                per_req.append(torch.where(comp >= 0, seg.entry_rows[comp.clamp_min(0)], -1))
            else:
                per_req.append(torch.full_like(comp, -1))
        width = _round_up(max(max(r.numel() for r in per_req), 1), INDEX_BLOCK)
        ext = torch.stack([_pad_cols(r, width) for r in per_req])
        # the kernel's lengths count from the left: move the valid rows there (order is irrelevant)
        order = torch.argsort((ext < 0).to(torch.int8), dim=1, stable=True)
        return ext.gather(1, order)

    # ---- prefill ---------------------------------------------------------------------------------
    def _prefill(self, b: AttnBatch) -> Tensor:
        W, dev = b.window, b.q.device
        parts, idx_parts, base = [], [], 0
        for seg in b.segments:
            rows = slice(seg.row0, seg.row1)
            pos = b.positions[rows]
            first = max(0, seg.start - W + 1)
            held = torch.arange(first, seg.start, device=dev) % W + seg.slot * W
            keys = [b.ring_layout.read(b.ring, held), b.ring_layout.round(b.kv[rows]).float()]
            n_window = keys[0].shape[0] + keys[1].shape[0]
            widx = ops.window_indices(pos, W, first)
            idx = torch.where(widx >= 0, widx + base, -1)
            if seg.comp_idx is not None:
                keys.append(b.entry_layout.read(b.entries, seg.entry_rows))
                idx = torch.cat((idx, torch.where(seg.comp_idx >= 0, seg.comp_idx + base + n_window, -1)), dim=1)
            write_window(b, seg)  # after this slot's ring rows were read
            part = torch.cat(keys)
            parts.append(part)
            idx_parts.append(idx)
            base += part.shape[0]
        width = _round_up(max(i.shape[1] for i in idx_parts), INDEX_BLOCK)
        indices = torch.cat([_pad_cols(i, width) for i in idx_parts]).to(torch.int32).unsqueeze(1)
        kv = torch.cat(parts).to(self.dtype).unsqueeze(1)  # stored values: exact in bf16
        out = self.kernels.prefill(b.q.to(self.dtype), kv, indices.contiguous(), b.sink.float().contiguous(),
                                   b.scale)
        return out.to(b.q.dtype)
