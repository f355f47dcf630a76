"""A decode step's compressed-entry operands for FlashMLA in one Triton launch.

Each compressed layer hands the decode kernel its extra cache as storage rows: per token, the
rows of the entries it attends (its top-k, or its visible entries in a ratio-128 layer) looked up
in its request's entry table, valid ones leftmost, -1 padded to a multiple of 64, and how many are
valid. As a fused torch region (``sparse_mla._decode_extra``) that is two kernels a layer, the
gather-and-count one 17 us a call at batch 64 on an H100 (session 33's flash43 census: 0.9 ms of
a 22 ms step) for a few thousand integers. Here one program per token does the lookup, the
padding and the count: the same integers (tested against the torch region under the
interpreter; ``tests/kernels/test_entry_rows_gpu.py`` on the GPU). Shapes only decide the
launch (CUDA graphs). On by default since session 36 (``SGLANG_DSV4_ENTRY_ROWS_KERNEL=0`` keeps
the region; the GPU test passed on an H200 in session 35): alone it took flash8's step (1K, fp8,
graphs, H100) from 3.27 to 3.16 ms at batch 1 and left batch 64 level (pipelined 5.74 against
5.75 ms); with the other three kernels switched on then, flash43's batch-64 step went from 21.80
to 19.83 ms.
"""

from __future__ import annotations

import os

import torch

from .triton_support import pdl_options, runs_on

Tensor = torch.Tensor
BLOCK = 512  # indices a loop iteration reads (V4's top-k: one iteration)
# on by default (module docstring); read per call
ENABLED = os.environ.get("SGLANG_DSV4_ENTRY_ROWS_KERNEL", "1") == "1"


def supported(comp_idx: Tensor) -> bool:
    """Whether the decode step takes ``decode_entry_rows`` for these indices: switched on
    (``SGLANG_DSV4_ENTRY_ROWS_KERNEL``, on by default) and a CUDA tensor (or the interpreter)."""
    return ENABLED and comp_idx.dim() == 2 and runs_on(comp_idx, "entry_rows_triton")


@torch.compiler.disable  # a kernel launch, never traced
def decode_entry_rows(entry_table: Tensor, tok_req: Tensor, comp_idx: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Entry indices ``comp_idx`` [T, K] (valid leftmost, -1 padded) of tokens whose requests are
    ``tok_req`` [T], tables ``entry_table`` [B, N] -> (storage rows [T, 1, width] int32, -1 past
    the valid ones; valid counts [T] int32): ``sparse_mla._decode_extra``'s result."""
    from .entry_rows_triton import decode_entry_rows_kernel

    T, K = comp_idx.shape
    if width < K:
        raise ValueError(f"decode_entry_rows: width {width} is narrower than the {K} indices")
    rows = torch.empty(T, 1, width, dtype=torch.int32, device=comp_idx.device)
    counts = torch.empty(T, dtype=torch.int32, device=comp_idx.device)
    if T == 0:
        return rows, counts
    table, idx = entry_table.contiguous(), comp_idx.contiguous()
    decode_entry_rows_kernel[(T,)](table, tok_req.contiguous(), idx, rows, counts, K, width, table.stride(0),
                                   idx.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_options(rows))
    return rows, counts


__all__ = ["ENABLED", "decode_entry_rows", "supported"]
