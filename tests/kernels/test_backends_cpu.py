"""Attention backends on CPU: the torch reference of FlashMLA's entry points against a direct
computation, the FlashMLA-shaped backend (with that reference as its kernels) against the
oracle, and backend selection."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv4.config import V4Config
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.oracle import OracleModel
from sglang_dsv4.kernels.dispatch import BackendUnavailable, select_backend
from sglang_dsv4.kernels.kv_layout import V4Fp8Rows
from sglang_dsv4.kernels.sparse_mla import SparseMLABackend
from sglang_dsv4.kernels.torch_ref import TorchSparseKernels
from sglang_dsv4.tiny import preset_config

EXACT = SparseMLABackend(TorchSparseKernels(), precision="fp32")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1)


def random_ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def assert_matches_oracle(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The core tests' quant-sim bound: round-off, plus rare FP8/FP4 rounding-bin flips."""
    err = rel_err(got, ref)
    assert err.median() < 1e-5, f"median rel err {err.median():.3g}"
    assert err.max() < 2e-3, f"max rel err {err.max():.3g} at position {err.argmax()}"


# ---- the reference kernels -----------------------------------------------------------------

def _direct_attention(q: torch.Tensor, keys: list[torch.Tensor], sink: torch.Tensor, scale: float) -> torch.Tensor:
    """o_h = sum_n e^{l_hn} K_n / (sum_n e^{l_hn} + e^{sink_h}) in float64. q [H, D]; keys list of [D]."""
    K = torch.stack(keys).double()
    logits = q.double() @ K.t() * scale
    m = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - m)
    return (p @ K) / (p.sum(-1, keepdim=True) + torch.exp(sink.double()[:, None] - m))


def test_reference_decode_follows_flashmla_index_semantics():
    g = torch.Generator().manual_seed(0)
    lay, ext_lay = V4Fp8Rows(8, nope=64, rope=16), V4Fp8Rows(4, nope=64, rope=16)
    cache, extra = lay.alloc_pool(6), ext_lay.alloc_pool(5)
    lay.write(cache, torch.arange(48), torch.randn(48, 80, generator=g))
    ext_lay.write(extra, torch.arange(20), torch.randn(20, 80, generator=g))
    B, S, H = 3, 2, 4
    q = torch.randn(B, S, H, 80, generator=g)
    idx = torch.randint(0, 48, (B, S, 6), generator=g, dtype=torch.int32)
    idx[0, 0, 1] = -1
    ext = torch.randint(0, 20, (B, S, 4), generator=g, dtype=torch.int32)
    ext[1, 1, 0] = -1
    lengths, ext_lengths = torch.tensor([6, 3, 5], dtype=torch.int32), torch.tensor([4, 2, 0], dtype=torch.int32)
    sink, scale = torch.randn(H, generator=g), 80**-0.5
    got = TorchSparseKernels().decode(q, cache, lay, idx, lengths, sink, scale, extra, ext_lay, ext, ext_lengths)
    for b in range(B):
        for s in range(S):
            keys = [lay.read(cache, idx[b, s, k].view(1))[0] for k in range(lengths[b]) if idx[b, s, k] != -1]
            keys += [ext_lay.read(extra, ext[b, s, k].view(1))[0] for k in range(ext_lengths[b]) if ext[b, s, k] != -1]
            want = _direct_attention(q[b, s], keys, sink, scale)
            assert torch.allclose(got[b, s].double(), want, atol=1e-5), (b, s)


def test_reference_prefill_masks_minus_one_and_out_of_range():
    g = torch.Generator().manual_seed(1)
    T, N, H, D = 5, 30, 4, 32
    q, kv, sink = torch.randn(T, H, D, generator=g), torch.randn(N, 1, D, generator=g), torch.randn(H, generator=g)
    idx = torch.randint(0, N, (T, 1, 7), generator=g, dtype=torch.int32)
    idx[:, 0, 0], idx[:, 0, 1] = -1, N + 3
    got = TorchSparseKernels().prefill(q, kv, idx, sink, 0.3)
    for t in range(T):
        want = _direct_attention(q[t], [kv[i, 0] for i in idx[t, 0, 2:].tolist()], sink, 0.3)
        assert torch.allclose(got[t].double(), want, atol=1e-5)


# ---- the FlashMLA-shaped backend, with reference kernels, against the oracle ----------------

