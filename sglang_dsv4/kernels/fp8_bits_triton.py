"""Exact fp32 -> power-of-two scale / e4m3 / bf16 arithmetic for the Triton kernels that quantise
(``kv_store_triton``, ``fp8_triton``), done with integer operations on the float bits.

The power-of-two scales and the e4m3 and bf16 roundings (round to nearest even) come out as the
same bytes as torch's casts on any device, and the interpreter, whose float8 and bfloat16 casts
truncate and which has no libdevice, runs the same code as the GPU: the CPU tests check the bytes.
"""

import triton
import triton.language as tl


@triton.jit
def ceil_log2(y):
    """ceil(log2(y)) of positive normal fp32 y, exactly: its exponent, + 1 unless a power of two."""
    b = y.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) - 127
    return tl.where((b & 0x7FFFFF) != 0, e + 1, e)


@triton.jit
def exp2_int(e):
    """2^e as fp32 for integer e in the normal range."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(q):
    """The e4m3fn byte of fp32 q (|q| <= 448), rounded to nearest even, sign kept (-0 too)."""
    b = q.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = tl.abs(q)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    quantum = exp2_int(tl.maximum(e, -6) - 3)  # 3 mantissa bits; subnormals below 2^-6 in steps of 2^-9
    r = a / quantum                          # exact: a power-of-two division, r < 16
    r = (r + 12582912.0) - 12582912.0        # rint (1.5 * 2^23): round to nearest even
    v = r * quantum
    vb = v.to(tl.int32, bitcast=True)
    ev = ((vb >> 23) & 0xFF) - 127
    normal = ((ev + 7) << 3) | ((vb >> 20) & 0x7)
    sub = r.to(tl.int32)  # below 2^-6 (then e < -6) the quantum is 2^-9: the mantissa is r itself
    return (tl.where(v >= 0.015625, normal, sub) | sign).to(tl.uint8)


@triton.jit
def e4m3_groups(x, floor):
    """A [groups, size] fp32 tile quantised one group per row, V4's ue8m0 rule: scale 2^e, e =
    ceil(log2(max(amax, floor) / 448)) -> (the e4m3 bytes [groups, size], e [groups])."""
    e = ceil_log2(tl.maximum(tl.max(tl.abs(x), axis=1), floor) / 448.0)
    return e4m3_bits(tl.minimum(tl.maximum(x / exp2_int(e)[:, None], -448.0), 448.0)), e


@triton.jit
def bf16_bits(x):
    """The bf16 bits (low 16 of an int32) of finite fp32 x, rounded to nearest even."""
    b = x.to(tl.int32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16
