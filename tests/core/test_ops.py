"""``core.ops`` pieces whose GPU form is a rewrite of a definition: the indexer's top-k by unique
integer keys (``_stable_topk``) against the stable sort it replaces (``_sorted_topk``); the
hyper-connection stream sums as explicit adds (``_stream_sum``) against the einsums."""

from __future__ import annotations

import torch

from sglang_dsv4.core import ops


def _adversarial_scores(g: torch.Generator, rows: int, n: int) -> torch.Tensor:
    """Ties, +0 and -0, -inf and values near the float32 extremes."""
    x = torch.randint(-4, 5, (rows, n), generator=g).float() * 0.25
    zero = x == 0
    x[zero] *= torch.where(torch.rand(int(zero.sum()), generator=g) < 0.5, -1.0, 1.0)
    x[torch.rand(rows, n, generator=g) < 0.05] = float("-inf")
    return torch.where(torch.rand(rows, n, generator=g) < 0.3, torch.randn(rows, n, generator=g) * 1e30, x)


def test_the_keyed_topk_picks_the_stable_sorts_entries_in_its_order():
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        x = _adversarial_scores(g, 5, n)
        assert torch.equal(ops._stable_topk(x, k), ops._sorted_topk(x, k)), (n, k)


def test_select_topk_over_float32_equals_the_sort_with_visibility_and_padding():
    g = torch.Generator().manual_seed(1)
    for n in (3, 700, 2000):
        x = _adversarial_scores(g, 6, n)
        visible = torch.randint(0, n + 1, (6,), generator=g)
        visible[0] = 0
        got = ops.select_topk(x, visible, 512)
        want = ops._sorted_topk(x.masked_fill(torch.arange(n)[None] >= visible[:, None], float("-inf")), 512)
        want = torch.where(torch.arange(want.shape[1])[None] < visible[:, None], want, -1)
        want = torch.nn.functional.pad(want, (0, 512 - want.shape[1]), value=-1)
        assert got.shape == (6, 512) and torch.equal(got, want)
        assert (got[0] == -1).all()


def test_the_unrolled_stream_sums_equal_the_einsums_to_round_off():
    """The GPU's form of hc_weighted_sum / hc_head / hc_post's sums over the hc streams (explicit
    adds, stream order) against the CPU's einsums: both within fp32 round-off of the float64
    sums, and the same bits in float64 for exactly representable operands."""
    g = torch.Generator().manual_seed(2)
    T, hc, D = 37, 4, 300
    h = torch.randn(T, hc, D, generator=g)
    for w in (torch.rand(T, hc, generator=g) + 0.5, torch.rand(T, hc, hc, generator=g)):
        exact = ops._stream_sum(w.double(), h.double(), unrolled=False)
        for unrolled in (False, True):
            got = ops._stream_sum(w, h, unrolled)
            assert got.shape == exact.shape and got.dtype == torch.float32
            assert ((got.double() - exact).abs().amax() / exact.abs().amax()) < 1e-6, unrolled
        # dyadic operands with few bits: every product and partial sum is exact, in any order
        wq, hq = (w * 8).round().double() / 8, (h * 8).round().double() / 8
        assert torch.equal(ops._stream_sum(wq, hq, True), ops._stream_sum(wq, hq, False))
    f, post, comb = torch.randn(T, D, generator=g), torch.rand(T, hc, generator=g), torch.rand(T, hc, hc, generator=g)
    want = post.unsqueeze(-1) * f.unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, h)
    assert torch.equal(ops.hc_post(f, h, post, comb), want)  # the CPU: the einsum, unchanged


# ---- the stacked input matrices (ops.stack_x_matrices, x_projections) ----------------------------

def _stacked_layers(ckpt):
    """Each layer view of ``ckpt`` before and after ``stack_x_matrices``."""
    out = []
    for i in range(ckpt.config.num_hidden_layers):
        plain, stacked = ops.layer_view(ckpt.tensors, f"layers.{i}"), ops.layer_view(ckpt.tensors, f"layers.{i}")
        out.append((plain, stacked, ops.stack_x_matrices(stacked)))
    return out


def _values(t):
    return t.dequantize() if isinstance(t, ops.Fp8Weight) else t


def test_stacked_input_matrices_are_views_and_project_x_as_the_matrices_do(tiny_dir):
    """fp8 (wq_a + wkv) and bf16 / float32 (the compressors' and the indexer's) stacks on the tiny model:
    every matrix becomes a row view of its stack holding the same values, and the stacked GEMM's
    columns are each matrix's own product (the fp8 reference GEMMs on the CPU: summation order
    apart)."""
    from sglang_dsv4.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny_dir, weight_mode="fp8")
    x = torch.randn(37, ckpt.config.hidden_size, generator=torch.Generator().manual_seed(3))
    kinds = set()
    for plain, stacked, made in _stacked_layers(ckpt):
        kinds.update(made)
        got = ops.x_projections(x, stacked)
        assert set(got) == {n for n in ops.X_MATRICES if n in plain}
        for name, y in got.items():
            view, base = stacked[name], stacked[ops.X_STACK + ops._storage_kind(stacked[name])]
            if isinstance(view, ops.Fp8Weight):
                view, base = view.q, base.q
            assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), name
            assert torch.equal(_values(stacked[name]), _values(plain[name])), name
            want = ops.linear(x, plain[name])
            assert torch.allclose(y, want, rtol=1e-5, atol=1e-6 * want.abs().max().item()), name
    # the fp8 pair and the compressors' / indexer's matrices (bf16 in the checkpoint; float32 on the CPU)
    assert kinds == {ops.X_STACK + "fp8", ops.X_STACK + str(ckpt.tensors["layers.1.attn.compressor.wkv.weight"].dtype)[6:]}


