"""Cases for the indexer-score kernel's tests (``kernels.index_scores``), CPU and GPU alike."""

from __future__ import annotations

import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels.kv_layout import IndexFp8Rows
from sglang_dsv4.quant import fp4_qat, hadamard

# (heads, head dim, page rows, requests, entries per request, tokens): V4-Flash's 64 x 128 with a
# ragged last block and several blocks per program; tiny's narrow heads (padded to a dot tile);
# a single entry
SHAPES = [(64, 128, 64, 3, 150, 5), (64, 128, 64, 4, 2000, 24), (4, 32, 16, 2, 40, 2), (8, 64, 64, 1, 1, 1)]


def make_case(Hi: int, Di: int, P: int, B: int, N: int, T: int, device: str = "cpu", seed: int = 0):
    """Keys and queries as the model makes them (Hadamard'ed, FP4-QAT'ed; key magnitudes over a
    wide range of row scales) stored in shuffled pages; some table columns -1.
    -> (qi, head weights, page buffer, layout, table, tok_req)."""
    g = torch.Generator().manual_seed(seed)
    lay = IndexFp8Rows(P, Di)
    pages = -(-B * N // P) + 3
    buf = lay.alloc_pool(pages, device=device)
    rows = torch.randperm(pages * P, generator=g)[:B * N].view(B, N)
    mags = torch.exp2(torch.randint(-6, 6, (B * N, 1), generator=g).float())
    keys = fp4_qat(hadamard(torch.randn(B * N, Di, generator=g)) * mags, 32)
    lay.write(buf, rows.flatten().to(device), keys.to(device))
    table = rows.clone().int()
    table[0, max(N // 2, 1):] = -1  # request 0 has fewer entries
    tok_req = torch.randint(0, B, (T,), generator=g)
    qi = fp4_qat(hadamard(torch.randn(T, Hi, Di, generator=g)), 32)
    hw = torch.randn(T, Hi, generator=g)
    return qi.to(device), hw.to(device), buf, lay, table.to(device), tok_req.to(device)


def exact_scores(qi, hw, buf, lay, table, tok_req):
    """The scores in float64 dots (the deterministic mode's, exact for QAT'ed operands) [T, N]."""
    B, N = table.shape
    keys = lay.read(buf, table.clamp_min(0).flatten()).view(B, N, -1)
    return ops.batched_indexer_scores(qi[:, None], hw[:, None], keys[tok_req], exact=True).squeeze(1)


def worst_error(got, ref, table, tok_req) -> float:
    """Largest |got - ref| over the real entries, relative to each row's largest |ref|."""
    real = table[tok_req] >= 0
    scale = ref.abs().where(real, 0).amax(1, keepdim=True).clamp_min(1e-30)
    return ((got - ref).abs() / scale).where(real, 0).max().item()
