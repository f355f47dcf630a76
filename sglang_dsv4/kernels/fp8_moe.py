"""Routed experts in fp8 block-128 on the GPU: two grouped ``fp8_gemm`` calls, V4's activation between.

Layout (as SGLang's fused MoE sorts tokens, ``moe_align_block_size``, but built in torch with
fixed shapes): the (token, slot) pairs are sorted by local expert, each expert's rows padded to
``block_m``; a block of ``block_m`` rows belongs to one expert (``block_expert``, -1 past the
last). GEMM 1 gathers each row's token from the quantised x (``rows``) and multiplies by w1|w3;
then V4's clamped SwiGLU (``swiglu_limit``: gate clamped above, up clamped both ways), the gate
weight (applied before w2, as ``core.ops._sorted_experts`` and [REF] ``Expert.forward`` do),
the activation quantisation; GEMM 2 multiplies by w2. Outputs go back to their pairs by a gather
and are summed over the k slots in slot order (deterministic).

SGLang's own ``fused_experts`` (``srt/layers/moe/moe_runner/triton_utils/fused_moe.py``) is not
used. It does know V4's clamp (``swiglu_limit``, asserted to be 10, through its CUDA
``silu_and_mul_clamp`` or ``act_and_mul_triton``), but it multiplies the routed weight into w2's
output (``MUL_ROUTED_WEIGHT``) or into the input of w1, while V4 weights w2's input, before that
input is quantised (the two differ once activations are quantised: the weight is not a power of
two); its module imports ``sgl_kernel`` at import and its ``moe_align_block_size`` is a CUDA op of
``sglang.kernels``, neither of which the core's GPU image has. So this module calls a Triton GEMM
twice with our activation between, the GEMM of ``fp8_linear`` (the inner loop of SGLang's block
fp8 matmul, with the fused MoE's row table and per-block experts), so that the dense and expert
paths share one kernel.

Rows per block: by default 16 below 1024 pairs and 64 from there, whatever the expert count. A
block's rows are padding beyond its expert's pairs, and each block of an expert reads that
expert's weights, so the count that matters is the rows an expert gets on average, pairs / E:
V4-Flash's 256 experts at 256 tokens get 6 each (64-row blocks: ~10x the rows' MMA work), a
43-layer model with 8 experts at 64 tokens 48 (16-row blocks: each expert's weights read 3
times; 64-row blocks 1.7-1.8x faster per GEMM, ``fp8_h200.md`` session 12). ``EXPERT_BLOCKS``
(on by default since session 36, ``SGLANG_DSV4_EXPERT_BLOCKS=0`` off) takes 64 rows from 32 pairs
an expert on average, 16 below; the flash8 (32 experts) cases keep their blocks at batch 1 to 256
(its step at batch 1 was level with it); with the other three kernels switched on then (session
36, H100), flash43's batch-64 step went from 21.80 to 19.83 ms.

Shapes depend only on (T, k, local experts): no host sync, CUDA-graph capturable. Pairs routed
to experts another rank holds (expert parallelism) are dropped; their output is zero.

The shared expert can join the stack as its last member (``stack_fp8_experts(shared=...)``,
opt-in ``SGLANG_DSV4_FOLD_SHARED=1``): every token then routes one more slot to it with gate 1
(``core.ops.moe``), and the same two grouped GEMMs compute it beside the routed experts, instead
of three dense GEMMs and two fused regions of its own (about 5 launches a layer). Its SwiGLU is
the routed experts' (V4 clamps both alike) and a gate of 1 changes no bit; the output is the k
routed slots and then the shared one, summed.

The gated SwiGLU and its quantisation can run as GEMM 1's epilogue (``fp8_triton.
fp8_swiglu_gemm_kernel``, on by default, ``SGLANG_DSV4_MOE_FUSED_SWIGLU=0`` off): a program computes
128 w1 and the matching 128 w3 columns of its rows, so the activation's quantisation group is whole
in it. GEMM 1's float32 output (a write and a read of [M, 2 Ip] floats a layer) and the region
between the GEMMs go. Only where GEMM 1 needs no split of K (``split_k``; from about 8 tokens a step
at V4-Flash's sizes): a split's partial sums would have to meet before the SwiGLU. With
``SWIGLU_ONE_WAVE`` (on by default since session 38, ``SGLANG_DSV4_SWIGLU_ONE_WAVE=0`` off) also
where its grid fills the SMs once though ``split_k`` would split (8 experts at 4-64 tokens): the
kernel then sums all of K itself. On an H100 that GEMM 1 + SwiGLU took 55.0 -> 51.4 us at 4
tokens, 57.1 -> 52.0 at 16 and 81.3 -> 55.5 at 64 (``bench_fp8_gemm --swiglu --swiglu-everywhere``),
and flash43's step (1K, fp8, graphs) 15.29 -> 14.94 ms at batch 16, 22.71 -> 21.56 at 64.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.compiled import on_gpu
from ..quant import FP8_WEIGHT_BLOCK
from . import moe_layout
from .expert_rows import expert_rows
from .fp8_linear import (Fp8Act, Fp8Weight, add_splits, fp8_gemm, quantize_act, runs_kernel,
                         sm_count, split_k)
from .triton_support import pdl_options

Tensor = torch.Tensor

# Whether a single-process model folds each layer's shared expert into its expert stack (module
# docstring); read when the model stacks its experts (``V4Model``). Opt-in: no faster at batch 1,
# 16 or 256 on an H100 (session 32), 1.7% at 64.
FOLD_SHARED = os.environ.get("SGLANG_DSV4_FOLD_SHARED", "0") == "1"
# Whether GEMM 1 takes the SwiGLU and quantisation as its epilogue where it can (module docstring);
# read per call; on by default since session 32 (no slower at batch 1 and 16, the bigger batches
# lose GEMM 1's float32 output).
FUSED_SWIGLU = os.environ.get("SGLANG_DSV4_MOE_FUSED_SWIGLU", "1") == "1"
# Whether the rows per expert block follow the pairs a local expert gets (module docstring); read
# per call; on by default (``bench_fp8_gemm --blocks``, ``bench_decode --switches``).
EXPERT_BLOCKS = os.environ.get("SGLANG_DSV4_EXPERT_BLOCKS", "1") == "1"
# Whether GEMM 1 takes the SwiGLU epilogue wherever its grid fills the SMs once, rather than only
# where ``split_k`` leaves K whole (about two waves): a 43-layer model's 8 experts at 4-64 tokens
# fill one wave of 128-column programs, which the split runs as two half-K waves and a region
# (``swiglu_epilogue_fits``); read per call, on by default (module docstring)
SWIGLU_ONE_WAVE = os.environ.get("SGLANG_DSV4_SWIGLU_ONE_WAVE", "1") == "1"
# The SwiGLU GEMM's launch: warps (0: 8 for 64-row blocks, else 4) and pipeline stages; read per
# launch (``bench_fp8_gemm --swiglu --swiglu-configs`` times others)
SWIGLU_WARPS, SWIGLU_STAGES = 0, 3


@dataclass(frozen=True)
class Fp8Experts:
    """A layer's local routed experts stacked for the grouped GEMM: ``w13`` [E, 2 Ip, D] (w1 rows
    0..I-1, w3 rows Ip..Ip+I-1, Ip = I rounded up to 128, zero rows between) and ``w2`` [E, D, I].
    ``shared``: the last of the E is the layer's shared expert (the others are routed)."""

    w13: Fp8Weight
    w2: Fp8Weight
    inter: int
    shared: bool = False

    @property
    def inter_padded(self) -> int:
        return self.w13.q.shape[1] // 2

    @property
    def num_experts(self) -> int:
        return self.w13.q.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


