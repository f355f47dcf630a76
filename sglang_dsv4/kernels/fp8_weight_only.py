"""V4's grouped output projection ``attn.wo_a`` with its weights held fp8: one grouped GEMM of
bf16 activations times the fp8 block-128 matrix widened to bf16 in registers.

The reference (DeepSeek's ``convert.py``, upstream SGLang without DeepGEMM) dequantises wo_a to
bf16 once and runs ``einsum("tgd,grd->tgr")`` in bf16 (v4_architecture.md §2.5). Widening an
e4m3 value times its power-of-two block scale to bf16 is exact, so the kernel multiplies the same
bf16 matrix as the einsum, read at half its bytes (flash43, batch 64, H100: the einsum 30.5 us a
layer against 11.2 for the fp8 bytes, session 41's census); only the fp32 summation order
differs. The activations are not quantised (unlike the other fp8 GEMMs: V4's QAT quantises the
inputs of its fp8 linears, not wo_a's einsum).

The Triton kernel (``fp8_weight_only_triton``) reads x [T, G, K] in place: group g's rows are
strided slices of the heads, so there is nothing to pad, transpose or quantise before it. Where
the output tiles are too few to keep the SMs streaming the weight, K is split
(``fp8_linear.split_k``) into fp32 partials that a compiled caller adds inside its next kernel
(``fp8_linear.add_splits``), or ``fp8_linear.sum_splits_into`` adds in the same order. Shapes
alone decide the launch (CUDA graphs; the deterministic mode's fixed tiles).

Opt-in (``fp8_linear.GROUPED_WO_A``): on an H100 (session 42, ``bench_fp8_gemm --wo-a``) it takes
22.2 us against the einsum's 24.1 at 1 token but 39-40 against 26.7 at 64 (3.5x its bytes; no tile,
split or swapped product did better), where cuBLAS reads the bf16 matrix at 1.2x its bytes.
"""

from __future__ import annotations

import torch

from ..quant import FP8_WEIGHT_BLOCK
from .fp8_linear import Fp8Weight, add_splits, groups_fit, runs_kernel, sm_count, split_k, sum_splits_into
from .triton_support import INTERPRET, pdl_options

Tensor = torch.Tensor
ACT_DTYPE = torch.bfloat16  # the einsum's operand dtype (the reference's bf16 wo_a)


def launch_config(T: int) -> dict[str, int]:
    """The tile launch for T rows: row blocks of 16 / 32 / 64, 64 output columns, 4 warps, 4
    stages (shapes only): the best of ``bench_fp8_gemm --wo-a``'s 48 launches at 64 tokens and
    within 3% of it at 1 (H100, session 42; the product swapped, W X^T, measured level and left out)."""
    block_m = 16 if T <= 16 else 32 if T <= 32 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=FP8_WEIGHT_BLOCK, num_warps=4, num_stages=4)


