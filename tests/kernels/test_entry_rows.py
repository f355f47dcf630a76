"""``kernels.entry_rows``: the decode step's entry operands for FlashMLA in one launch give the
torch region's integers (``sparse_mla._decode_extra``), interpreted on the CPU: top-k rows with
-1 tails, rows with no valid index, several requests, widths of one and two blocks, int32 and
int64 tables and indices."""

from __future__ import annotations

_CASES = """
import torch
from sglang_dsv4.kernels import entry_rows
from sglang_dsv4.kernels.sparse_mla import _decode_extra
entry_rows.ENABLED = True  # opt-in
g = torch.Generator().manual_seed(0)
worst = 0
for T, B, N, K, width, dtype in [(5, 3, 40, 16, 64, torch.int64), (4, 2, 300, 512, 512, torch.int32),
                                 (3, 3, 700, 600, 640, torch.int64), (2, 1, 8, 0, 64, torch.int64)]:
    table = torch.randint(-1, 10_000, (B, N), generator=g).to(dtype)
    tok_req = torch.randint(0, B, (T,), generator=g)
    counts = torch.randint(0, min(K, N) + 1, (T,), generator=g)
    counts[0] = min(K, N)
    idx = torch.stack([torch.cat((torch.randperm(N, generator=g)[:c], torch.full((K - c,), -1))) for c in counts.tolist()])
    idx = idx.to(dtype) if K else idx.view(T, 0)
    assert entry_rows.supported(idx)
    got = entry_rows.decode_entry_rows(table, tok_req, idx, width)
    want = _decode_extra(table, tok_req, idx, width)
    assert got[0].shape == (T, 1, width) and got[0].dtype == want[0].dtype == torch.int32
    worst += sum(int(not torch.equal(a, b)) for a, b in zip(got, want))
try:
    entry_rows.decode_entry_rows(table, tok_req, torch.zeros(2, 80, dtype=torch.int64), 64)
    worst += 1
except ValueError:
    pass
print("WORST", worst)
"""


def test_the_kernel_gives_the_torch_regions_rows_and_counts(triton_interpreted):
    assert triton_interpreted(_CASES) == 0