def stack_fp8_experts(w1: list[Fp8Weight], w3: list[Fp8Weight], w2: list[Fp8Weight],
                      shared: tuple[Fp8Weight, Fp8Weight, Fp8Weight] | None = None
                      ) -> tuple[Fp8Experts, list[tuple[Fp8Weight, Fp8Weight, Fp8Weight]]]:
    """Stack per-expert fp8 matrices -> (the stack, per expert (w1, w3, w2) views of it).
    ``shared``: the shared expert's (w1, w3, w2), stacked last (its views come last too); its
    matrices must have the routed experts' shapes."""
    if shared is not None:
        if any(s.q.shape != r[0].q.shape for s, r in zip(shared, (w1, w3, w2))):
            raise ValueError(f"the shared expert's matrices {[tuple(s.q.shape) for s in shared]} do not have the "
                             f"routed experts' shapes {[tuple(r[0].q.shape) for r in (w1, w3, w2)]}: not stacked")
        w1, w3, w2 = w1 + [shared[0]], w3 + [shared[1]], w2 + [shared[2]]
    inter, dim = w1[0].q.shape
    ip = math.ceil(inter / FP8_WEIGHT_BLOCK) * FP8_WEIGHT_BLOCK
    E, dev = len(w1), w1[0].device
    q13 = torch.zeros(E, 2 * ip, dim, dtype=torch.float8_e4m3fn, device=dev)
    s13 = torch.cat((torch.stack([w.scale for w in w1]), torch.stack([w.scale for w in w3])), dim=1)
    for i, (a, b) in enumerate(zip(w1, w3)):
        q13[i, :inter] = a.q
        q13[i, ip:ip + inter] = b.q
    stack = Fp8Experts(Fp8Weight(q13, s13.contiguous()),
                       Fp8Weight(torch.stack([w.q for w in w2]), torch.stack([w.scale for w in w2])), inter,
                       shared=shared is not None)
    nb = ip // FP8_WEIGHT_BLOCK
    views = [(Fp8Weight(stack.w13.q[i, :inter], stack.w13.scale[i, :nb]),
              Fp8Weight(stack.w13.q[i, ip:ip + inter], stack.w13.scale[i, nb:]),
              Fp8Weight(stack.w2.q[i], stack.w2.scale[i])) for i in range(E)]
    return stack, views


