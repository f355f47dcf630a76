"""The Triton kernel of ``route.route_from_logits`` (imported on first use)."""

import triton
import triton.language as tl

from .pdl_triton import await_predecessor


@triton.jit(do_not_specialize=["E", "stride_l", "scale"])
def route_kernel(Logits, Bias, Given, Chosen, Gates, E, stride_l, scale,
                 K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, HASHED: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Program t: s = sqrt(softplus(Logits[t, :E])); the experts: the K largest s + Bias (ties:
    the lower expert; ``HASHED``: Given[t] instead); Gates[t] = their s / its sum * scale."""
    await_predecessor(PDL)
    t = tl.program_id(axis=0).to(tl.int64)
    e = tl.arange(0, E_P)
    ok = e < E
    z = tl.load(Logits + t * stride_l + e, mask=ok, other=0.0)
    # softplus as torch takes it (threshold 20); log1p(ez) by log(u) * ez / (u - 1), u = 1 + ez:
    # within an ulp or two of log1p without libdevice (which the interpreter lacks)
    ez = tl.exp(z)
    u = 1.0 + ez
    lp = tl.where(u == 1.0, ez, tl.log(u) * (ez / (u - 1.0)))
    s = tl.sqrt_rn(tl.where(z > 20.0, z, lp))
    kk = tl.arange(0, K_P)
    if HASHED:
        ch = tl.load(Given + t * K + kk, mask=kk < K, other=0).to(tl.int64)
        g = tl.sum(tl.where(e[None, :] == ch[:, None], s[None, :], 0.0), 1)
    else:
        key = tl.where(ok, s + tl.load(Bias + e, mask=ok, other=0.0), float("-inf"))
        ch = tl.zeros([K_P], tl.int64)
        g = tl.zeros([K_P], tl.float32)
        for i in tl.static_range(K):
            best = tl.max(key, 0)
            pick = tl.min(tl.where(key == best, e, E_P), 0)
            ch = tl.where(kk == i, pick, ch)
            g = tl.where(kk == i, tl.sum(tl.where(e == pick, s, 0.0), 0), g)
            key = tl.where(e == pick, float("-inf"), key)
    g = tl.where(kk < K, g, 0.0)
    g = g / tl.sum(g, 0) * scale
    tl.store(Chosen + t * K + kk, ch, mask=kk < K)
    tl.store(Gates + t * K + kk, g, mask=kk < K)
