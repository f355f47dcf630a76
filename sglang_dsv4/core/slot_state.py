"""The per-request slot state of V4: what a running request owns and a snapshot copies.

Per slot (one running request):
  - a window ring per layer (main layers, then MTP layers): ``sliding_window`` rows, position p at
    row p % W, stored in the attention backend's window layout (float rows or FlashMLA's fp8);
  - per ratio-4 layer, the raw compressor rows (a, s) of positions 4*floor(P/4)-4 .. P-1 at row
    p % 8, for the main compressor (width 2*Dh) and the indexer's (width 2*Di);
  - per ratio-128 layer an online-softmax accumulator (running max, running sum, running weighted
    sum) of the open group, [3, Dh]: a fixed size whatever P mod 128 is.

``SlotStateLayout`` owns the shapes, allocation (with one scratch slot at the end, which the
batched step writes for tokens whose results are discarded), reset, snapshot copies and the
byte sizes that ``memory`` and ``srt.pool_sizing`` report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import V4Config
from ..kernels.kv_layout import FloatRows, RowLayout

Tensor = torch.Tensor
C4_STATE_ROWS = 8   # the previous complete group + the current one
C4_COFF = 2         # overlapping C4 groups: rows are 2*d wide (halves A and B)
C128_VECTORS = 3    # running max, running sum, running weighted sum


@dataclass(frozen=True)
class SlotStateLayout:
    """Shapes, bytes and lifecycle of the per-request state of ``cfg`` (module docstring)."""

    cfg: V4Config
    ring: RowLayout            # one page = one request's ring of one layer
    dtype: torch.dtype = torch.float32  # compressor state (and float rings)

    @classmethod
    def of(cls, cfg: V4Config, ring_layout: RowLayout | None = None,
           dtype: torch.dtype = torch.float32) -> "SlotStateLayout":
        """The layout with rings in ``ring_layout`` (default: float rows of ``dtype``)."""
        return cls(cfg, ring_layout or FloatRows(cfg.sliding_window, cfg.head_dim, dtype), dtype)

    @property
    def num_ring_layers(self) -> int:
        return self.cfg.num_hidden_layers + self.cfg.num_mtp_layers

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot shape of each compressor-state tensor (the ring is the ring layout's page)."""
        cfg = self.cfg
        Dh, Di, n4, n128 = cfg.head_dim, cfg.index_head_dim, len(cfg.c4_layers), len(cfg.c128_layers)
        return {"c4_main_a": (n4, C4_STATE_ROWS, C4_COFF * Dh), "c4_main_s": (n4, C4_STATE_ROWS, C4_COFF * Dh),
                "c4_index_a": (n4, C4_STATE_ROWS, C4_COFF * Di), "c4_index_s": (n4, C4_STATE_ROWS, C4_COFF * Di),
                "c128": (n128, C128_VECTORS, Dh)}

    # ---- bytes --------------------------------------------------------------------------------
    @property
    def ring_bytes(self) -> int:
        """One request's rings over all layers."""
        return self.num_ring_layers * self.ring.page_bytes

    def component_bytes(self) -> dict[str, int]:
        """Bytes per slot of each state tensor (the ring included)."""
        out = {"ring": self.ring_bytes}
        for name, shape in self.shapes().items():
            n = 1
            for d in shape:
                n *= d
            out[name] = n * self.dtype.itemsize
        return out

    @property
    def compressor_bytes(self) -> int:
        return sum(b for k, b in self.component_bytes().items() if k != "ring")

    @property
    def slot_bytes(self) -> int:
        """One slot = what a snapshot copies."""
        return self.ring_bytes + self.compressor_bytes

    # ---- lifecycle ----------------------------------------------------------------------------
    def alloc(self, num_slots: int, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """State of ``num_slots`` slots plus the scratch slot (index ``num_slots``)."""
        n = num_slots + 1
        state = {"ring": self.ring.alloc(n, self.num_ring_layers, device=device)}
        for name, shape in self.shapes().items():
            state[name] = torch.zeros(n, *shape, dtype=self.dtype, device=device)
        return state

    @staticmethod
    def reset(state: dict[str, Tensor], slot: int) -> None:
        """State of a request at position 0: only the C128 accumulator needs a value (empty group)."""
        c128 = state["c128"][slot]
        c128[:, 0].fill_(float("-inf"))  # running max
        c128[:, 1:].zero_()              # running sum, weighted sum

    @staticmethod
    def copy_out(state: dict[str, Tensor], slot: int) -> dict[str, Tensor]:
        """A snapshot's private copy of one slot."""
        return {k: v[slot].clone() for k, v in state.items()}

    @staticmethod
    def copy_in(state: dict[str, Tensor], slot: int, saved: dict[str, Tensor]) -> None:
        for k, v in saved.items():
            state[k][slot].copy_(v)

    @staticmethod
    def scratch_slot(state: dict[str, Tensor]) -> int:
        return state["c128"].shape[0] - 1
