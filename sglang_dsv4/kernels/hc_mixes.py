"""The hyper-connection mixes' GEMM on the GPU: a split-K Triton kernel with its sum of squares.

``ops.hc_mixes`` is ``(h @ fn^T) * rsqrt(mean(h^2) + eps)`` over each token's flattened streams
(v4_architecture.md §5.3): at V4-Flash width a [T, 16384] x [16384, 24] fp32 product. cuBLAS
runs it as one SIMT sgemm with few programs (N = 24): ~57 us a call at batch 256 on an H200,
~1 ms of the step over its 17 calls (session-10 census), about ten times the time to read h.
Here K is cut into ``splits`` chunks, one program per (row block, chunk), each writing its
partial dots and sum of squares; the caller adds the partials in chunk order inside its fused
epilogue. The dots run on the tensor cores as three TF32 products ("tf32x3": each operand split
into a TF32 head and a TF32 remainder, the remainders' product dropped), within a few fp32 ulps
of fp32 dots, as DeepSeek's own and SGLang's mixes kernels do with TF32. The split and the tiles
depend on the shapes only (CUDA graphs).

The CPU (the oracle path) keeps the torch GEMM; this runs on CUDA tensors, and on CPU tensors
under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import functools

import torch

from .fp8_linear import INTERPRET, _sm_count

Tensor = torch.Tensor

BLOCK_K = 64
PROGRAM_WAVES = 2     # programs per SM the split aims for
MIN_CHUNK_BLOCKS = 2  # K blocks a program sums at least (its partials cost a write and a read)


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        from . import hc_mixes_triton  # noqa: F401
    except Exception:  # ImportError, or triton failing to initialise
        return False
    return True


def supported(h: Tensor, fn: Tensor) -> bool:
    """Whether ``mixes_partials`` runs for these operands (fp32 CUDA tensors with K a multiple
    of ``BLOCK_K``, or the interpreter)."""
    return ((h.is_cuda or INTERPRET) and h.dtype == fn.dtype == torch.float32 and h.dim() == 2
            and h.shape[1] == fn.shape[1] and h.shape[1] % BLOCK_K == 0 and fn.shape[0] <= 64 and _triton_ok())


def block_rows(tokens: int) -> int:
    return 16 if tokens <= 16 else 32 if tokens <= 32 else 64


def splits(tokens: int, k: int, sms: int) -> int:
    """Chunks K is cut into: a power of two that gives about ``PROGRAM_WAVES`` waves of
    programs, each chunk at least ``MIN_CHUNK_BLOCKS`` blocks (and dividing K)."""
    row_blocks = -(-tokens // block_rows(tokens))
    s = 1
    while (s * 2 * row_blocks <= PROGRAM_WAVES * sms and k % (s * 2 * BLOCK_K) == 0
           and k // (s * 2) >= MIN_CHUNK_BLOCKS * BLOCK_K):
        s *= 2
    return s


@torch.compiler.disable  # a kernel launch: a compiled caller breaks its graph around it
def mixes_partials(h: Tensor, fn: Tensor) -> tuple[Tensor, Tensor]:
    """h [T, K], fn [N, K] (fp32) -> (partial dots [S, T, NP] with columns :N meaningful,
    partial sums of squares [S, T]), K cut into S chunks in order."""
    from .hc_mixes_triton import mixes_partials_kernel

    T, K = h.shape
    N = fn.shape[0]
    NP = max(16, 1 << (N - 1).bit_length())
    S = splits(T, K, _sm_count(h.device))
    part = torch.empty(S, T, NP, dtype=torch.float32, device=h.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=h.device)
    if T == 0:
        return part, sq
    bt = block_rows(T)
    mixes_partials_kernel[(-(-T // bt), S)](
        h.contiguous(), fn.contiguous(), part, sq, T, K // S, K=K, N=N, NP=NP, BLOCK_T=bt, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if INTERPRET else "tf32x3", num_warps=4)
    return part, sq


__all__ = ["mixes_partials", "supported", "splits"]