def _run(model: V4Model, cache: V4Cache, req, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    out, pos = [], 0
    for c in chunks:
        out.append(model.forward(cache, [req], [ids[pos:pos + c]])[0])
        pos += c
    while pos < ids.numel():
        out.append(model.forward(cache, [req], [ids[pos:pos + 1]])[0])
        pos += 1
    return torch.cat(out)


@pytest.mark.parametrize("chunks, page_size", [([3], 64), ([150, 41, 100], 3)])
def test_sparse_mla_backend_matches_oracle(micro, chunks, page_size):
    """Prefill chunks (workspace path) then decode (ring + extra cache path) past two ring wraps,
    C128 entries and top-k selection, in fp8 storage."""
    cfg, w = micro
    ids = random_ids(330, 11, cfg.vocab_size)
    ref = OracleModel(cfg, w).forward(ids)
    cache = V4Cache(cfg, max_requests=2, max_total_tokens=1024, page_size=page_size, backend=EXACT)
    assert cache.slot_state["ring"].dtype == torch.uint8
    got = _run(V4Model(cfg, w), cache, cache.new_request(), ids, chunks)
    assert_matches_oracle(got, ref)


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["cpu-padded", "decode-kernel"])
def test_sparse_mla_backend_batches_decode_and_mixed_steps(micro, decode_kernel, monkeypatch):
    """Decode batches of requests at different positions (some without compressed entries yet),
    and mixed prefill + decode batches. The CPU pads every step to a row tile, so its decode
    steps take the prefill kernel; ``decode-kernel`` leaves decode steps unpadded, as on a GPU, so
    they go through ``SparseMLABackend._decode`` (the ring read as the main cache, the entries as
    the extra cache: FlashMLA's decode call) with the torch reference of the kernel."""
    if decode_kernel:
        pad = V4Model._pad
        monkeypatch.setattr(V4Model, "_pad", lambda self, cache, step: step if step.is_decode else pad(self, cache, step))
        calls = []
        decode = SparseMLABackend._decode
        monkeypatch.setattr(SparseMLABackend, "_decode", lambda self, b: calls.append(1) or decode(self, b))
    cfg, w = micro
    seqs = [random_ids(n, 200 + n, cfg.vocab_size) for n in (140, 7, 133, 60)]
    refs = [OracleModel(cfg, w).forward(s) for s in seqs]
    model = V4Model(cfg, w)
    cache = V4Cache(cfg, max_requests=4, max_total_tokens=2048, page_size=5, backend=EXACT)
    reqs = [cache.new_request() for _ in seqs]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for i in (0, 2):  # two long prompts first, then everyone advances together
        outs[i].append(model.forward(cache, [reqs[i]], [seqs[i][:100]])[0])
    step = 0
    while any(r.num_tokens < s.numel() for r, s in zip(reqs, seqs)):
        live = [i for i, (r, s) in enumerate(zip(reqs, seqs)) if r.num_tokens < s.numel()]
        n = 9 if step % 5 == 4 else 1  # every fifth step is a mixed batch of 9-token chunks
        pieces = [seqs[i][reqs[i].num_tokens:reqs[i].num_tokens + n] for i in live]
        for i, logits in zip(live, model.forward(cache, [reqs[i] for i in live], pieces)):
            outs[i].append(logits)
        step += 1
    for out, ref in zip(outs, refs):
        assert_matches_oracle(torch.cat(out), ref)
    if decode_kernel:
        assert calls, "no step went through the decode kernel path"


def test_sparse_mla_backend_snapshot_restore_and_copy_on_write(micro):
    """Forks from a snapshot share fp8 entry pages and copy a shared partial page before appending."""
    cfg, w = micro
    prefix, tails = random_ids(150, 5, cfg.vocab_size), [random_ids(30, 6 + k, cfg.vocab_size) for k in range(2)]
    model, oracle = V4Model(cfg, w), OracleModel(cfg, w)
    cache = V4Cache(cfg, max_requests=3, max_total_tokens=2048, page_size=3, backend=EXACT)
    origin = cache.new_request()
    model.forward(cache, [origin], [prefix])
    snap = cache.snapshot(origin)
    forks = [cache.restore(snap) for _ in tails]
    model.forward(cache, [origin], [random_ids(20, 99, cfg.vocab_size)])  # origin appends first
    for fork, tail in zip(forks, tails):
        got = _run(model, cache, fork, tail, [10])
        assert_matches_oracle(got, oracle.forward(torch.cat((prefix, tail)))[prefix.numel():])
    assert cache.pools[4].num_copies > 0


def test_fp8_backends_need_the_qat_model(micro):
    cfg, w = micro
    cache = V4Cache(cfg, max_requests=1, backend="torch-fp8")
    with pytest.raises(ValueError, match="quant_sim=True"):
        V4Model(cfg, w, quant_sim=False).forward(cache, [cache.new_request()], [random_ids(4, 0, cfg.vocab_size)])


def test_comp_rows_map_entry_indices_through_each_requests_table():
    """Tokens of two requests: entry indices j become their request's storage rows, -1 stays -1,
    and valid rows stay leftmost (the decode kernel's lengths count from the left)."""
    from sglang_dsv4.core import ops
    from sglang_dsv4.kernels.backend import AttnBatch

    step = type("Step", (), {"tok_req": torch.tensor([0, 0, 1])})()
    comp = ops.select_topk(torch.tensor([[0.5, 2.0, 1.0], [3.0, 1.0, 2.0], [1.0, 1.0, 1.0]]),
                           torch.tensor([3, 1, 0]), 3)
    assert comp.tolist() == [[1, 2, 0], [0, -1, -1], [-1, -1, -1]]
    b = AttnBatch(q=None, kv=None, step=step, ring=None, ring_layout=None, comp_idx=comp,
                  entry_table=torch.tensor([[10, 11, 12], [20, -1, -1]]), entries=None, entry_layout=None,
                  sink=None, scale=1.0)
    assert b.comp_rows().tolist() == [[11, 12, 10], [10, -1, -1], [-1, -1, -1]]


def test_auto_selection_on_cpu_is_torch_and_logged_once(micro, caplog):
    cfg, _ = micro
    with caplog.at_level("INFO", logger="sglang_dsv4.kernels.dispatch"):
        assert select_backend("auto", cfg, "cpu").name == "torch"
        assert select_backend(None, cfg, "cpu").name == "torch"
    assert sum("attention backend: torch" in r.message for r in caplog.records) <= 1
    assert V4Cache(cfg, max_requests=1).backend.name == "torch"


def test_forced_flashmla_says_why_not(micro):
    cfg, _ = micro
    with pytest.raises(BackendUnavailable) as e:
        select_backend("flashmla", cfg, "cpu")
    msg = str(e.value)
    assert "head_dim" in msg and "needs a CUDA device" in msg
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        select_backend("flashmla", preset_config("tiny"), "cpu")


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend("flash", V4Config(), "cpu")


def test_flashmla_shaped_tiny_preset_passes_the_shape_check():
    preset_config("tiny").check_flashmla()
    assert math.isclose(preset_config("tiny").softmax_scale, 512**-0.5)
