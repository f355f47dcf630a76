"""The deterministic mode on the GPU (issue 15): tiny preset, bf16 matrices, FlashMLA, the serving
cache. A prompt prefilled uncut or cut anywhere gives the same logits bit for bit; its tokens
decoded one by one, alone or beside other requests, eager or replayed from CUDA graphs, give the
logits of the uncut prefill of the same sequence bit for bit. (The default GPU path does not:
``benchmarks/chunk_invariance_gpu.py`` measures by how much.)

    python3 -m pytest -q -m gpu tests/core/test_deterministic_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core.model import V4Model

pytestmark = pytest.mark.gpu
DEV = "cuda"
PROMPT, DECODE = 600, 12


def _seq(cfg, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).to(DEV)


def _prefill(model, rows, row: int, ids: torch.Tensor, cuts: list[int]):
    st = rows.cache.bind(row, 1, 0)
    out, pos = [], 0
    for c in sorted(cuts) + [ids.numel()]:
        if c > pos:
            rows.slots(row, pos, c - pos)
            out.append(model.forward(rows.cache, [st], [ids[pos:c]])[0])
            pos = c
    return torch.cat(out), st


@pytest.mark.parametrize("cuts", [[1], [300], [5, 17, 450]])
def test_any_cut_of_a_prefill_gives_the_uncut_logits(tiny_gpu, serving_rows, cuts):
    cfg, w = tiny_gpu
    model = V4Model(cfg, w, deterministic=True)
    ids = _seq(cfg, PROMPT, 0)
    ref, _ = _prefill(model, serving_rows(cfg, 2, max_len=1024), 0, ids, [])
    got, _ = _prefill(model, serving_rows(cfg, 2, max_len=1024), 0, ids, cuts)
    assert torch.equal(got, ref), (got.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_decode_in_any_batch_gives_the_logits_of_the_uncut_prefill(tiny_gpu, serving_rows, graphs):
    """Row 0's last DECODE tokens decoded one by one (teacher-forced) beside 7 other requests ->
    the logits its uncut prefill gives those positions; so also equal to decoding it alone."""
    cfg, w = tiny_gpu
    model = V4Model(cfg, w, deterministic=True)
    seq = _seq(cfg, PROMPT + DECODE, 1)
    ref, _ = _prefill(model, serving_rows(cfg, 2, max_len=1024), 0, seq, [])
    if graphs:
        model.enable_cuda_graphs(16)
    others = [_seq(cfg, n, 10 + i) for i, n in enumerate((37, 130, 260, 515, 70, 5, 300))]
    rows = serving_rows(cfg, 1 + len(others), max_len=1024)
    states = [_prefill(model, rows, 0, seq[:PROMPT], [300])[1]]
    states += [_prefill(model, rows, 1 + i, p, [])[1] for i, p in enumerate(others)]
    fill = torch.zeros(1, dtype=torch.long, device=DEV)
    got = []
    for t in range(DECODE):
        for r, st in enumerate(states):
            rows.slots(r, st.num_tokens, 1)
        ids = [seq[PROMPT + t:PROMPT + t + 1]] + [fill] * len(others)
        got.append(model.forward(rows.cache, states, ids)[0])
    if graphs:
        assert model.graphs.captured, "the decode steps did not replay from graphs"
    rows.cache.check_integrity()
    assert torch.equal(torch.cat(got), ref[PROMPT:]), (torch.cat(got).float() - ref[PROMPT:].float()).abs().max().item()
