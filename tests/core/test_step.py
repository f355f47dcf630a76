"""``core.step``'s per-step derived index tensors: computed once per step and shared by the layers
(each costs a few small kernels per layer on a GPU otherwise), fresh for every step."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.core import model as model_mod
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.step import build_step
from sglang_dsv4.kernels import backend as backend_mod
from sglang_dsv4.srt.state import SglangV4Cache


def test_derived_is_computed_once_per_step_and_fresh_for_the_next():
    class Req:
        slot, num_tokens = 0, 0

    def make():
        calls.append(1)
        return torch.zeros(1)

    calls: list[int] = []
    step = build_step([Req()], [torch.tensor([5, 6])], [0], 3, torch.device("cpu"), with_c128=False)
    first = step.derived(("x",), make)
    assert step.derived(("x",), make) is first and len(calls) == 1
    step.derived(("y",), make)
    assert len(calls) == 2
    again = build_step([Req()], [torch.tensor([5, 6])], [0], 3, torch.device("cpu"), with_c128=False)
    again.derived(("x",), make)
    assert len(calls) == 3


def test_layers_share_the_steps_window_and_compressor_indices(micro, monkeypatch):
    """micro's layers all address the ring and (its C4 layers) the compressor windows the same
    way: one computation of each per forward, whatever the number of layers."""
    cfg, w = micro
    counts = {"window": 0, "ring": 0, "c4": 0}

    def counted(name, fn):
        def inner(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return inner

    monkeypatch.setattr(backend_mod, "_window_indices", counted("window", backend_mod._window_indices))
    monkeypatch.setattr(backend_mod, "_ring_writes", counted("ring", backend_mod._ring_writes))
    monkeypatch.setattr(model_mod, "_c4_window_rows", counted("c4", model_mod._c4_window_rows))
    model = V4Model(cfg, w)
    cache = SglangV4Cache.with_own_table(cfg, 2, 256, max_seq_len=128, backend="torch")
    cache.req_to_token.copy_(torch.arange(1, 257).view(2, 128))
    reqs = [cache.bind(r, 1, 0) for r in range(2)]
    ids = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 20)]
    model.forward(cache, reqs, ids)
    assert cfg.num_hidden_layers > 1 and 4 in cfg.compress_ratios
    assert counts == {"window": 1, "ring": 1, "c4": 1}
    model.forward(cache, reqs, [i[:1] for i in ids])  # the next step: computed again, once
    assert counts == {"window": 2, "ring": 2, "c4": 2}


def test_a_batch_as_one_tensor_equals_one_tensor_per_request(micro):
    """``forward`` takes a step's tokens as one [B, L] tensor (a server's decode batch) as well as
    one tensor per request: the same step, bit for bit, decode and L = 2 alike; a bad shape or a
    request that would outgrow the cache is refused as with per-request tensors."""
    cfg, w = micro
    model = V4Model(cfg, w)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (3, 126, 127)]
    steps = [torch.randint(0, cfg.vocab_size, (3, L), generator=g) for L in (1, 1, 2, 1)]
    outs = []
    for as_tensor in (False, True):
        cache = SglangV4Cache.with_own_table(cfg, 3, 3 * 256, max_seq_len=256, backend="torch")
        cache.req_to_token.copy_(torch.arange(1, 3 * 256 + 1).view(3, 256))
        reqs = [cache.bind(r, 1, 0) for r in range(3)]
        model.forward(cache, reqs, prompts)
        for ids in steps:  # crossing a C4 and a C128 boundary
            outs.append(model.forward(cache, reqs, ids if as_tensor else list(ids), flat=True))
    half = len(steps)
    for a, b in zip(outs[:half], outs[half:]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="tokens\\] tensor"):
        model.forward(cache, reqs, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the maximum length"):
        model.forward(cache, reqs, torch.zeros(3, 200, dtype=torch.long))