def test_stacked_compressor_pairs_are_views_and_give_each_matrix_its_product(tiny_dir):
    """``ops.stack_compressor_matrices``: each compressor's wkv and wgate become row views of one
    stack, and ``compressor_gemms`` takes one GEMM of it whose column halves are each matrix's
    own product (summation order apart); fp8 matrices and lone ones are left as they are."""
    from sglang_dsv4.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny_dir, weight_mode="fp8")
    x = torch.randn(37, ckpt.config.hidden_size, generator=torch.Generator().manual_seed(3))
    made_any = 0
    for i in range(ckpt.config.num_hidden_layers):
        plain, stacked = ops.layer_view(ckpt.tensors, f"layers.{i}"), ops.layer_view(ckpt.tensors, f"layers.{i}")
        made = ops.stack_compressor_matrices(stacked)
        assert made == [p + ops.KV_GATE for p in ops.COMPRESSORS if f"{p}.wkv.weight" in plain]
        made_any += len(made)
        for prefix in ops.COMPRESSORS:
            if prefix + ops.KV_GATE not in stacked:
                continue
            base = stacked[prefix + ops.KV_GATE].untyped_storage().data_ptr()
            for m in ("wkv", "wgate"):
                name = f"{prefix}.{m}.weight"
                assert stacked[name].untyped_storage().data_ptr() == base and torch.equal(stacked[name], plain[name])
            got, want = ops.compressor_gemms(x, stacked, prefix), ops.compressor_gemms(x, plain, prefix)
            for y, z in zip(got, want):
                assert torch.allclose(y, z, rtol=1e-5, atol=1e-6 * z.abs().max().item()), prefix
    assert made_any >= 2  # the tiny model's C4 layer: both of its compressors
    w8 = ops.Fp8Weight(torch.zeros(128, 256).to(torch.float8_e4m3fn), torch.ones(1, 2))
    assert ops.stack_compressor_matrices({"attn.compressor.wkv.weight": w8, "attn.compressor.wgate.weight": w8}) == []
    assert ops.stack_compressor_matrices({"attn.compressor.wkv.weight": torch.zeros(4, 8)}) == []


def _stacked_against_plain_logits(tiny_dir, stack) -> float:
    """The tiny fp8 model's prefill + decode logits with ``stack(model)`` applied (a stacking of
    its matrices, checked by ``stack``) against the model as loaded -> the largest relative
    difference a row."""
    from sglang_dsv4.checkpoint import load_checkpoint
    from sglang_dsv4.core.cache import V4Cache
    from sglang_dsv4.core.model import V4Model

    ckpt = load_checkpoint(tiny_dir, weight_mode="fp8")
    cfg = ckpt.config
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(4))
    out = {}
    for stacked in (False, True):
        model = V4Model(cfg, dict(ckpt.tensors))
        if stacked:
            stack(model)
        cache = V4Cache(cfg, max_requests=1, max_total_tokens=256)
        req = cache.new_request()
        out[stacked] = torch.cat([model.forward(cache, [req], [ids[:18]])[0]] +
                                 [model.forward(cache, [req], [ids[t:t + 1]])[0] for t in range(18, 24)])
    return float(((out[True] - out[False]).norm(dim=-1) / out[False].norm(dim=-1)).max())


def test_a_model_with_stacked_compressor_pairs_gives_the_unstacked_logits(tiny_dir):
    """``V4Model._stack_compressor_matrices`` (a GPU model's at construction with
    ``SGLANG_DSV4_STACK_COMPRESSOR=1``; called here on the CPU): the model's entries become views
    and a prefill + decode gives the unstacked model's logits (summation order apart)."""
    def stack(model):
        model._stack_compressor_matrices()
        c4 = next(i for i, lw in enumerate(model.layers) if "attn.indexer.compressor.wkv.weight" in lw)
        assert "attn.indexer.compressor" + ops.KV_GATE in model.layers[c4]
        name = f"layers.{c4}.attn.indexer.compressor.wgate.weight"
        assert model.w[name] is model.layers[c4]["attn.indexer.compressor.wgate.weight"]

    err = _stacked_against_plain_logits(tiny_dir, stack)
    assert err < 1e-4, err


def test_fp8_matrices_that_would_split_a_scale_block_stay_apart():
    w8 = lambda n: ops.Fp8Weight(torch.zeros(n, 256).to(torch.float8_e4m3fn), torch.ones(-(-n // 128), 2))
    layer = {"attn.wq_a.weight": w8(96), "attn.wkv.weight": w8(128)}  # wkv would start mid-block
    assert ops.stack_x_matrices(layer) == [] and not ops.has_x_stack(layer)
    layer = {"attn.wq_a.weight": w8(128), "attn.wkv.weight": w8(96)}  # only the last may end mid-block
    assert ops.stack_x_matrices(layer) == [ops.X_STACK + "fp8"]
    assert layer["attn.wkv.weight"].scale.shape == (1, 2) and layer["attn.wkv.weight"].q.shape == (96, 256)


def test_a_model_with_stacked_input_matrices_gives_the_unstacked_logits(tiny_dir):
    """``V4Model._stack_x_matrices`` (which a GPU model runs at construction with
    ``SGLANG_DSV4_STACK_X=1``; called here on the CPU): the model's entries become views and a
    prefill + decode gives the unstacked model's logits (summation order apart)."""
    def stack(model):
        model._stack_x_matrices()
        assert all(ops.has_x_stack(lw) for lw in model.layers)
        assert model.w["layers.1.attn.wkv.weight"] is model.layers[1]["attn.wkv.weight"]

    err = _stacked_against_plain_logits(tiny_dir, stack)
    assert err < 1e-4, err
