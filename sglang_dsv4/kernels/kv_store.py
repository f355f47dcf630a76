"""Storing packed KV rows into their pages on the GPU as one Triton launch per write.

A fp8 layout's ``write`` quantises a step's rows (one fused region) and stores their bytes in
two places of each page (``kv_layout``: the data bytes, then the scale bytes after the page's
data). In torch the store is a concatenation and two scatters, plus the row's page and offset:
four to five launches for a few kilobytes, and a decode step writes each layer's window row and
its C4, C128 and indexer entries (17 writes a flash8 step). Here one program per row copies its
segments (e4m3 nope, bf16 rope, scales) from the quantiser's outputs to their addresses: the
same bytes (tested against the torch store under the interpreter, and on the GPU). Shapes only
decide the launch (CUDA graphs).
"""

from __future__ import annotations

import torch

from .triton_support import runs_on

Tensor = torch.Tensor

BLOCK = 128  # bytes a program copies at once


def supported(buf: Tensor) -> bool:
    """Whether ``store_row_bytes`` runs for this page buffer (uint8 pages with contiguous bytes,
    on a CUDA device or under the interpreter)."""
    return buf.dtype == torch.uint8 and buf.dim() == 2 and buf.stride(1) == 1 and runs_on(buf, "kv_store_triton")


@torch.compiler.disable  # a kernel launch, never traced
def store_row_bytes(buf: Tensor, page: Tensor, off: Tensor, segments: list[tuple[Tensor, int, int]]) -> None:
    """For each row t: ``buf[page[t], base + off[t] * stride + j] = src[t, j]`` for every segment
    (src uint8 [n, width] with contiguous rows, base, stride), at most three."""
    from .kv_store_triton import store_row_bytes_kernel

    n = page.numel()
    if n == 0:
        return
    if not 1 <= len(segments) <= 3:
        raise ValueError(f"store_row_bytes: {len(segments)} segments (1 to 3)")
    args = []
    for src, base, stride in segments + [segments[0]] * (3 - len(segments)):
        if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[0] != n or src.stride(1) != 1:
            raise ValueError(f"store_row_bytes: a segment is {src.dtype} {tuple(src.shape)}, not uint8 [{n}, w] rows")
        args += [src, src.stride(0), src.shape[1], base, stride]
    store_row_bytes_kernel[(n,)](buf, page.contiguous(), off.contiguous(), buf.stride(0), *args,
                                 NUM_SEGMENTS=len(segments), BLOCK=BLOCK, num_warps=1)


__all__ = ["store_row_bytes", "supported"]
