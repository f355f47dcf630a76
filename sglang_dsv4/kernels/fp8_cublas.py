"""The dense fp8 block-128 GEMM through cuBLAS where it is faster (on by default;
``SGLANG_DSV4_FP8_GEMM=triton`` keeps the Triton kernel everywhere).

``fp8_linear.fp8_gemm``'s Triton kernel (SGLang's block-fp8 inner loop) streams the weights near
their bytes at small batches, but where a step's GEMMs are compute-limited it reaches about a
third of an H100's fp8 peak (session 27's census at batch 256: the dense GEMMs 1.17 ms, the
expert GEMMs 3.4 ms). cuBLAS (CUDA >= 12.9) runs DeepSeek's recipe itself, activations scaled
per 1x128 and weights per 128x128 block, promoted to fp32 per K block; torch exposes it as
``torch._scaled_mm`` with the scale layouts cuBLASLt requires (A's scales [M, K/128] column-major,
B's [K/128, N/128] column-major with K/128 a multiple of 4). Same math as the Triton kernel, to
fp32 rounding (another accumulation order).

Only the dense, ungathered GEMM (no row table, no experts) takes it, where K / 128 is a multiple
of 4, N of 128 and M of 4 (CUDA 13.0's cuBLASLt on an H100 refuses M = 1, 2, 3, 5, 17 with
CUBLAS_STATUS_NOT_SUPPORTED and takes 4, 8, 12, 16, 24, ..., 100, 256: session 31's probe), and
only where it is faster (``faster``: from 64 rows and half a million outputs). Before a model's
first GEMM (``fp8_linear.prepare``, from ``V4Model``) the library is checked against the Triton
kernel on a small case, once per device; the Triton kernel stays if it raises or disagrees, so a
torch or CUDA without the recipe, or a scale layout it reads otherwise, costs nothing but the
log line. The choice is fixed before anything is traced or captured (the torch op's fake must give
the launch's shape). ``benchmarks/bench_fp8_gemm.py --cublas`` times the two side by side.
"""

from __future__ import annotations

import logging
import os

import torch

from ..quant import FP8_WEIGHT_BLOCK

logger = logging.getLogger(__name__)
Tensor = torch.Tensor

# on since session 31: the planned shapes gave the Triton kernel's bits and 1.6-2.5x its speed
# (bench_fp8_gemm --cublas, H200), flash8's batch-64/256 steps 4-5% faster (decode_h200.md)
REQUESTED = os.environ.get("SGLANG_DSV4_FP8_GEMM", "cublas") == "cublas"
_checked: dict[int, bool] = {}  # device index -> whether cuBLAS passed its check (``check_device``)


def shape_ok(M: int, N: int, K: int) -> bool:
    """Whether cuBLAS's block-scaled GEMM takes [M, K] x [N, K]^T (its scale layouts need K / 128
    a multiple of 4; whole 128-row weight blocks; rows in fours, or cuBLASLt finds no algorithm)."""
    return M > 0 and M % 4 == 0 and K % (4 * FP8_WEIGHT_BLOCK) == 0 and N % FP8_WEIGHT_BLOCK == 0


def faster(M: int, N: int) -> bool:
    """Whether cuBLAS beats the Triton kernel on an [M, N] output (session 31, H200,
    ``bench_fp8_gemm --cublas``): from 64 rows and half a million outputs (wq_b 1.6x at 64 and 256
    rows, wo_b / the shared expert's 1.7-1.9x at 256, idx_wq_b 2.5x at 256); below, its fixed ~15 us
    loses (0.45-0.9x: wq_a, wkv at any batch, everything at 4 rows), and at 4 rows its result was
    also 1e-4 to 5e-3 off the Triton kernel's where 64 and 256 rows gave the same bits."""
    return M >= 64 and M * N >= 1 << 19


def planned(M: int, N: int, K: int, device: torch.device, enabled: bool | None = None) -> bool:
    """Whether ``fp8_gemm`` hands a dense [M, K] x [N, K]^T GEMM to cuBLAS: requested (``enabled``
    None: ``SGLANG_DSV4_FP8_GEMM``), a CUDA device whose check passed, the shape taken and faster
    there. From shapes and the check's cached result only, so the fake of the torch op agrees with
    the launch."""
    if not (REQUESTED if enabled is None else enabled) or device.type != "cuda":
        return False
    if not (shape_ok(M, N, K) and faster(M, N)):
        return False
    return _checked.get(device.index if device.index is not None else torch.cuda.current_device(), False)


def block_scaled_mm(a_q: Tensor, a_s: Tensor, w_q: Tensor, w_s: Tensor, out_dtype: torch.dtype) -> Tensor:
    """[M, N] = (a_q * a_s per 1x128) @ (w_q * w_s per 128x128)^T in fp32, as ``out_dtype``:
    a_q [M, K] e4m3, a_s [M, K/128] float32, w_q [N, K] e4m3, w_s [N/128, K/128] float32."""
    scale_a = a_s.t().contiguous().t()  # column-major [M, K/128]
    return torch._scaled_mm(a_q, w_q.t(), scale_a=scale_a, scale_b=w_s.t(), out_dtype=out_dtype)


def check_device(device: torch.device, triton_gemm) -> bool:
    """The check of ``device`` (once; cached): cuBLAS against ``triton_gemm(a_q, a_s, w_q, w_s)``
    on a 64 x 512 x 256 case, within 1e-3 of its largest value. -> whether cuBLAS passed. Eager
    only: not while a CUDA graph is captured or a function traced (ValueError)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _checked:
        return _checked[idx]
    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        raise ValueError("the cuBLAS fp8 check runs eagerly, before a model's graphs are traced or captured")
    g = torch.Generator(device=device).manual_seed(0)
    M, N, K = 64, 256, 512
    a_q = (torch.randn(M, K, generator=g, device=device) * 32).to(torch.float8_e4m3fn)
    a_s = torch.exp2(torch.randint(-8, -4, (M, K // FP8_WEIGHT_BLOCK), generator=g, device=device).float())
    w_q = (torch.randn(N, K, generator=g, device=device) * 32).to(torch.float8_e4m3fn)
    w_s = torch.exp2(torch.randint(-8, -4, (N // FP8_WEIGHT_BLOCK, K // FP8_WEIGHT_BLOCK), generator=g,
                                   device=device).float())
    try:
        got = block_scaled_mm(a_q, a_s, w_q, w_s, torch.float32)
        want = triton_gemm(a_q, a_s, w_q, w_s)
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        ok = err < 1e-3
        why = f"max relative difference {err:.1e} from the Triton kernel"
    except Exception as e:  # no block-scaled recipe in this torch / cuBLAS
        ok, why = False, f"{type(e).__name__}: {e}"
    _checked[idx] = ok
    logger.info("fp8 dense GEMMs: %s (cuBLAS block-scaled check: %s)", "cuBLAS" if ok else "the Triton kernel", why)
    return ok


__all__ = ["REQUESTED", "shape_ok", "faster", "planned", "block_scaled_mm", "check_device"]
