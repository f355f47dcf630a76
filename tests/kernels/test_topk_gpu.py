"""``kernels.topk`` on the GPU: the indexer's top-k kernel chooses ``ops.select_topk_torch``'s
columns in its order at V4-Flash's k (512) and entry counts (rows past 4096 split into chunks,
262144: a 1M-token context's C4 entries, split twice), and replays from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import ops
from sglang_dsv4.kernels import topk

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("tokens,entries", [(1, 4096), (256, 4096), (7, 16384), (3, 5), (64, 700), (64, 16384),
                                             (1, 65536), (2, 262144)])
def test_the_kernel_chooses_the_torch_paths_columns(tokens, entries, monkeypatch):
    monkeypatch.setattr(topk, "SPLIT", True)
    g = torch.Generator(device=DEV).manual_seed(entries)
    scores = torch.randn(tokens, entries, generator=g, device=DEV).relu()  # relu sums: many exact zeros
    scores[:, 1::5] = scores[:, ::5][:, :scores[:, 1::5].shape[1]]      # and ties between columns
    visible = torch.randint(0, entries + 1, (tokens,), generator=g, device=DEV)
    visible[0] = entries
    assert topk.supported(scores)
    for k in (512, 6):
        want = ops.select_topk_torch(scores, visible, k)
        for method in ("bitonic", "radix"):
            assert torch.equal(topk.select_topk_rows(scores, visible, k, method=method), want), method


@pytest.mark.parametrize("entries", [4096, 16384])  # one chunk; split
@pytest.mark.parametrize("method", ["bitonic", "radix"])
def test_the_kernel_replays_from_a_graph(method, entries, monkeypatch):
    monkeypatch.setattr(topk, "SPLIT", True)
    g = torch.Generator(device=DEV).manual_seed(0)
    scores = torch.randn(64, entries, generator=g, device=DEV)
    visible = torch.full((64,), entries, device=DEV)
    out = topk.select_topk_rows(scores, visible, 512, method=method)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk.select_topk_rows(scores, visible, 512, method=method)
    scores.copy_(torch.randn(64, entries, generator=g, device=DEV))
    graph.replay()
    assert torch.equal(out, ops.select_topk_torch(scores, visible, 512))
