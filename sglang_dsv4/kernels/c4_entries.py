"""A ratio-4 compressor's entries of a step in one Triton launch (and one for its state writes).

``ops.c4_entries`` turns each token's 8-row window (the request's slot-state rows before the
chunk, the chunk's own rows, padding) into its compressed entry: a per-dim softmax pooling, RMS
norm, RoPE at the group's first position, then FP8 QAT (main) or Hadamard + FP4 QAT (indexer),
and writes the chunk's rows into the slot states. As a compiled torch region that is ~9 kernels a
call; at flash43 batch 64 on an H100 the C4 calls (a main and an indexer compressor in each of 21
layers) took 1.41 ms of a 22 ms decode step replayed from a CUDA graph. Here one program per token
does the gather, pooling and finishing of its entry (``c4_entries_triton.c4_entries_kernel``), and a
second launch copies the rows into the states (``c4_state_write_kernel``): two launches a call.

Why two: a token's window reads state rows that the same call overwrites. Token p' of a chunk
starting at ``start`` writes row p' % 8 of its request's slot, whose old position p' - 8 the
window of every chunk token p in [start, p' - 1] reads while p' - 8 < start: chunks of 2..15
tokens (a decode step of one token a request never aliases). Programs of one grid run in no
guaranteed order, so the writes wait for the next launch (stream order; with PDL its programs wait
for the first grid's completion too).

The math is the torch region's in float32 (its float64 rotation table used in float32, as
``apply_rope`` casts it); the quantisers are exact integer arithmetic on the float bits, so the
codes match the region's wherever their inputs do (pre-quantisation values agree to float
rounding: exp, rsqrt and the sums' order differ, so a value that falls within rounding of an
fp8 / fp4 rounding boundary may round the other way). Tested against the torch region under the
interpreter (``tests/kernels/test_c4_entries.py``) and on the GPU
(``tests/kernels/test_c4_entries_gpu.py``). Shapes only decide the launches (CUDA graphs).
On by default since session 35 (``SGLANG_DSV4_C4_ENTRIES_KERNEL=0`` keeps the torch region): its
GPU tests passed on an H200, and graph-timed there (``benchmarks/bench_c4_entries.py``) a call
took 5.0 / 4.3 us (main / indexer) against the region's 8.9 / 13.6 at batch 1, 5.7 / 4.6 against
29.7 / 32.4 at 64 and 7.4 / 5.2 against 61.2 / 41.1 at 256, no fp8 / fp4 code apart.
"""

from __future__ import annotations

import os

import torch

from ..config import V4Config
from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor
WINDOW = 8  # rows a window pools: the A half of group j-1's four, the B half of group j's
# on by default since session 35 (module docstring); read per call
ENABLED = os.environ.get("SGLANG_DSV4_C4_ENTRIES_KERNEL", "1") == "1"


def _dims_ok(d: int, rope_dim: int, nope: int, is_indexer: bool) -> bool:
    """Whether the kernel's shapes hold: an even RoPE width within d; the indexer's d a power of two
    of at least 32 (Hadamard, FP4 blocks); the main's FP8 width a multiple of 64 within d."""
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > d:
        return False
    if is_indexer:
        return d >= 32 and d & (d - 1) == 0
    return d > 32 and 0 <= nope <= d - rope_dim and nope % 64 == 0  # d > 32: whole 64-blocks


def rows_ok(a: Tensor, s: Tensor, ape: Tensor | None, positions: Tensor | None) -> bool:
    """Whether the entry kernels (this one's and ``c128_pool.entries``) read these compressor rows:
    a, s [T, W] float32, or bf16 (the GEMMs' own output, widened on load: exact) with their
    position bias still to add, ``ape`` [ratio, W] float32 with contiguous dims at ``positions``
    [T] (the bias added on load, one float32 add as ``ops.with_position_bias``'s)."""
    if a.dtype != s.dtype or a.dtype not in (torch.float32, torch.bfloat16):
        return False
    if positions is None:
        return ape is None and a.dtype == torch.float32
    return (ape is not None and ape.dtype == torch.float32 and ape.dim() == 2 and ape.shape[1] == a.shape[1]
            and ape.stride(1) == 1 and positions.dim() == 1 and positions.shape[0] == a.shape[0]
            and not positions.dtype.is_floating_point)


