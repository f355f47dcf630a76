"""The Triton kernels of ``fp8_linear.fp8_gemm`` (imported on first use: the core imports no triton
until an fp8 GEMM runs). Inner loop: SGLang 0.5.23 ``_w8a8_block_fp8_matmul``
(``sglang/kernels/ops/gemm/fp8_kernel.py``, Apache-2.0), plus a row table, per-block experts and
a split of K: with ``SPLIT_K`` > 1 program (tile, s) sums K blocks s*KB_PER.. into its own fp32
partial tile, and ``split_k_sum_kernel`` adds the partials in a fixed order (no atomics: the
result does not depend on scheduling). ``fp8_swiglu_gemm_kernel``: the routed experts' first
GEMM with V4's gated SwiGLU and the activation quantisation as its epilogue (``fp8_moe``)."""

import triton
import triton.language as tl

from .fp8_bits_triton import e4m3_groups, exp2_int
from .pdl_triton import await_predecessor


@triton.jit
def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program ``pid``'s output tile (pid_m, pid_n), GROUP_M row tiles at a time (L2 reuse of the
    weight columns across neighbouring programs)."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    return first_pid_m + (pid % group_size_m), (pid % num_pid_in_group) // group_size_m


@triton.jit(do_not_specialize=["M", "stride_cs"])  # one compile for every row count
def fp8_block_gemm_kernel(
    A, As, B, Bs, C, Rows, BlockExpert,
    M, N, K, KB_PER,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, stride_cs,
    HAS_ROWS: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """C[m] = sum_k dequant(A[row(m)]) * dequant(B[e(m)])^T; row(m) = Rows[m] (-1: a zero row)
    or m; e(m) = BlockExpert[m // BLOCK_M] (-1: the block is written as zeros) or 0. Program
    (pid, s) sums K blocks s*KB_PER .. (s+1)*KB_PER-1 into C + s * stride_cs."""
    await_predecessor(PDL)
    pid_k = tl.program_id(axis=1)
    pid_m, pid_n = _grouped_tile(tl.program_id(axis=0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = C + pid_k.to(tl.int64) * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if GROUPED:
        e = tl.load(BlockExpert + pid_m).to(tl.int64)
    else:
        e = (pid_m * 0).to(tl.int64)
    if e < 0:
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=C.dtype.element_ty), mask=c_mask)
        return
    if HAS_ROWS:
        rows = tl.load(Rows + offs_m, mask=offs_m < M, other=-1)
    else:
        rows = tl.where(offs_m < M, offs_m, -1)
    row_ok = rows >= 0
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_bn = offs_n % N
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
    as_ptrs = As + rows * stride_asm
    b_ptrs = B + e * stride_be + offs_bn[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    bs_ptrs = Bs + e * stride_bse + (offs_bn // BLOCK_K) * stride_bsn

    kb_lo = pid_k * KB_PER
    kb_hi = tl.minimum(kb_lo + KB_PER, tl.cdiv(K, BLOCK_K))
    a_ptrs += kb_lo * BLOCK_K
    b_ptrs += kb_lo * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


@triton.jit(do_not_specialize=["MN"])
def split_k_sum_kernel(P, C, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """C[i] = P[0, i] + P[1, i] + ... + P[SPLIT_K - 1, i] (flat [M * N]), in that order."""
    await_predecessor(PDL)
    offs = tl.program_id(axis=0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(P + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def fp8_swiglu_gemm_kernel(
    A, As, B, Bs, Yq, Ys, Rows, BlockExpert, GateOfRow,
    M, K, IP, limit,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_ym, stride_ysm,
    CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``fp8_block_gemm_kernel`` over the stacked w1 | w3 (B [E, 2 IP, K]: w1 rows 0.., w3 rows
    IP..) with V4's gated SwiGLU and the activation quantisation as its epilogue. Program (m, n)
    computes the w1 and the w3 columns n*BLOCK_K.. of its rows (two accumulators, each summed as
    the plain kernel sums a tile), then y = silu(min(g, limit)) * clamp(u, +-limit) * gate(row)
    and the group of BLOCK_K values (= ``quantize_act``'s group): e4m3 bytes to Yq [M, IP] and the
    power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) to Ys [M, IP / BLOCK_K]. Rows of a
    block with no expert (-1) and padding rows (-1 in Rows) get y = 0, as the two-step path."""
    await_predecessor(PDL)
    num_pid_n = IP // BLOCK_K
    pid_m, pid_n = _grouped_tile(tl.program_id(axis=0), tl.cdiv(M, BLOCK_M), num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    # a block with no expert (-1) sums no K block: y = 0, stored as the two-step path stores it
    k_blocks = tl.where(e >= 0, tl.cdiv(K, BLOCK_K), 0)
    e = tl.maximum(e, 0)
    rows = tl.load(Rows + offs_m, mask=m_ok, other=-1)
    row_ok = rows >= 0
    rows = tl.where(row_ok, rows, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
    as_ptrs = As + rows * stride_asm
    bg_ptrs = B + e * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    bu_ptrs = bg_ptrs + IP * stride_bn
    bsg_ptrs = Bs + e * stride_bse + pid_n * stride_bsn
    bsu_ptrs = bsg_ptrs + num_pid_n * stride_bsn
    acc_g = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for kb in range(0, k_blocks):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        bg = tl.load(bg_ptrs, mask=k_ok[:, None], other=0.0)
        bu = tl.load(bu_ptrs, mask=k_ok[:, None], other=0.0)
        # the plain kernel's arithmetic: dot * a_s * b_s (its b_s is one value per 128 columns)
        acc_g += tl.dot(a, bg) * a_s[:, None] * tl.load(bsg_ptrs + kb)
        acc_u += tl.dot(a, bu) * a_s[:, None] * tl.load(bsu_ptrs + kb)
        a_ptrs += BLOCK_K
        bg_ptrs += BLOCK_K
        bu_ptrs += BLOCK_K
    g, u = acc_g, acc_u
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    gate = tl.load(GateOfRow + offs_m, mask=m_ok, other=0.0)
    q, ex = e4m3_groups(((g * tl.sigmoid(g)) * u) * gate[:, None], 1e-4)
    out_rows = offs_m.to(tl.int64)
    tl.store(Yq + out_rows[:, None] * stride_ym + offs_n[None, :], q, mask=m_ok[:, None])
    tl.store(Ys + out_rows * stride_ysm + pid_n, exp2_int(ex), mask=m_ok)
