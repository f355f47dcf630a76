"""The Triton kernel of ``hc_mixes.mixes_partials`` (imported on first use, as ``fp8_triton``)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "CHUNK"])
def mixes_partials_kernel(
    H, Fn, Part, Sq, T, CHUNK,
    K: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (i, s): for rows i*BLOCK_T.. of H [T, K] and columns s*CHUNK..(s+1)*CHUNK, the
    partial dots with every row of Fn [N, K] -> Part[s, t, :N] and the partial sum of squares
    -> Sq[s, t]. Rows past T and columns past N load zeros (and are not stored)."""
    pt = tl.program_id(axis=0)
    s = tl.program_id(axis=1)
    t = (pt * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    n = tl.arange(0, NP)
    tm, nm = t < T, n < N
    acc = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    k0 = s.to(tl.int64) * CHUNK
    for kk in range(0, CHUNK, BLOCK_K):
        k = k0 + kk + tl.arange(0, BLOCK_K)
        x = tl.load(H + t[:, None] * K + k[None, :], mask=tm[:, None], other=0.0)
        f = tl.load(Fn + n[:, None] * K + k[None, :], mask=nm[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(f), acc, input_precision=PRECISION)
        sq += tl.sum(x * x, axis=1)
    base = s.to(tl.int64) * T + t
    tl.store(Part + base[:, None] * NP + n[None, :], acc, mask=tm[:, None])
    tl.store(Sq + base, sq, mask=tm)
