"""The ratio-128 compressor's online-softmax pooling on the GPU as one Triton launch per layer.

``ops.online_softmax_pool`` absorbs a step's rows into each (request, group) segment's running
state position by position, in one fixed order whatever the chunking (so a group's pooled value
does not depend on where a prefill chunk started inside it). In torch that is one fused region
per position: a step of L new tokens launches L of them in every ratio-128 layer, a Dynamo-guarded
call each (a cache hit of 32 tokens: 96 calls on flash8's 3 such layers, 640 on V4-Flash's 20; a
cold chunk: 128 per layer). Here one program per (segment, block of dims) walks the positions in
the same order with the same arithmetic: one launch per layer for any L, decode included (one code
for every width, so a position's result does not depend on the step it came in). Tested against
the torch loop under the interpreter and on the GPU; shapes only decide the launch (CUDA graphs).

On by default on the GPU since 2026-12-05 (the flash8 server ran with it on the H200, every check
passing; its GPU tests hold it to the loop within 1.9e-7 of the vectors' scale: its rounding is
Triton's, the loop's Inductor's). ``SGLANG_DSV4_C128_POOL=loop`` keeps the torch loop.

``entries`` goes further (on by default since session 36, ``SGLANG_DSV4_C128_ENTRIES_KERNEL=0``
off; its GPU tests passed on an H200 in session 35; alone it took flash8's step (1K, fp8, graphs,
H100) from 6.69 to 6.48 ms at batch 64 and left batch 1 level; with the other three kernels
switched on then, flash43's batch-64 step went from 21.80 to 19.83 ms): the layer's whole
compressor after its projections in two launches, where the pooling launch sat between ``ops.c128_start``'s region
and ``ops.c128_finish``'s ~7 kernels (the state write, the division, norm, RoPE, FP8 QAT). One program a segment starts from its slot's state,
pools, keeps its state and finishes its entry (``c4_entries_triton.finish_entry``, the C4
kernel's finishing); a second launch writes the slots' states (a request's last segment writes
the row its first one read).
"""

from __future__ import annotations

import os

import torch

from ..config import V4Config
from .c4_entries import _dims_ok, rows_ok
from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor

ENABLED = os.environ.get("SGLANG_DSV4_C128_POOL", "kernel") == "kernel"
# on by default (module docstring); read per call
ENTRIES = os.environ.get("SGLANG_DSV4_C128_ENTRIES_KERNEL", "1") == "1"
MAX_BLOCK_D = 128  # dims a program holds (three float32 vectors of state)


def supported(a: Tensor, s: Tensor, state: Tensor) -> bool:
    """Whether ``pool`` runs for these operands (float32 rows with contiguous dims, a contiguous
    state, on a CUDA device or under the interpreter)."""
    return (a.dtype == s.dtype == state.dtype == torch.float32 and a.dim() == s.dim() == 2
            and a.stride(1) == s.stride(1) == 1 and state.is_contiguous() and runs_on(a, "c128_pool_triton"))


def preferred(a: Tensor, s: Tensor, state: Tensor) -> bool:
    """Whether the step should take ``pool`` over the torch loop: opted in, and supported."""
    return ENABLED and supported(a, s, state)


