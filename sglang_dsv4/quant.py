"""Number formats of V4 checkpoints and caches, and the QAT simulations of the forward.

- FP8 e4m3 weights with one power-of-two (e8m0) scale per 128x128 block;
- FP4 e2m1 routed-expert weights, two codes per int8 byte (low nibble = even index), one e8m0
  scale per 32 inputs;
- ``fp8_qat`` / ``fp4_qat``: the quantise-dequantise steps the model applies to the window and
  compressed KV (FP8, blocks of 64) and to the indexer query and keys (FP4, blocks of 32);
- ``hadamard``: the normalised Walsh-Hadamard rotation the indexer applies before FP4.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_WEIGHT_BLOCK = 128
FP4_WEIGHT_BLOCK = 32
# e2m1 code -> value; codes 8..15 are the negatives of 0..7.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """log2 of ``pow2_scale`` (float): what a ue8m0 scale byte stores, less its bias of 127."""
    return torch.ceil(torch.log2(amax / qmax))


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (the ue8m0 scale rule)."""
    return torch.exp2(pow2_exponent(amax, qmax))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks along the last dim, in fp32 (fp64 stays fp64: the float64 oracle checks run there)."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block {block}")
    x = x if x.dtype == torch.float64 else x.float()
    return x.unflatten(-1, (x.shape[-1] // block, block))


def fp8_qat(x: torch.Tensor, block: int = 64, amax_floor: float = 1e-4) -> torch.Tensor:
    """FP8_QAT(x, block): round each block to e4m3 with a power-of-two scale (fp32 out, fp64 for fp64)."""
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True).clamp_min(amax_floor), FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(xb.dtype)
    return (q * scale).flatten(-2)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, ties to the even code; input already within [-6, 6].

    The grid has steps 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6], and on each piece the even
    code is the even multiple of the step, so round-half-to-even of mag / step is the rule: pure
    arithmetic (no table, so a compiled graph holds no host constant), exact in any float dtype.
    """
    mag = x.abs()
    q = torch.where(mag < 2, torch.round(mag * 2) * 0.5,
                    torch.where(mag < 4, torch.round(mag), torch.round(mag * 0.5) * 2))
    return torch.copysign(q, x)


def fp4_qat(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4_QAT(x, block): round each block to e2m1 with a power-of-two scale."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
    scale = pow2_scale(amax, FP4_MAX)
    q = e2m1_round((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform (Sylvester order) over the last dim (a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape) * (n**-0.5)


# ---- checkpoint weight formats -------------------------------------------------------------

def quantize_fp8_blockwise(w: torch.Tensor, block: int = FP8_WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 [out, in], e8m0 scales [ceil(out/b), ceil(in/b)])."""
    out_dim, in_dim = w.shape
    nb_o, nb_i = math.ceil(out_dim / block), math.ceil(in_dim / block)
    padded = torch.zeros(nb_o * block, nb_i * block, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    tiles = padded.view(nb_o, block, nb_i, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = pow2_scale(amax, FP8_MAX)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(nb_o * block, nb_i * block)[:out_dim, :in_dim].contiguous()
    return q, scale.to(torch.float8_e8m0fnu)


def dequantize_fp8_blockwise(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """Inverse of quantize_fp8_blockwise, in float32."""
    s = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return q.float() * s[: q.shape[0], : q.shape[1]]


def quantize_fp4_packed(w: torch.Tensor, block: int = FP4_WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in/2] packed e2m1, e8m0 scales [out, in/block])."""
    wb = _blocks(w.float(), block)
    scale = pow2_scale(wb.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    vals = e2m1_round((wb / scale).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    codes = _e2m1_codes(vals)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.squeeze(-1).to(torch.float8_e8m0fnu)


def _e2m1_codes(vals: torch.Tensor) -> torch.Tensor:
    mags = E2M1_VALUES[:8].to(vals.device)
    code = (vals.abs().unsqueeze(-1) == mags).int().argmax(-1)
    return (code + 8 * (torch.signbit(vals) & (vals != 0)).int()).to(torch.int32)


def dequantize_fp4_packed(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_WEIGHT_BLOCK) -> torch.Tensor:
    """int8 [out, in/2] + e8m0 [out, in/block] -> float32 [out, in]."""
    b = packed.view(torch.uint8).int()
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    vals = E2M1_VALUES.to(packed.device)[codes.long()]
    return vals * scale.float().repeat_interleave(block, -1)


def fp4_to_fp8_blockwise(packed: torch.Tensor, scale: torch.Tensor, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Packed fp4 e2m1 + per-32 e8m0 scales -> fp8 e4m3 + 128x128 e8m0 block scales, losslessly.

    An e2m1 value (1 mantissa bit) times 2^e is exact in e4m3 (3 mantissa bits) under a block
    scale S = 2^ceil(log2(amax/448)) as long as it lies in e4m3's range relative to S: within a
    128x128 block, the per-32 exponents may span up to 14 binades (largest value <= 448 S,
    smallest nonzero >= 2^-9 S). The conversion is checked bit for bit (float32 dequantisations
    compared as integers); a tensor that does not convert exactly raises ValueError naming
    ``name``. Runs on the tensors' device.
    """
    ref = dequantize_fp4_packed(packed, scale)
    q, s = quantize_fp8_blockwise(ref)
    back = dequantize_fp8_blockwise(q, s)
    if not torch.equal(back.view(torch.int32), ref.view(torch.int32)):
        bad = (back.view(torch.int32) != ref.view(torch.int32)).sum().item()
        raise ValueError(f"{name or 'fp4 tensor'}: the fp4 -> fp8 block-128 conversion is not exact "
                         f"({bad} of {ref.numel()} values differ: its per-32 scales span more binades "
                         "than e4m3 covers within a 128x128 block)")
    return q, s
