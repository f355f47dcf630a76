"""Storing packed KV rows into their pages on the GPU as one Triton launch per write.

A fp8 layout's ``write`` quantises a step's rows (one fused region) and stores their bytes in
two places of each page (``kv_layout``: the data bytes, then the scale bytes after the page's
data). In torch the store is a concatenation and two scatters, plus the row's page and offset:
four to five launches for a few kilobytes, and a decode step writes each layer's window row and
its C4, C128 and indexer entries (17 writes a flash8 step). Here one program per row copies its
segments (e4m3 nope, bf16 rope, scales) from the quantiser's outputs to their addresses: the
same bytes (tested against the torch store under the interpreter, and on the GPU). Shapes only
decide the launch (CUDA graphs).

``quantise_store_v4`` / ``quantise_store_index`` (on by default since session 32,
``SGLANG_DSV4_KV_FUSED_WRITE=0`` off; 2% off flash8's batch-1 and 16 steps on an H100) also quantise
in that launch: the quantiser's region is about three kernels a write (42 launches of a flash8
decode step, session-27 census) before the store's one. The arithmetic is the quantiser's on the
float bits (exact powers of two, round-to-nearest-even casts): the bytes the torch quantiser and
store leave, tested under the interpreter.
"""

from __future__ import annotations

import os

import torch

from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor

BLOCK = 128  # bytes a program copies at once
# the fp8 layouts' writes quantise inside the store's launch (module docstring); read per write
FUSED_WRITE = os.environ.get("SGLANG_DSV4_KV_FUSED_WRITE", "1") == "1"


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
                                 NUM_SEGMENTS=len(segments), BLOCK=BLOCK, num_warps=1, **pdl_options(buf))


def _rows(x: Tensor, width: int, page: Tensor, off: Tensor) -> Tensor:
    if x.dim() != 2 or x.shape[1] != width or page.shape != off.shape or page.numel() != x.shape[0]:
        raise ValueError(f"quantise_store: rows {tuple(x.shape)} (width {width}) at {page.numel()} places")
    return x if x.stride(1) == 1 else x.contiguous()


@torch.compiler.disable  # a kernel launch, never traced
def quantise_store_v4(buf: Tensor, page: Tensor, off: Tensor, x: Tensor, nope: int, rope: int, page_size: int,
                      data_bytes: int, scale_bytes: int) -> None:
    """Rows x [n, nope + rope] (floats) stored in FlashMLA's V4 layout (``kv_layout.V4Fp8Rows``
    with a bf16 rope part) at (``page``, ``off``) of ``buf``, quantised in the same launch."""
    from .kv_store_triton import quantise_store_v4_kernel

    x = _rows(x, nope + rope, page, off)
    if x.shape[0] == 0:
        return
    quantise_store_v4_kernel[(x.shape[0],)](x, x.stride(0), buf, page.contiguous(), off.contiguous(), buf.stride(0),
                                            page_size * data_bytes, NOPE=nope, ROPE=rope, TILES_P=pow2(nope // 64),
                                            DATA_BYTES=data_bytes, SCALE_BYTES=scale_bytes, num_warps=2,
                                            **pdl_options(buf))


@torch.compiler.disable  # a kernel launch, never traced
def quantise_store_index(buf: Tensor, page: Tensor, off: Tensor, x: Tensor, dim: int, page_size: int) -> None:
    """Rows x [n, dim] (floats) stored as indexer keys (``kv_layout.IndexFp8Rows``) at (``page``,
    ``off``) of ``buf``, quantised in the same launch."""
    from .kv_store_triton import quantise_store_index_kernel

    x = _rows(x, dim, page, off)
    if x.shape[0] == 0:
        return
    quantise_store_index_kernel[(x.shape[0],)](x, x.stride(0), buf, page.contiguous(), off.contiguous(), buf.stride(0),
                                               page_size * dim, DIM=dim, num_warps=1, **pdl_options(buf))


__all__ = ["FUSED_WRITE", "store_row_bytes", "supported", "quantise_store_v4", "quantise_store_index"]
