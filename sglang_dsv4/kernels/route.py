"""The MoE router's selection on the GPU as one Triton launch (on by default,
``SGLANG_DSV4_ROUTE_KERNEL=0`` off).

``ops.route_tokens`` turns a token's router logits (x @ gate.T) into its experts and gates:
sqrt(softplus) scores, the top k of scores + bias (or the token's fixed experts in a hash-routed
layer), the chosen scores normalised to sum to the routed scaling factor. As a fused region that
is the gate GEMM and about six kernels a layer (``torch.topk`` is a kernel of its own): 24 us a
layer of flash43's batch-64 step on an H100 (session 33's census), for a [T, E] table. Here the
GEMM stays (cuBLAS, the same logits) and one program per token does the rest in registers. The
top k is k passes of a maximum (ties to the lower expert, where ``torch.topk`` leaves the order of
exact ties open); softplus's log1p is computed as log(u) * e / (u - 1), within an ulp or two of
torch's, so a gate can differ in its last bits and a near-tie of scores can route another
expert (tested against the torch ops under the interpreter; ``tests/kernels/test_route_gpu.py``
against the fused region on the GPU, passed on an H200 in session 35). On by default since session
36: alone it took flash8's step (1K, fp8, graphs, H100) from 3.27 to 3.15 ms at batch 1 and 6.69 to
6.57 at 64; with the other three kernels switched on then, flash43's batch-64 step went from
21.80 to 19.83 ms.
"""

from __future__ import annotations

import os

import torch

from .triton_support import pdl_options, pow2, runs_on

Tensor = torch.Tensor

ENABLED = os.environ.get("SGLANG_DSV4_ROUTE_KERNEL", "1") == "1"  # read per call
MAX_EXPERTS = 1024  # a program holds a token's scores in registers


def preferred(x: Tensor, gate: Tensor, k: int) -> bool:
    """Whether routing ``x`` [T, D] by ``gate`` [E, D] takes the kernel: switched on, float32 on
    CUDA (or the interpreter), E at most ``MAX_EXPERTS``, k at most E."""
    return (ENABLED and x.dim() == 2 and x.dtype == gate.dtype == torch.float32 and gate.shape[0] <= MAX_EXPERTS
            and 0 < k <= gate.shape[0] and runs_on(x, "route_triton"))


@torch.compiler.disable  # a kernel launch, never traced
def route_from_logits(logits: Tensor, bias_or_chosen: Tensor, k: int, scale: float) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (chosen experts [T, k] int64, gates [T, k] float32): ``ops.route_tokens``'
    selection after its GEMM. ``bias_or_chosen``: the layer's bias [E] (float), or each token's
    fixed experts [T, k] (integer: a hash-routed layer)."""
    from .route_triton import route_kernel

    T, E = logits.shape
    hashed = not bias_or_chosen.is_floating_point()
    chosen = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    gates = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return chosen, gates
    given = bias_or_chosen.contiguous() if hashed else chosen
    bias = logits if hashed else bias_or_chosen.float().contiguous()
    lg = logits if logits.stride(1) == 1 else logits.contiguous()
    route_kernel[(T,)](lg, bias, given, chosen, gates, E, lg.stride(0), float(scale), K=k, K_P=pow2(k),
                       E_P=pow2(E), HASHED=hashed, num_warps=1 if E <= 64 else 4, **pdl_options(chosen))
    return chosen, gates


__all__ = ["ENABLED", "preferred", "route_from_logits"]
