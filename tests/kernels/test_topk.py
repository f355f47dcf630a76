"""``kernels.topk``: the indexer's top-k kernel chooses ``ops.select_topk_torch``'s columns in its
order, by either method (interpreted on the CPU: ties, -0, invisible columns, rows shorter
than k, several chunks, rows split into chunks once and again)."""

from __future__ import annotations

_CASES = """
import torch
from sglang_dsv4.core import ops
from sglang_dsv4.kernels import topk
g = torch.Generator().manual_seed(0)
worst = 0
for T, N, k, chunk in [(3, 5, 4, None), (2, 300, 8, 16), (4, 700, 16, 64), (2, 2000, 64, 128), (1, 1, 4, None),
                       (3, 40, 64, None), (2, 100, 6, 8)]:
    s = torch.randint(-4, 5, (T, N), generator=g).float() / 4   # many ties
    s[:, ::7] = -0.0
    v = torch.randint(0, N + 1, (T,), generator=g)
    v[0] = N
    for scores in (s, torch.randn(T, N, generator=g)):  # ties everywhere; none
        want = ops.select_topk_torch(scores, v, k)
        for method in ("bitonic", "radix"):
            got = topk.select_topk_rows(scores, v, k, chunk, method=method)
            assert got.shape == (T, k) and got.dtype == torch.int64
            worst += int(not torch.equal(got, want))
assert topk.preferred(s, k) and torch.equal(ops.select_topk(s, v, k), ops.select_topk_torch(s, v, k))
wide = torch.zeros(1, topk.MAX_CHUNK + 1)
topk.SPLIT = False
assert topk.supported(wide) and not topk.preferred(wide, 512)  # the split is opt-in: torch.topk
topk.SPLIT = True
assert topk.preferred(wide, 512) and not topk.preferred(wide, topk.MAX_CHUNK)  # split; k too wide to split: torch
# rows wider than a chunk split: chunks of 64 here; 2000 x k 16 splits three times (512, 128, 32
# candidates), 700 x 8 twice, a width not a whole number of chunks, visible counts past the width
topk.MAX_CHUNK = 64
for T, N, k in [(3, 700, 8), (2, 2000, 16), (4, 130, 32), (2, 65, 5)]:
    s = torch.randint(-4, 5, (T, N), generator=g).float() / 4
    s[:, ::7] = -0.0
    v = torch.randint(0, N + 1, (T,), generator=g)
    v[0], v[-1] = N, N + 3
    assert topk.splits(N, k)
    for scores in (s, torch.randn(T, N, generator=g)):
        want = ops.select_topk_torch(scores, v.clamp_max(N), k)
        for method in ("bitonic", "radix"):
            worst += int(not torch.equal(topk.select_topk_rows(scores, v, k, method=method), want))
        worst += int(not torch.equal(ops.select_topk(scores, v, k), want))
print("WORST", worst)
"""


def test_the_kernel_chooses_the_torch_paths_columns_in_order(triton_interpreted):
    assert triton_interpreted(_CASES) == 0