PAIRS_AN_EXPERT_FOR_64 = 32  # pairs an expert gets on average from which its blocks take 64 rows


def block_rows(pairs: int, experts: int | None = None) -> int:
    """Rows per expert block: 16 for decode-sized batches, 64 for prefill-sized ones (1024 pairs
    on). With ``EXPERT_BLOCKS`` and the local expert count, by the rows an expert gets on average
    instead: 64 from ``PAIRS_AN_EXPERT_FOR_64`` pairs an expert (each expert's weights read by
    fewer blocks), else 16 (less padding; module docstring)."""
    if EXPERT_BLOCKS and experts:
        return 64 if pairs >= PAIRS_AN_EXPERT_FOR_64 * experts else 16
    return 16 if pairs < 1024 else 64


def grouped_rows(pairs: int, experts: int) -> tuple[int, int]:
    """(rows per expert block, rows of the grouped GEMMs) for ``pairs`` (token, slot) pairs over
    ``experts`` local experts: room for every expert's padding, a whole number of blocks."""
    A = block_rows(pairs, experts)
    return A, math.ceil((pairs + min(pairs, experts) * (A - 1)) / A) * A


def fp8_grouped_experts(x: Tensor, chosen: Tensor, gates: Tensor, experts: Fp8Experts, first_expert: int,
                        limit: float, act: Fp8Act | None = None) -> Tensor:
    """sum_k gates[t, k] * expert_{chosen[t, k]}(x[t]) over the local experts
    ``first_expert .. first_expert + E - 1`` -> [T, D] in x's dtype. ``act``: x's quantisation
    computed already (``fp8_linear.Fp8Act``).

    Between the two GEMM launches the work is one kernel and two fused regions on the GPU: the
    row layout with each row's token and gate (``moe_layout``; a fused region past its pair
    count), V4's activation with its quantisation, and the slot sum (``core.compiled``; about 70
    small kernels per layer as separate torch ops)."""
    T, k = chosen.shape
    E, P = experts.num_experts, chosen.numel()
    A, M = grouped_rows(P, E)
    layout = moe_layout.row_layout if moe_layout.preferred(chosen, E) else _row_layout  # one launch on the GPU
    token_of_row, block_expert, dest_of_pair, gate_of_row = layout(chosen, gates, first_expert, E, A, M)
    xq, xs = quantize_act(x) if act is None else act
    if FUSED_SWIGLU and swiglu_epilogue_fits(M, experts, A, x.device):
        yq, ys = swiglu_gemm(xq, xs, experts, token_of_row, block_expert, gate_of_row, A, limit)
    else:  # each GEMM's split-K partials (if K is split) are added by the region after it
        h = fp8_gemm(xq, xs, experts.w13, torch.float32, rows=token_of_row, block_expert=block_expert, block_m=A,
                     sum_splits=False)
        yq, ys = _gated_swiglu_quantised(h, gate_of_row, experts.inter, experts.inter_padded, limit)
    out = fp8_gemm(yq, ys, experts.w2, x.dtype, block_expert=block_expert, block_m=A, sum_splits=False)
    return _sum_slots(out, dest_of_pair, k, x.dtype)


@on_gpu(rows={"chosen": (0,), "gates": (0,)})
def _row_layout(chosen: Tensor, gates: Tensor, first_expert: int, num_experts: int, block_m: int,
                num_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The grouped GEMMs' row layout (``expert_rows``, groups padded to ``block_m``) -> (token of
    each row [M] int32, -1 padding; expert of each block of rows [M / block_m] int32, -1 past the
    last group; row of each (token, slot) pair [P], M for a pair held elsewhere; gate of each row
    [M] float32, 0 for padding)."""
    k, P, E = chosen.shape[1], chosen.numel(), num_experts
    rows = expert_rows(chosen, first_expert, E, block_m, num_rows)
    block_start = torch.arange(0, num_rows, block_m, device=chosen.device)
    block_expert = torch.searchsorted(rows.ends, block_start, right=True)     # E: past the last group
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    token_of_row = torch.where(rows.pair_of_row < P, rows.pair_of_row // k, -1).to(torch.int32)
    gate_of_row = torch.cat((gates.flatten().float(), gates.new_zeros(1, dtype=torch.float32)))[rows.pair_of_row]
    return token_of_row, block_expert, rows.dest_of_pair, gate_of_row


@on_gpu(rows={"h": (-2,), "gate_of_row": (0,)})
def _gated_swiglu_quantised(h: Tensor, gate_of_row: Tensor, inter: int, inter_padded: int,
                            limit: float) -> tuple[Tensor, Tensor]:
    """GEMM 1's rows [M, 2 Ip] (w1 | w3; or its split-K partials [S, M, 2 Ip]) -> V4's clamped
    SwiGLU times the row's gate, quantised for GEMM 2 (``quantize_act``)."""
    if h.dim() == 3:
        h = add_splits(h, torch.float32)
    g, u = h[:, :inter], h[:, inter_padded:inter_padded + inter]
    if limit > 0:  # swiglu_limit 0 means no clamp
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return quantize_act((F.silu(g) * u) * gate_of_row[:, None])


