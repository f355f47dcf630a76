"""The indexer-score kernel (``kernels.index_scores``) under the Triton interpreter: the scores of
every real entry equal the float64-exact torch scores to fp32 round-off, on shuffled pages with
-1 table columns, narrow heads and several blocks per program; a token's scores do not depend
on the tokens launched with it (bit for bit). The GPU runs the same cases in
``test_index_scores_gpu.py`` (bf16 operands there)."""

from __future__ import annotations

from sglang_dsv4.kernels.index_scores import blocks_per_program

_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, "tests/kernels")
from index_cases import SHAPES, exact_scores, make_case, worst_error
from sglang_dsv4.kernels.index_scores import paged_index_scores
worst = 0.0
for shape in SHAPES:
    qi, hw, buf, lay, table, tok_req = make_case(*shape)
    got = paged_index_scores(qi, hw, buf, lay, table, tok_req)
    worst = max(worst, worst_error(got, exact_scores(qi, hw, buf, lay, table, tok_req), table, tok_req))
    alone = paged_index_scores(qi[-1:], hw[-1:], buf, lay, table, tok_req[-1:])
    assert torch.equal(alone[0], got[-1]), shape
print("WORST", worst)
"""


def test_kernel_scores_are_the_exact_scores_to_round_off(triton_interpreted):
    worst = triton_interpreted(_INTERPRETED)
    assert worst < 1e-6, worst


# The seam: the FlashMLA-shaped backend hands V4Model the kernel's scores (prefill chunks of two
# requests, then batched decode steps); the logits still match the oracle (the core tests' bound).
_MODEL = r"""
import tempfile, torch
import sglang_dsv4.kernels.hc_split as hc_split
from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.oracle import OracleModel
from sglang_dsv4.kernels import index_scores
from sglang_dsv4.kernels.sparse_mla import SparseMLABackend
from sglang_dsv4.kernels.torch_ref import TorchSparseKernels
from sglang_dsv4.tiny import build_tiny
hc_split.INTERPRET = False  # SGLang's Sinkhorn kernel interpreted would take minutes; torch here
cfg, w = (lambda c: (c.config, c.tensors))(load_checkpoint(build_tiny("micro", 0, tempfile.mkdtemp() + "/ckpt")))
calls, kernel = [], index_scores.paged_index_scores
index_scores.paged_index_scores = lambda *a: calls.append(1) or kernel(*a)
ids = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (30, 29)]
cache = V4Cache(cfg, max_requests=2, max_total_tokens=1024, page_size=5,
                backend=SparseMLABackend(TorchSparseKernels(), precision="fp32"))
model = V4Model(cfg, w)
reqs = [cache.new_request() for _ in ids]
outs = [[model.forward(cache, [r], [s[:25]])[0]] for r, s in zip(reqs, ids)]
for p in range(25, 29):
    for o, x in zip(outs, model.forward(cache, reqs, [s[p:p + 1] for s in ids])):
        o.append(x)
assert calls, "the model did not score through the kernel"
errs = []
for o, s in zip(outs, ids):
    o, ref = torch.cat(o), OracleModel(cfg, w).forward(s[:29])
    errs.append((o - ref).norm(dim=-1) / ref.norm(dim=-1))
err = torch.cat(errs)
assert err.median() < 1e-5, err.median()
print("WORST", err.max().item())
"""


def test_the_model_scores_through_the_kernel_and_matches_the_oracle(triton_interpreted):
    assert triton_interpreted(_MODEL) < 2e-3


def test_blocks_per_program_fills_the_machine_from_shapes_alone():
    assert blocks_per_program(1, 32, 132) == 1          # batch 1: one block per program
    assert blocks_per_program(256, 32, 132) == 8        # batch 256, 4096 entries: 1024 programs
    assert blocks_per_program(256, 64, 132, waves=4) == 32
    assert blocks_per_program(4, 2, 132) == 1
    assert blocks_per_program(10**6, 3, 132) == 3       # never more than the row has