@torch.compiler.disable  # a kernel launch, never traced
def pool(a: Tensor, s: Tensor, tok: Tensor, state: Tensor, width: int) -> Tensor:
    """``ops.online_softmax_pool(a, s, tok, state, width)``: each segment g's state [3, d] (running
    max, sum, weighted sum) absorbs rows ``a[tok[g, i]]``, ``s[tok[g, i]]`` for i < width in order
    (tok -1: no row) -> the new states [G, 3, d]."""
    from .c128_pool_triton import c128_pool_kernel

    G, three, d = state.shape
    if three != 3 or a.shape[1] != d or s.shape != a.shape or tok.shape[0] != G or tok.shape[1] < width:
        raise ValueError(f"c128_pool: rows {tuple(a.shape)} / {tuple(s.shape)}, tokens {tuple(tok.shape)}, "
                         f"state {tuple(state.shape)}, width {width}")
    out = torch.empty_like(state)
    if G == 0:
        return out
    tok = tok.contiguous()
    block = min(pow2(d), MAX_BLOCK_D)
    c128_pool_kernel[(G, -(-d // block))](a, s, tok, state, out, width, d, a.stride(0), s.stride(0),
                                                 tok.stride(0), BLOCK_D=block, num_warps=max(1, block // 64),
                                                 **pdl_options(a))
    return out


def entries_supported(a: Tensor, s: Tensor, state: Tensor, rope: tuple[Tensor, Tensor], cfg: V4Config,
                      ape: Tensor | None = None, positions: Tensor | None = None) -> bool:
    """Whether ``entries`` takes these operands: switched on (``SGLANG_DSV4_C128_ENTRIES_KERNEL=1``);
    rows a, s [T, d] it reads (``c4_entries.rows_ok``: float32, or bf16 with their position bias
    ``ape`` at ``positions`` to add) and float32 states [slots, 3, d] with contiguous dims (any
    other strides); a rotation table (cos, sin) with contiguous dims; the main compressor's widths
    (``c4_entries._dims_ok``); a CUDA tensor (or the interpreter)."""
    if not ENTRIES or not (rows_ok(a, s, ape, positions) and state.dtype == torch.float32):
        return False
    if a.dim() != 2 or s.shape != a.shape or state.dim() != 3 or state.shape[1:] != (3, a.shape[1]):
        return False
    cos, sin = rope
    if a.stride(1) != 1 or s.stride(1) != 1 or state.stride(2) != 1 or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        return False
    return _dims_ok(a.shape[1], 2 * cos.shape[1], cfg.nope_head_dim, False) and runs_on(a, "c128_pool_triton")


@torch.compiler.disable  # kernel launches, never traced
def entries(a: Tensor, s: Tensor, tok: Tensor, carry: Tensor, slots: Tensor, state: Tensor, completes: Tensor,
            store_slot: Tensor, width: int, norm: Tensor, rope: tuple[Tensor, Tensor], cfg: V4Config,
            quant_sim: bool, ape: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """``ops.c128_finish(ops.online_softmax_pool(a, s, tok, ops.c128_start(carry, slots, state, a), width),
    completes, state, store_slot, ...)``: each segment g's finished entry [G, d]; ``state``
    [slots, 3, d] (a layer's view) takes each segment's state at ``store_slot`` in place (empty
    where it ``completes`` its group). ``norm``: the compressor's norm weight; ``rope`` (cos, sin
    [G, rope_dim / 2]) each segment's rotation at its group's first position. a, s: float32, or
    bf16 with ``ape`` [128, d] and ``positions`` [T] (s before its position bias, added on load
    in float32 as ``ops.with_position_bias``)."""
    from .c128_pool_triton import c128_entries_kernel, c128_state_write_kernel

    G, width_max = tok.shape
    d = a.shape[1]
    cos, sin = rope
    if (state.shape[1:] != (3, d) or width_max < width or not (carry.shape == slots.shape == completes.shape
                                                                == store_slot.shape == (G,)) or cos.shape[0] != G):
        raise ValueError(f"c128_entries: rows {tuple(a.shape)}, tokens {tuple(tok.shape)}, state {tuple(state.shape)}, "
                         f"segments {tuple(carry.shape)}, rope {tuple(cos.shape)}, width {width}")
    if not rows_ok(a, s, ape, positions):
        raise ValueError(f"c128_entries: rows {a.dtype} / {s.dtype}, bias {None if ape is None else tuple(ape.shape)}, "
                         f"positions {None if positions is None else tuple(positions.shape)}")
    out = torch.empty(G, d, dtype=torch.float32, device=a.device)
    if G == 0:
        return out
    run = torch.empty(G, 3, d, dtype=torch.float32, device=a.device)
    tok, carry, slots, completes, store_slot = (t.contiguous() for t in (tok, carry, slots, completes, store_slot))
    bias, pos, ratio = (s, s, 0) if ape is None else (ape, positions.contiguous(), ape.shape[0])
    block = pow2(d)
    pdl = pdl_options(a)
    c128_entries_kernel[(G,)](
        a, s, bias, pos, tok, state, slots, carry, norm.contiguous(), cos, sin, run, out,
        width, a.stride(0), s.stride(0), bias.stride(0), tok.stride(0), state.stride(0), state.stride(1),
        cos.stride(0), sin.stride(0), cfg.rms_norm_eps, D=d, BLOCK_D=block, ROPE=2 * cos.shape[1],
        NOPE=cfg.nope_head_dim, QUANT=quant_sim, RATIO=ratio, num_warps=4, **pdl)
    c128_state_write_kernel[(G,)](run, state, store_slot, completes, state.stride(0), state.stride(1), D=d,
                                  BLOCK_D=block, num_warps=4, **pdl)
    return out


__all__ = ["ENTRIES", "entries", "entries_supported", "pool", "preferred", "supported"]
