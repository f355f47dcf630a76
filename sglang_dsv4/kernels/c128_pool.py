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
"""

from __future__ import annotations

import os

import torch

from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor

ENABLED = os.environ.get("SGLANG_DSV4_C128_POOL", "kernel") == "kernel"
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


__all__ = ["pool", "preferred", "supported"]
