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
chunks, mixed) goes through ``prefill`` over a bf16 workspace: the ring rows of the step's slots,
the chunk's own rows as stored, and each request's entries, with indices into it. Both are built
for the whole batch at once from the step's index tensors.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..config import V4Config
from ..core.compiled import on_gpu
from . import entry_rows, index_scores
from .backend import AttentionBackend, AttnBatch, attended_rows, fp8_entry_layouts, fp8_window_layout
from .kv_layout import RowLayout

Tensor = torch.Tensor
INDEX_BLOCK = 64  # the kernels consume indices in blocks of 64


class SparseKernels(Protocol):
    """The two FlashMLA entry points (``torch_ref.TorchSparseKernels`` documents the semantics)."""

    name: str

    def new_sched(self) -> Any:
        """A decode schedule to share between calls with identical shapes and lengths (None:
        the kernels keep none)."""

    def decode(self, q: Tensor, cache: Tensor, layout: Any, indices: Tensor, lengths: Tensor | None,
               sink: Tensor, scale: float, extra_cache: Tensor | None = None, extra_layout: Any = None,
               extra_indices: Tensor | None = None, extra_lengths: Tensor | None = None,
               sched: Any = None) -> Tensor: ...

    def prefill(self, q: Tensor, kv: Tensor, indices: Tensor, sink: Tensor, scale: float) -> Tensor: ...


def _pad_cols(x: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-1)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@on_gpu(rows={"pos": (0,), "slots": (0,)})
def _decode_window(pos: Tensor, slots: Tensor, W: int):
    """A decode step's ring addressing, the same in every layer: (where the new rows go, as
    (page = slot, offset = p % W), window indices [T, 1, W] int32, their lengths [T] int32).
    Token t at position p sees ring rows of positions p-W+1..p, the valid ones first (the
    lengths apply), -1 after them."""
    lo = (pos - W + 1).clamp_min(0)
    key_pos = lo[:, None] + torch.arange(W, device=pos.device)
    idx = torch.where(key_pos <= pos[:, None], slots[:, None] * W + key_pos % W, -1)
    return (slots, pos % W), idx.to(torch.int32).unsqueeze(1).contiguous(), (pos - lo + 1).to(torch.int32)


@on_gpu(rows={"tok_req": (0,), "comp_idx": (0,)}, widths={"entry_table": (1,), "comp_idx": (1,)})
def _decode_extra(entry_table: Tensor, tok_req: Tensor, comp_idx: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """The decode kernel's extra-cache operands for a layer's entry indices [T, K]: the storage
    rows [T, 1, width] int32 (valid leftmost, as the indices are; -1 padded to ``width``) and how
    many are valid [T] int32. The torch path, and the reference of ``entry_rows.decode_entry_rows``
    (one launch, opt-in): one fused region on the GPU, two kernels (about ten small ops eager)."""
    rows = attended_rows(entry_table, tok_req, comp_idx)
    return _pad_cols(rows, width).to(torch.int32).unsqueeze(1), (rows >= 0).sum(-1).to(torch.int32)


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

    @property
    def query_dtype(self) -> torch.dtype:
        """The kernels take their queries in the storage's precision."""
        return self.dtype

    def window_layout(self, cfg: V4Config, dtype: torch.dtype = torch.float32) -> RowLayout:
        return fp8_window_layout(cfg, self.dtype)

    def entry_layouts(self, cfg: V4Config, page_size: int,
                      dtype: torch.dtype = torch.float32) -> dict[int, dict[str, RowLayout]]:
        return fp8_entry_layouts(cfg, page_size, self.dtype)

    def attend(self, b: AttnBatch) -> Tensor:
        if b.step.is_decode and b.decode_kernel:
            return self._decode(b)
        return self._prefill(b)

    def index_scores(self, qi: Tensor, head_weights: Tensor, keys: Tensor, layout: RowLayout,
                     entry_table: Tensor, tok_req: Tensor) -> Tensor | None:
        """On the GPU, the scores straight from the fp8 key rows (``index_scores``)."""
        if not index_scores.supported(qi, layout):
            return None
        return index_scores.paged_index_scores(qi, head_weights, keys, layout, entry_table, tok_req)

    # ---- decode ---------------------------------------------------------------------------------
    def _decode(self, b: AttnBatch) -> Tensor:
        """One token per request (token t is request t): the ring is written first, then read as
        the main cache (positions p-W+1..p, leftmost valid) and the entries as the extra cache."""
        W, st = b.window, b.step
        ring_rows, idx, lengths = st.derived(("decode_window", W), lambda: _decode_window(b.positions, st.slots, W))
        b.ring_layout.write(b.ring, ring_rows, b.kv)
        extra: dict[str, Any] = {}
        if b.comp_idx is not None:  # valid rows leftmost (top-k order, or entries ascending)
            width = _round_up(max(b.comp_idx.shape[1], 1), INDEX_BLOCK)
            extra_rows = entry_rows.decode_entry_rows if entry_rows.supported(b.comp_idx) else _decode_extra
            rows, counts = extra_rows(b.entry_table, st.tok_req, b.comp_idx, width)  # one launch where switched on
            extra = dict(extra_cache=b.entries, extra_layout=b.entry_layout,
                         extra_indices=rows.contiguous(), extra_lengths=counts)
        # FlashMLA's tile schedule depends on the shapes and the lengths only, which every layer of
        # one ratio shares in a step (window lengths from the positions; entry counts from the
        # ratio's table and top-k): it is computed by the first such layer and reused by the rest
        sched = st.derived(("decode_sched", b.ratio, W), self.kernels.new_sched)
        out = self.kernels.decode(b.q.to(self.dtype).unsqueeze(1), b.ring, b.ring_layout, idx, lengths,
                                  b.sink.float().contiguous(), b.scale, sched=sched, **extra)
        return out[:, 0]

    # ---- prefill ---------------------------------------------------------------------------------
    def _prefill(self, b: AttnBatch) -> Tensor:
        """Any other step: a bf16 workspace [ring rows of the step's slots; the chunk's rows as
        stored; each request's entries 0..N-1] and per-token indices into it."""
        st = b.step
        ring_rows, chunk, widx = b.window_sources()
        parts, idx = [ring_rows, chunk.float()], widx
        if b.comp_idx is not None:
            B, N = b.entry_table.shape
            parts.append(b.entry_layout.read(b.entries, b.entry_table.clamp_min(0).flatten()))
            base = ring_rows.shape[0] + chunk.shape[0] + st.tok_req[:, None] * N
            idx = torch.cat((idx, torch.where(b.comp_idx >= 0, base + b.comp_idx, -1)), dim=1)
        b.write_ring()  # after the ring rows were read
        indices = _pad_cols(idx, _round_up(idx.shape[1], INDEX_BLOCK)).to(torch.int32).unsqueeze(1)
        kv = torch.cat(parts).to(self.dtype).unsqueeze(1)  # stored values: exact in bf16
        out = self.kernels.prefill(b.q.to(self.dtype), kv, indices.contiguous(), b.sink.float().contiguous(),
                                   b.scale)
        return out