def supported(a: Tensor, s: Tensor, state_a: Tensor, state_s: Tensor, idx: Tensor,
              rope: tuple[Tensor, Tensor], cfg: V4Config, is_indexer: bool, ape: Tensor | None = None,
              positions: Tensor | None = None) -> bool:
    """Whether ``ops.c4_entries`` takes the kernel for these operands: switched on
    (``SGLANG_DSV4_C4_ENTRIES_KERNEL``, on by default); rows it reads (``rows_ok``) and float32
    states with contiguous dims (any row strides), 8-row windows and states, a rotation table
    (``ops.Rope``: cos, sin) with contiguous dims, shapes the kernel holds (``_dims_ok``); a CUDA
    tensor (or the interpreter)."""
    if not ENABLED:
        return False
    if not (rows_ok(a, s, ape, positions) and state_a.dtype == state_s.dtype == torch.float32):
        return False
    if a.dim() != 2 or s.shape != a.shape or a.shape[1] % 2 or state_a.dim() != 3 or state_s.shape != state_a.shape:
        return False
    cos, sin = rope
    if state_a.shape[1:] != (WINDOW, a.shape[1]) or idx.dim() != 2 or idx.shape[1] != WINDOW:
        return False
    if cos.dim() != 2 or sin.shape != cos.shape or cos.shape[0] != a.shape[0]:
        return False
    if a.stride(1) != 1 or s.stride(1) != 1 or state_a.stride(2) != 1 or state_s.stride(2) != 1:
        return False
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        return False
    d = a.shape[1] // 2
    if not _dims_ok(d, 2 * cos.shape[1], cfg.nope_head_dim, is_indexer):
        return False
    return runs_on(a, "c4_entries_triton")


@torch.compiler.disable  # kernel launches, never traced
def c4_entries(a: Tensor, s: Tensor, state_a: Tensor, state_s: Tensor, slots: Tensor, idx: Tensor,
               dst: tuple[Tensor, Tensor], norm: Tensor, rope: tuple[Tensor, Tensor], cfg: V4Config,
               is_indexer: bool, quant_sim: bool, num_warps: int | None = None, ape: Tensor | None = None,
               positions: Tensor | None = None) -> Tensor:
    """``ops.c4_entries_torch``: the entry each token's 8-row window completes, finished -> [T, d]
    float32; then ``state_a[dst] = a``, ``state_s[dst] = s`` in place.

    a, s [T, 2d] the chunk's rows (float32, or bf16 with ``ape`` [4, 2d] and ``positions`` [T]: s
    before its position bias, which the kernels add in float32 as ``ops.with_position_bias``);
    state_* [slots, 8, 2d] a layer's slot states (views);
    ``slots`` [B] the step's requests' slots; ``idx`` [T, 8] rows of [state rows of ``slots`` (B * 8);
    a, s (T); a padding row]; ``dst`` (slot [T], row [T]); ``norm`` [d] the compressor's norm
    weight; ``rope`` (cos, sin [T, rope_dim / 2], ``ops.Rope``) each token's rotation at its group's
    first position. ``num_warps``: the entries kernel's (default by width; benchmarks try others)."""
    from .c4_entries_triton import c4_entries_kernel, c4_state_write_kernel

    T, d2 = a.shape
    cos, sin = rope
    d, rope_dim = d2 // 2, 2 * cos.shape[1]
    nope = cfg.nope_head_dim if not is_indexer else 0
    if not _dims_ok(d, rope_dim, nope, is_indexer) or idx.shape != (T, WINDOW) or state_a.shape[1:] != (WINDOW, d2):
        raise ValueError(f"c4_entries: rows {tuple(a.shape)}, windows {tuple(idx.shape)}, states "
                         f"{tuple(state_a.shape)}, rope {rope_dim}, nope {nope}, indexer {is_indexer}")
    if not rows_ok(a, s, ape, positions):
        raise ValueError(f"c4_entries: rows {a.dtype} / {s.dtype}, bias {None if ape is None else tuple(ape.shape)}, "
                         f"positions {None if positions is None else tuple(positions.shape)}")
    out = torch.empty(T, d, dtype=torch.float32, device=a.device)
    if T == 0:
        return out
    dst_slot, dst_row = dst[0].contiguous(), dst[1].contiguous()
    idx, slots, norm = idx.contiguous(), slots.contiguous(), norm.contiguous()
    bias, pos, ratio = (s, s, 0) if ape is None else (ape, positions.contiguous(), ape.shape[0])
    block = pow2(d)
    pdl = pdl_options(a)
    c4_entries_kernel[(T,)](
        a, s, bias, pos, state_a, state_s, slots, idx, norm, cos, sin, out,
        T, slots.shape[0] * WINDOW, a.stride(0), s.stride(0), bias.stride(0), state_a.stride(0), state_a.stride(1),
        state_s.stride(0), state_s.stride(1), idx.stride(0), cos.stride(0), sin.stride(0), cfg.rms_norm_eps,
        D=d, BLOCK_D=block, ROPE=rope_dim, NOPE=nope, ROWS=WINDOW, WINDOW=WINDOW, IS_INDEXER=is_indexer,
        QUANT=quant_sim, LOG2_D=block.bit_length() - 1, HAD_SCALE=d**-0.5, RATIO=ratio,
        num_warps=num_warps or (8 if block >= 512 else 4), **pdl)
    c4_state_write_kernel[(T,)](
        a, s, bias, pos, state_a, state_s, dst_slot, dst_row, a.stride(0), s.stride(0), bias.stride(0),
        state_a.stride(0), state_a.stride(1), state_s.stride(0), state_s.stride(1), W=d2, BLOCK_W=pow2(d2),
        RATIO=ratio, num_warps=4, **pdl)
    return out


__all__ = ["ENABLED", "c4_entries", "rows_ok", "supported"]