def plan(T: int, G: int, R: int, K: int, device: torch.device,
         config: dict[str, int] | None = None, splits: int | None = None) -> tuple[dict[str, int], int, int, int, int]:
    """(tile config, row blocks, output tiles, K splits, K blocks a split) of a launch;
    ``config`` / ``splits``: a harness's override of the rule (``benchmarks/bench_fp8_gemm.py --wo-a``)."""
    cfg = dict(config or launch_config(T))
    row_blocks = -(-T // cfg["BLOCK_M"])
    tiles = row_blocks * G * (R // cfg["BLOCK_N"])
    k_blocks = K // cfg["BLOCK_K"]
    if splits is None:
        splits, per = split_k(tiles, k_blocks, sm_count(device))
    else:
        per = -(-k_blocks // splits)
        splits = -(-k_blocks // per)
    return cfg, row_blocks, tiles, splits, per


def _check(x: Tensor, w: Fp8Weight) -> tuple[int, int, int, int]:
    T, G, K = x.shape
    R = w.q.shape[0] // G
    if w.q.dim() != 2 or w.q.shape[1] != K or not groups_fit(w.q.shape[0], K, G):
        raise ValueError(f"grouped_weight_only_linear: a {list(w.q.shape)} fp8 matrix does not split into {G} "
                         f"groups of 128-row blocks over {K} inputs")
    return T, G, R, K


@torch.compiler.disable  # eager callers; a compiled one reaches the launch through the op below
def grouped_weight_only(x: Tensor, w: Fp8Weight, sum_splits: bool = True, config: dict[str, int] | None = None,
                        splits: int | None = None) -> Tensor:
    """x [T, G, K] (bf16) -> [T, G, R] bf16 by the Triton kernel: group g's rows times
    dequant(w[g R:(g+1) R]).T, summed in fp32. ``sum_splits=False``: where K is split, the fp32
    partials [S, T, G, R] instead (``add_splits``)."""
    from .fp8_weight_only_triton import grouped_weight_only_kernel

    T, G, R, K = _check(x, w)
    cfg, row_blocks, tiles, n_split, per = plan(T, G, R, K, x.device, config, splits)
    out = torch.empty(T, G, R, dtype=ACT_DTYPE, device=x.device)
    if T == 0:
        return out
    x = x.to(ACT_DTYPE)
    if x.stride(2) != 1:
        x = x.contiguous()
    # the interpreter casts fp32 to bf16 by truncation and its bf16 dot is wrong: there fp32
    # operands and partials, which torch adds and rounds
    interpreted = INTERPRET and not x.is_cuda
    part = out if n_split == 1 and not interpreted else \
        torch.empty(n_split, T, G, R, dtype=torch.float32, device=x.device)
    grouped_weight_only_kernel[(tiles, n_split)](
        x, w.q, w.scale, part, T, per, row_blocks,
        x.stride(0), x.stride(1), w.q.stride(0), w.scale.stride(0), G * R, R, T * G * R,
        R=R, K=K, FP32_DOT=interpreted, **cfg, **pdl_options(x))
    if part is out or (n_split > 1 and not sum_splits):
        return part
    if interpreted:
        return add_splits(part, ACT_DTYPE)
    sum_splits_into(part, out)
    return out


@torch.library.custom_op("sglang_dsv4::grouped_weight_only", mutates_args=())
def grouped_weight_only_op(x: Tensor, wq: Tensor, ws: Tensor, sum_splits: bool = True) -> Tensor:
    """``grouped_weight_only`` with the weight as its two tensors, as a torch op: a compiled
    region goes on around it (Inductor adds the partials inside the next kernel)."""
    return grouped_weight_only(x, Fp8Weight(wq, ws), sum_splits)


@grouped_weight_only_op.register_fake
def _grouped_weight_only_shape(x: Tensor, wq: Tensor, ws: Tensor, sum_splits: bool = True) -> Tensor:
    """What the op returns, from shapes: [T, G, R] bf16, or the fp32 partials [S, T, G, R]."""
    T, G, K = x.shape
    R = wq.shape[0] // G
    if T and not sum_splits:
        n_split = plan(T, G, R, K, x.device)[3]
        if n_split > 1:
            return x.new_empty(n_split, T, G, R, dtype=torch.float32)
    return x.new_empty(T, G, R, dtype=ACT_DTYPE)


def grouped_weight_only_reference(x: Tensor, w: Fp8Weight) -> Tensor:
    """What the kernel computes, as the model's bf16 path does it: the einsum of x in bf16 and the
    matrix dequantised to bf16 (exact), -> [T, G, R] bf16."""
    T, G, R, K = _check(x, w)
    return torch.einsum("tgk,grk->tgr", x.to(ACT_DTYPE), w.dequantize(ACT_DTYPE).view(G, R, K))


def grouped_weight_only_linear(x: Tensor, w: Fp8Weight) -> Tensor:
    """x [T, G, K] -> [T, G, R] in x's dtype: group g's rows x[:, g] @ dequant(w[g R:(g+1) R]).T
    for w [G R, K] (``fp8_linear.groups_fit``), in bf16 operands with fp32 sums: the bf16 wo_a's
    einsum. The kernel on the GPU (and under the interpreter), the einsum elsewhere."""
    if not runs_kernel(x.device):
        return grouped_weight_only_reference(x, w).to(x.dtype)
    if not (torch.compiler.is_compiling() and isinstance(x.shape[0], int)):
        return grouped_weight_only(x, w).to(x.dtype)  # the sum kernel adds any split partials
    out = grouped_weight_only_op(x, w.q, w.scale, sum_splits=False)
    return (add_splits(out, ACT_DTYPE) if out.dim() == 4 else out).to(x.dtype)


__all__ = ["grouped_weight_only_linear", "grouped_weight_only", "grouped_weight_only_op",
           "grouped_weight_only_reference", "launch_config", "plan"]
