"""The Triton kernel of ``fp8_weight_only.grouped_weight_only_linear``: bf16 activations times
fp8 block-128 weights widened to bf16 in registers (imported on first use)."""

import triton
import triton.language as tl

from .pdl_triton import await_predecessor


@triton.jit(do_not_specialize=["T", "stride_xt", "stride_ot"])  # one compile for every row count
def grouped_weight_only_kernel(
    X, W, Ws, Out,
    T, KB_PER, NUM_PID_M,
    stride_xt, stride_xg, stride_wn, stride_wsn, stride_ot, stride_og, stride_os,
    R: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Out[s, t, g, n] = sum over K blocks s*KB_PER.. of X[t, g, k] * dequant(W)[g R + n, k].

    X [T, G, K] bf16; W [G R, K] e4m3 with one power-of-two scale per 128x128 block. A weight
    value widened to bf16 is exact, and a power-of-two scale commutes with the fp32 sums, so each
    K block's ``dot(x, w) * scale`` is the bf16 matrix's product (the model's einsum) up to the
    order of the fp32 additions. Program (pid, s): output tile pid (row blocks innermost: the
    programs that share a weight tile run side by side), K split s. ``FP32_DOT``: both
    operands widened to fp32 for an IEEE dot (the same exact products and fp32 sums; Triton's
    interpreter, whose bf16 dot is wrong)."""
    await_predecessor(PDL)
    pid = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)
    pid_m = pid % NUM_PID_M
    col_tile = pid // NUM_PID_M  # over G * R / BLOCK_N
    g = col_tile // (R // BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (col_tile % (R // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < T
    w_rows = (g * R + offs_n).to(tl.int64)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xt + g * stride_xg + offs_k[None, :]
    w_ptrs = W + w_rows[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    ws_ptrs = Ws + (w_rows // BLOCK_K) * stride_wsn
    kb_lo = pid_k * KB_PER
    kb_hi = tl.minimum(kb_lo + KB_PER, K // BLOCK_K)
    x_ptrs += kb_lo * BLOCK_K
    w_ptrs += kb_lo * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        if FP32_DOT:
            prod = tl.dot(x.to(tl.float32), tl.load(w_ptrs).to(tl.float32), input_precision="ieee")
        else:
            prod = tl.dot(x, tl.load(w_ptrs).to(tl.bfloat16))
        acc += prod * tl.load(ws_ptrs + kb)[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = (Out + pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_ot + g * stride_og
                + offs_n[None, :])
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None])
