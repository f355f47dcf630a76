"""The indexer-score kernel on the GPU (bf16 tensor-core dots): the scores of the interpreter's
cases and of a V4-Flash decode batch (256 requests x 4096 entries) equal the float64-exact scores
to fp32 round-off and the torch path's (``V4Model._index_scores``'s cuBLAS fp32 GEMM) as closely;
a token's scores are the same bits alone as in its batch; the top-k they give differs from the
exact scores' only where two scores tie to round-off.

    python3 -m pytest -q -m gpu tests/kernels/test_index_scores_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from index_cases import SHAPES, exact_scores, make_case, worst_error

from sglang_dsv4.core import ops
from sglang_dsv4.kernels.index_scores import paged_index_scores

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("shape", SHAPES + [(64, 128, 64, 256, 4096, 256)], ids=str)
def test_kernel_scores_are_the_exact_scores_to_round_off(shape):
    qi, hw, buf, lay, table, tok_req = make_case(*shape, device=DEV)
    got = paged_index_scores(qi, hw, buf, lay, table, tok_req)
    exact = exact_scores(qi, hw, buf, lay, table, tok_req)
    assert worst_error(got, exact, table, tok_req) < 1e-6
    B, N = table.shape
    keys = lay.read(buf, table.clamp_min(0).flatten()).view(B, N, -1)
    torch_path = ops.batched_indexer_scores(qi[:, None], hw[:, None], keys[tok_req]).squeeze(1)
    assert worst_error(got, torch_path, table, tok_req) < 1e-6
    alone = paged_index_scores(qi[-1:], hw[-1:], buf, lay, table, tok_req[-1:])
    assert torch.equal(alone[0], got[-1])


def test_top_k_of_kernel_scores_differs_only_at_round_off_ties():
    qi, hw, buf, lay, table, tok_req = make_case(64, 128, 64, 64, 4096, 64, device=DEV, seed=1)
    got = paged_index_scores(qi, hw, buf, lay, table, tok_req)
    exact = exact_scores(qi, hw, buf, lay, table, tok_req)
    visible = (table[tok_req] >= 0).sum(1)
    a, b = ops.select_topk(got, visible, 512), ops.select_topk(exact, visible, 512)
    differ = (a.sort(1).values != b.sort(1).values).any(1)
    for t in differ.nonzero().flatten().tolist():  # the k-th and (k+1)-th exact scores tie to round-off
        top = exact[t, :visible[t]].sort(descending=True).values
        assert (top[511] - top[512]).abs() <= 1e-6 * top.abs().max(), t
    assert differ.float().mean() < 0.5
