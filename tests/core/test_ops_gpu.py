"""``core.ops`` on the GPU, compiled as the step runs it: the RoPE tables built once per step give
the bits of the rotation that computed them inside each fused region."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops

pytestmark = pytest.mark.gpu
DEV = "cuda"


@torch.compile
def _rotate_computing_tables(x: torch.Tensor, positions: torch.Tensor, inv_freqs: torch.Tensor) -> torch.Tensor:
    """The rotation as a fused region ran it before ``ops.rope_at``: cos and sin inline."""
    return ops.apply_rope(x, ops.Rope(*_tables(positions, inv_freqs)))


def _tables(positions: torch.Tensor, inv_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.to(torch.float64)[:, None] * inv_freqs[None, :]
    return torch.cos(angles), torch.sin(angles)


@pytest.mark.parametrize("tokens", [1, 37, 256])
def test_rope_tables_give_the_bits_of_the_inlined_rotation(tiny_gpu, tokens):
    cfg, _ = tiny_gpu
    g = torch.Generator(device=DEV).manual_seed(tokens)
    pos = torch.randint(0, 1 << 20, (tokens,), generator=g, device=DEV)
    freqs = ops.layer_inv_freqs(cfg, 4, DEV)
    x = torch.randn(tokens, cfg.num_attention_heads, cfg.head_dim, generator=g, device=DEV)
    rope = ops.rope_at(pos, freqs)
    want = _rotate_computing_tables(x, pos, freqs)
    assert torch.equal(torch.compile(ops.apply_rope)(x, rope), want)
    assert torch.equal(torch.compile(ops.apply_rope)(x, rope, inverse=True),
                       torch.compile(lambda x, p, f: ops.apply_rope(x, ops.Rope(*_tables(p, f)), inverse=True))(x, pos, freqs))
