"""``core.branches``: a layer's independent chains as the parts of one ``Branches.run``. On the
CPU the parts run in order; the branch layout (the MoE's routed and shared experts apart, added
by ``hc_post``) gives the plain layout's logits bit for bit. The streams themselves are the GPU
tests' (``tests/core/test_step_gpu.py``)."""

from __future__ import annotations

import torch

from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.core import branches
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model


def test_parts_run_in_order_off_the_gpu(monkeypatch):
    monkeypatch.setattr(branches, "ENABLED", True)
    seen = []
    b = branches.Branches(torch.device("cpu"))
    assert b.on
    assert b.run([lambda: seen.append(0) or "a", lambda: seen.append(1) or "b", lambda: seen.append(2) or "c"]) \
        == ["a", "b", "c"]
    assert seen == [0, 1, 2]


def test_the_branch_layout_gives_the_plain_logits(micro_dir, monkeypatch):
    ckpt = load_checkpoint(micro_dir)
    ids = torch.randint(0, ckpt.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    out = {}
    for on in (False, True):
        monkeypatch.setattr(branches, "ENABLED", on)
        model = V4Model(ckpt.config, dict(ckpt.tensors))
        cache = V4Cache(ckpt.config, max_requests=2, max_total_tokens=512)
        a, b = cache.new_request(), cache.new_request()
        got = model.forward(cache, [a, b], [ids[:30], ids[5:25]])
        for t in range(30, 40):  # decode steps of both
            got += model.forward(cache, [a, b], [ids[t:t + 1], ids[t - 5:t - 4]])
        out[on] = torch.cat(got)
    assert torch.equal(out[True], out[False])
