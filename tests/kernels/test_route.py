"""``kernels.route``: the router's selection in one launch against ``ops.route_tokens``' torch
ops, interpreted on the CPU: scored and hash-routed layers, 8 / 32 / 256 experts, logits past
softplus's threshold (and so far below it that exp underflows), a non-power-of-two expert
count; the experts the same (no two scores within rounding here), the gates within float32
rounding of their sum."""

from __future__ import annotations

_CASES = """
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.config import V4Config
from sglang_dsv4.kernels import route
from sglang_dsv4.tiny import PRESETS
route.ENABLED = True
g = torch.Generator().manual_seed(0)
worst = 0.0
for E, k, T in [(8, 6, 5), (32, 6, 9), (256, 6, 4), (24, 3, 3)]:
    cfg = V4Config.from_dict({**PRESETS["micro"], "n_routed_experts": E, "num_experts_per_tok": k})
    D = cfg.hidden_size
    x = torch.randn(T, D, generator=g)
    gate = torch.randn(E, D, generator=g) * 0.3
    x[0] *= 40  # logits past the threshold (20) and far below it
    bias = torch.randn(E, generator=g) * 0.1
    given = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    for b in (bias, given):
        assert route.preferred(x, gate, k)
        logits = x @ gate.t()
        got = route.route_from_logits(logits, b, k, cfg.routed_scaling_factor)
        want = ops.route_tokens(x, gate, b, cfg)
        assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32 and got[0].shape == (T, k)
        # the torch top-k's order: by score, which the kernel's passes also give
        if not torch.equal(got[0], want[0].long()):
            worst = max(worst, 1.0)
        worst = max(worst, (got[1] - want[1]).abs().max().item() / cfg.routed_scaling_factor)  # gates sum to it
route.ENABLED = False
assert not route.preferred(x, gate, k)
print("WORST", worst)
"""


def test_the_kernel_routes_as_the_torch_ops(triton_interpreted):
    assert triton_interpreted(_CASES) < 1e-5