def swiglu_epilogue_fits(num_rows: int, experts: Fp8Experts, block_m: int, device: torch.device) -> bool:
    """Whether GEMM 1 of ``num_rows`` rows can take the SwiGLU as its epilogue here: the kernel
    runs (CUDA, or the interpreter) and its tiles (``block_m`` rows x 128 w1 and 128 w3 columns)
    fill the SMs without splitting K (with ``SWIGLU_ONE_WAVE``: fill them once). Shapes only (CUDA
    graphs)."""
    if not runs_kernel(device):
        return False
    tiles = -(-num_rows // block_m) * (experts.inter_padded // FP8_WEIGHT_BLOCK)
    if SWIGLU_ONE_WAVE:
        return tiles >= sm_count(device)
    return split_k(tiles, -(-experts.w13.q.shape[-1] // FP8_WEIGHT_BLOCK), sm_count(device))[0] == 1


@torch.compiler.disable  # a kernel launch, never traced
def swiglu_gemm(xq: Tensor, xs: Tensor, experts: Fp8Experts, token_of_row: Tensor, block_expert: Tensor,
                gate_of_row: Tensor, block_m: int, limit: float) -> tuple[Tensor, Tensor]:
    """GEMM 1 with its epilogue: ``_gated_swiglu_quantised`` of ``fp8_gemm``'s w1 | w3 rows, in one
    launch -> (e4m3 [M, Ip], float32 scales [M, Ip / 128]), GEMM 2's input (``quantize_act``'s
    layout). The same GEMM arithmetic; the SwiGLU and the rounding are the kernel's own
    (``fp8_bits_triton``: round to nearest even, power-of-two scales)."""
    from .fp8_triton import fp8_swiglu_gemm_kernel

    M, ip, w = token_of_row.shape[0], experts.inter_padded, experts.w13
    yq = torch.empty(M, ip, dtype=torch.float8_e4m3fn, device=xq.device)
    ys = torch.empty(M, ip // FP8_WEIGHT_BLOCK, dtype=torch.float32, device=xq.device)
    grid = (-(-M // block_m) * (ip // FP8_WEIGHT_BLOCK),)
    fp8_swiglu_gemm_kernel[grid](
        xq, xs, w.q, w.scale, yq.view(torch.uint8), ys, token_of_row, block_expert, gate_of_row,
        M, w.q.shape[-1], ip, float(limit),
        xq.stride(0), xs.stride(0), w.q.stride(0), w.q.stride(1), w.scale.stride(0), w.scale.stride(1),
        yq.stride(0), ys.stride(0),
        CLAMP=limit > 0, BLOCK_M=block_m, BLOCK_K=FP8_WEIGHT_BLOCK, GROUP_M=8,
        num_warps=SWIGLU_WARPS or (8 if block_m >= 64 else 4), num_stages=SWIGLU_STAGES, **pdl_options(xq))
    return yq, ys


@on_gpu(rows={"out": (-2,), "dest_of_pair": (0,)})
def _sum_slots(out: Tensor, dest_of_pair: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """GEMM 2's rows [M, D] in ``dtype`` (or its fp32 split-K partials [S, M, D]) -> each token's
    sum over its k slots, in slot order (deterministic); a pair held elsewhere (row M) adds zero."""
    if out.dim() == 3:
        out = add_splits(out, dtype)
    pairs = torch.cat((out, out.new_zeros(1, out.shape[1])))[dest_of_pair]
    return pairs.view(-1, k, out.shape[1]).sum(1)


__all__ = ["EXPERT_BLOCKS", "FOLD_SHARED", "FUSED_SWIGLU", "SWIGLU_ONE_WAVE", "Fp8Experts", "stack_fp8_experts", "fp8_grouped_experts", "block_rows",
           "grouped_rows", "swiglu_epilogue_fits", "swiglu_gemm"]
