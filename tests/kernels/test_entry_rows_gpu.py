"""``kernels.entry_rows`` on the GPU: the decode step's entry operands give the torch region's
integers (``sparse_mla._decode_extra``, compiled where the regions are on) at decode shapes, and
replay from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kernels import entry_rows
from sglang_dsv4.kernels.sparse_mla import _decode_extra

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(T: int, B: int, N: int, K: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    table = torch.randint(-1, 1 << 20, (B, N), generator=g, device=DEV, dtype=torch.int32)
    tok_req = torch.randint(0, B, (T,), generator=g, device=DEV)
    scores = torch.rand(T, N, generator=g, device=DEV)
    visible = torch.randint(0, N + 1, (T,), generator=g, device=DEV)
    scores = scores.masked_fill(torch.arange(N, device=DEV) >= visible[:, None], -1.0)
    idx = scores.topk(min(K, N), dim=1).indices
    idx = torch.where(torch.arange(idx.shape[1], device=DEV) < visible[:, None], idx, -1)
    return table, tok_req, torch.nn.functional.pad(idx, (0, K - idx.shape[1]), value=-1)


@pytest.mark.parametrize("T,B,N,K", [(1, 1, 256, 512), (64, 64, 1024, 512), (256, 256, 4096, 512), (64, 64, 8, 8),
                                     (7, 3, 16384, 512)])
def test_the_kernel_gives_the_torch_regions_rows_and_counts(T, B, N, K, monkeypatch):
    monkeypatch.setattr(entry_rows, "ENABLED", True)
    table, tok_req, idx = _case(T, B, N, K, T + N)
    assert entry_rows.supported(idx)
    width = -(-K // 64) * 64
    got = entry_rows.decode_entry_rows(table, tok_req, idx, width)
    want = _decode_extra(table, tok_req, idx, width)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_kernel_replays_from_a_graph():
    table, tok_req, idx = _case(64, 64, 1024, 512, 0)
    rows, counts = entry_rows.decode_entry_rows(table, tok_req, idx, 512)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, counts = entry_rows.decode_entry_rows(table, tok_req, idx, 512)
    new = _case(64, 64, 1024, 512, 1)
    for dst, src in zip((table, tok_req, idx), new):
        dst.copy_(src)
    graph.replay()
    want = _decode_extra(table, tok_req, idx, 512)
    assert torch.equal(rows, want[0]) and torch.equal(counts, want[1])
