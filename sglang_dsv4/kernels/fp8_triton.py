"""The Triton kernels of ``fp8_linear.fp8_gemm`` (imported on first use: the core imports no triton
until an fp8 GEMM runs). Inner loop: SGLang 0.5.23 ``_w8a8_block_fp8_matmul``
(``sglang/kernels/ops/gemm/fp8_kernel.py``, Apache-2.0), plus a row table, per-block experts and
a split of K: with ``SPLIT_K`` > 1 program (tile, s) sums K blocks s*KB_PER.. into its own fp32
partial tile, and ``split_k_sum_kernel`` adds the partials in a fixed order (no atomics: the
result does not depend on scheduling)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M", "stride_cs"])  # one compile for every row count
def fp8_block_gemm_kernel(
    A, As, B, Bs, C, Rows, BlockExpert,
    M, N, K, KB_PER,
    stride_am, stride_asm, stride_be, stride_bn, stride_bse, stride_bsn, stride_cm, stride_cs,
    HAS_ROWS: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[m] = sum_k dequant(A[row(m)]) * dequant(B[e(m)])^T; row(m) = Rows[m] (-1: a zero row)
    or m; e(m) = BlockExpert[m // BLOCK_M] (-1: the block is written as zeros) or 0. Program
    (pid, s) sums K blocks s*KB_PER .. (s+1)*KB_PER-1 into C + s * stride_cs."""
    pid = tl.program_id(axis=0)
    pid_k = tl.program_id(axis=1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

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
def split_k_sum_kernel(P, C, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """C[i] = P[0, i] + P[1, i] + ... + P[SPLIT_K - 1, i] (flat [M * N]), in that order."""
    offs = tl.program_id(axis=0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(P + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)
