"""Independent parts of a layer run side by side on CUDA streams (on by default; ``SGLANG_DSV4_BRANCH_STREAMS=0``
runs them one after another).

A decode step of a few requests is a chain of small kernels (about 107 a flash8 layer, ~3.3 us
each at batch 1 inside a graph, session 16's census): each uses a few SMs and the GPU waits on
the chain, not on bytes. Inside one V4 attention layer four chains read only the layer input and
write only their own outputs: the query projection (and the indexer's queries), the window KV,
and the ratio-4 layers' two compressors (their states and entry pools are their own), or the
ratio-128 compressor; in the MoE, the routed experts and the shared expert. Issued on their own
streams (each waiting on the main stream at the fork, the main stream on each at the join) they
overlap, and the layer's critical path is its longest chain instead of their sum. A CUDA graph
captured over them keeps the fork and join as graph edges.

The kernels and their inputs are the same either way, so every result is the same bits; only
the order the GPU runs independent kernels in changes. On the CPU (and with the switch off) the
parts run one after another in the order given.

Memory: a part's outputs are allocated on its stream and used on the main stream after the join;
whatever the main stream frees is reused by a side stream only after a later fork, which waits on
the main stream, so no block is reused while another stream may still read it.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence, TypeVar

import torch

_T = TypeVar("_T")

# on since session 31: the same bits as the plain order, eager and replayed (test_fp8_gpu.py), and
# 9% / 3-6% / 3-12% off flash8's batch-1 / 64 / 256 steps on an H100 (decode_h200.md, sessions 30-31)
ENABLED = os.environ.get("SGLANG_DSV4_BRANCH_STREAMS", "1") == "1"


class Branches:
    """The side streams of one model on one device; ``run`` forks and joins them."""

    def __init__(self, device: torch.device):
        self.device = device
        self._streams: list[torch.cuda.Stream] = []

    @property
    def on(self) -> bool:
        """Whether the model lays a layer out in branches (``ENABLED``, read per call): on a CUDA
        device ``run`` then puts them on streams, elsewhere it runs them in order (the CPU tests
        hold that layout to the plain one, bit for bit)."""
        return ENABLED

    def run(self, parts: Sequence[Callable[[], _T]]) -> list[_T]:
        """Each part's result, in order. On streams: part 0 on the current stream, the others on
        side streams forked from it before any is issued and joined back after all are."""
        if not (ENABLED and self.device.type == "cuda") or len(parts) < 2:
            return [part() for part in parts]
        main = torch.cuda.current_stream(self.device)
        while len(self._streams) < len(parts) - 1:
            self._streams.append(torch.cuda.Stream(self.device))
        sides = self._streams[:len(parts) - 1]
        for s in sides:
            s.wait_stream(main)
        out: list = [None] * len(parts)
        for i, s in enumerate(sides, start=1):
            with torch.cuda.stream(s):
                out[i] = parts[i]()
        out[0] = parts[0]()
        for s in sides:
            main.wait_stream(s)
        return out


__all__ = ["ENABLED", "Branches"]
