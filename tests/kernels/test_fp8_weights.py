"""The fp8 weight mode on the CPU: the exact fp4 -> fp8 conversion, the loader's fp8 form and its
errors, the mode selection and the flag, the fp8 linear / grouped experts against torch
references, and the Triton kernel itself under TRITON_INTERPRET=1 (issue 12)."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_dsv4.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
from sglang_dsv4.checkpoint.loader import _shard_fp8, keeps_fp8, logical_from_stored
from sglang_dsv4.checkpoint.schema import Storage, checkpoint_tensors
from sglang_dsv4.checkpoint.writer import quantize_tensor
from sglang_dsv4.config import V4Config
from sglang_dsv4.core import ops
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.core.parallel import shard_weights
from sglang_dsv4.kernels import fp8_linear, fp8_moe, weight_mode
from sglang_dsv4.kernels.fp8_linear import (Fp8Weight, dequantize_act, fp8_linear_reference,
                                            qdq_act, quantize_act)
from sglang_dsv4.kernels.fp8_moe import fp8_grouped_experts, stack_fp8_experts
from sglang_dsv4.kernels.weight_mode import WeightModeError, select_weight_mode
from sglang_dsv4.launch_server import build_command, dsv4_arguments
from sglang_dsv4.quant import (dequantize_fp4_packed, dequantize_fp8_blockwise, fp4_to_fp8_blockwise, fp8_qat,
                               quantize_fp4_packed, quantize_fp8_blockwise)
from sglang_dsv4.tiny import PRESETS, random_weights
from sglang_dsv4.weight_bytes import weight_bytes


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


# ---- the fp4 -> fp8 block-128 conversion ---------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 512), (200, 96), (32, 64)])
def test_fp4_to_fp8_is_exact(shape):
    g = torch.Generator().manual_seed(0)
    # 32-groups of different magnitudes (up to ~10 binades apart within a block)
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-4, 4, (shape[0], shape[1] // 32), generator=g)
                                                     .float()).repeat_interleave(32, 1)
    packed, scale = quantize_fp4_packed(w)
    q, s = fp4_to_fp8_blockwise(packed, scale, "w")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(s.shape) == ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
    assert torch.equal(bits(dequantize_fp8_blockwise(q, s)), bits(dequantize_fp4_packed(packed, scale)))


def test_fp4_to_fp8_refuses_what_e4m3_cannot_hold():
    # one 32-group 2^20 above the others in the same 128x128 block: its small neighbours would
    # fall below e4m3's smallest subnormal under the block scale
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    w[0, :32] *= 2.0**20
    packed, scale = quantize_fp4_packed(w)
    with pytest.raises(ValueError, match="experts.7.w1.weight.*not exact"):
        fp4_to_fp8_blockwise(packed, scale, "layers.0.ffn.experts.7.w1.weight")


# ---- the loader in fp8 mode ----------------------------------------------------------------------

def _micro_cfg(**over) -> V4Config:
    return V4Config.from_dict({**PRESETS["micro"], **over})


def test_fp8_mode_holds_the_checkpoint_values(micro_dir):
    deq = load_checkpoint(micro_dir).tensors
    fp8 = load_checkpoint(micro_dir, weight_mode="fp8")
    specs = {s.name: s for s in checkpoint_tensors(fp8.config)}
    n = 0
    for name, t in fp8.tensors.items():
        if keeps_fp8(specs[name], fp8.config):
            assert isinstance(t, Fp8Weight), name
            # every expert tensor's fp4 -> fp8 conversion (and every fp8 matrix) is exact
            assert torch.equal(bits(t.dequantize()), bits(deq[name])), name
            n += 1
        else:
            assert not isinstance(t, Fp8Weight) and torch.equal(t, deq[name]), name
    experts = [s for s in specs.values() if s.storage is Storage.FP4]
    assert n > len(experts) > 0
    assert not isinstance(fp8.tensors["layers.0.attn.wo_a.weight"], Fp8Weight)  # bf16 unless GROUPED_WO_A


def _stored(cfg: V4Config, seed: int = 0) -> dict[str, torch.Tensor]:
    logical = random_weights(cfg, seed)
    out = {}
    for spec in checkpoint_tensors(cfg):
        out.update(quantize_tensor(spec, logical[spec.name]))
    return out


@pytest.fixture(scope="module")
def micro_stored():
    cfg = _micro_cfg()
    return cfg, _stored(cfg)


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_missing_and_misshapen_scales_are_named(micro_stored, mode):
    cfg, stored = micro_stored
    bad = dict(stored)
    del bad["layers.1.attn.wq_b.scale"]
    bad["layers.2.ffn.experts.3.w2.scale"] = bad["layers.2.ffn.experts.3.w2.scale"][:, :-1]
    with pytest.raises(CheckpointError) as e:
        logical_from_stored(cfg, bad, weight_mode=mode)
    msg = str(e.value)
    assert "missing tensor layers.1.attn.wq_b.scale" in msg
    assert "tensor layers.2.ffn.experts.3.w2.scale: expected shape [64, 1] float8_e8m0fnu, got [64, 0]" in msg


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_nan_scales_are_named(micro_stored, mode):
    cfg, stored = micro_stored
    bad = dict(stored)
    s = bad["layers.0.attn.wkv.scale"].clone()
    s.view(torch.uint8)[0, 0] = 0xFF
    bad["layers.0.attn.wkv.scale"] = s
    with pytest.raises(CheckpointError, match="layers.0.attn.wkv.scale: holds NaN"):
        logical_from_stored(cfg, bad, weight_mode=mode)


def test_fp8_mode_on_a_bf16_expert_checkpoint_names_the_flag(tmp_path):
    cfg = _micro_cfg(expert_dtype="bf16")
    path = write_checkpoint(cfg, random_weights(cfg, 0), tmp_path / "ckpt")
    assert load_checkpoint(path).tensors  # the bf16 mode reads it
    with pytest.raises(CheckpointError, match=r"--dsv4-weights fp8 \(dsv4_weights\).*bf16 \(config expert_dtype\)"):
        load_checkpoint(path, weight_mode="fp8")
    with pytest.raises(WeightModeError, match="--dsv4-weights fp8.*expert_dtype"):
        _select_on_gpu("fp8", cfg)
    assert _select_on_gpu("auto", cfg)[0] == "bf16"
    with pytest.raises(ValueError, match="weight_mode"):
        load_checkpoint(path, weight_mode="auto")


def _select_on_gpu(mode, cfg, tp: int = 1):
    """select_weight_mode as on an H200 where the kernels import."""
    saved = weight_mode.fp8_missing
    weight_mode.fp8_missing = lambda device: None
    try:
        return select_weight_mode(mode, "cuda", cfg, tp_size=tp)
    finally:
        weight_mode.fp8_missing = saved


def test_fp8_shards_cut_values_and_scales_alike():
    w = Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(512, 384)))
    ref = w.dequantize()
    for rule in (lambda t: t[128:384].clone(), lambda t: t[:, 256:].contiguous()):
        part = _shard_fp8("x", w, lambda _n, t: rule(t))
        assert torch.equal(part.dequantize(), rule(ref))
    with pytest.raises(CheckpointError, match="x: this rank's slice .* 128x128"):
        _shard_fp8("x", w, lambda _n, t: t[:, 100:200].contiguous())
    assert _shard_fp8("x", w, lambda _n, t: None) is None


@pytest.mark.parametrize("fp8_wo_a", [False, True])
def test_core_tensor_parallelism_cuts_fp8_matrices_as_their_values(tiny_dir, fp8_wo_a, monkeypatch):
    """``parallel.shard_weights`` on fp8-mode weights (the core's own TP, as the server's streamed
    loader does per tensor): each rank's Fp8Weight dequantises to its slice of the dequantised one
    (``fp8_wo_a``: attn.wo_a held fp8 too, cut by output groups)."""
    monkeypatch.setattr(fp8_linear, "GROUPED_WO_A", fp8_wo_a)
    deq = load_checkpoint(tiny_dir).tensors  # micro's matrices are too narrow to cut on 128 blocks
    fp8 = load_checkpoint(tiny_dir, weight_mode="fp8")
    cut = 0
    for rank in range(2):
        a = shard_weights(fp8.config, fp8.tensors, rank, 2, rank, 2)
        b = shard_weights(fp8.config, deq, rank, 2, rank, 2)
        assert a.keys() == b.keys()
        for name, t in a.items():
            if isinstance(t, Fp8Weight):
                cut += t.q is not fp8.tensors[name].q
                t = t.dequantize()
            assert torch.equal(bits(t), bits(b[name])), name
    assert cut > 0
    assert isinstance(a["layers.0.attn.wo_a.weight"], Fp8Weight) == fp8_wo_a


def test_grouped_wo_a_is_held_fp8_where_its_groups_keep_their_blocks(tiny_dir, micro_dir, monkeypatch):
    """``SGLANG_DSV4_WO_A_FP8``: the fp8 mode keeps ``attn.wo_a`` as the checkpoint stores it where
    each output group is whole 128x128 blocks (tiny: 8 groups of 128 rows over 4096 inputs), exactly
    the dequantised matrix; micro's groups of 16 rows stay bf16; the accounting follows the loader."""
    monkeypatch.setattr(fp8_linear, "GROUPED_WO_A", True)
    name = "layers.0.attn.wo_a.weight"
    tiny = load_checkpoint(tiny_dir, weight_mode="fp8")
    held = tiny.tensors[name]
    assert isinstance(held, Fp8Weight) and held.shape == (8 * 128, 4096)
    assert torch.equal(bits(held.dequantize()), bits(load_checkpoint(tiny_dir).tensors[name]))
    assert not isinstance(load_checkpoint(micro_dir, weight_mode="fp8").tensors[name], Fp8Weight)
    on = weight_bytes(tiny.config, "fp8").dense
    monkeypatch.setattr(fp8_linear, "GROUPED_WO_A", False)
    n = 8 * 128 * 4096
    layers = sum(s.name.endswith("attn.wo_a.weight") for s in checkpoint_tensors(tiny.config))  # the MTP's too
    assert layers == tiny.config.num_hidden_layers + 1
    assert weight_bytes(tiny.config, "fp8").dense - on == layers * (2 * n - n - n // 128 ** 2)


def test_attention_output_with_fp8_wo_a_is_the_bf16_wo_a_one(tiny_dir):
    """``ops.attention_output`` over an fp8 ``wo_a`` gives the bits of the same matrix held bf16
    (the loader's widening; the heads are not quantised: V4's wo_a is a bf16 einsum)."""
    cfg = load_checkpoint(tiny_dir).config
    g = torch.Generator().manual_seed(1)
    G, R, K = cfg.o_groups, cfg.o_lora_rank, cfg.num_attention_heads * cfg.head_dim // cfg.o_groups
    wq = Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(G * R, K, generator=g) * K ** -0.5))
    wo_b = torch.randn(cfg.hidden_size, G * R, generator=g) * (G * R) ** -0.5
    o = torch.randn(3, cfg.num_attention_heads, cfg.head_dim, generator=g)
    rope = ops.rope_at(torch.tensor([5, 900, 4000]), ops.layer_inv_freqs(cfg, 4))
    got = ops.attention_output(o, {"attn.wo_a.weight": wq, "attn.wo_b.weight": wo_b}, rope, cfg)
    held_bf16 = {"attn.wo_a.weight": wq.dequantize(torch.bfloat16), "attn.wo_b.weight": wo_b}
    assert torch.equal(got, ops.attention_output(o, held_bf16, rope, cfg))


# ---- mode selection and the flag -----------------------------------------------------------------

def test_mode_selection_on_this_cpu():
    cfg = _micro_cfg()
    assert select_weight_mode(None, "cpu", cfg)[0] == "bf16"
    mode, why = select_weight_mode("auto", "cpu", cfg)
    assert mode == "bf16" and "fp8 unavailable" in why and "device is cpu" in why
    assert select_weight_mode("bf16", "cpu", cfg)[0] == "bf16"
    with pytest.raises(WeightModeError, match=r"--dsv4-weights fp8 \(dsv4_weights\): cannot run here.*cpu"):
        select_weight_mode("fp8", "cpu", cfg)
    with pytest.raises(WeightModeError, match="w4a16.*not available.*Marlin"):
        select_weight_mode("w4a16", "cpu", cfg)
    with pytest.raises(WeightModeError, match="unknown weight mode 'int4'"):
        select_weight_mode("int4", "cpu", cfg)
    mode, why = _select_on_gpu("auto", cfg)
    assert mode == "fp8" and "auto -> fp8" in why
    assert _select_on_gpu("fp8", cfg)[0] == "fp8"
    assert _select_on_gpu("bf16", cfg)[0] == "bf16"


def test_weights_flag():
    out = dsv4_arguments(["--model-path", "x", "--dsv4-weights", "fp8"])
    assert json.loads(out[out.index("--json-model-override-args") + 1]) == {"dsv4_weights": "fp8"}
    with pytest.raises(SystemExit, match="expected one of auto, bf16, fp8"):
        dsv4_arguments(["--dsv4-weights=int8"])
    with pytest.raises(SystemExit, match="w4a16: not available"):
        dsv4_arguments(["--dsv4-weights", "w4a16"])
    with pytest.raises(SystemExit, match="cannot run here.*device is cpu"):
        build_command(["--model-path", "x", "--dsv4-weights", "fp8"], cuda=False)
    cmd, _ = build_command(["--model-path", "x", "--dsv4-weights=auto"], cuda=False)
    assert '{"dsv4_weights": "auto"}' in cmd


# ---- the fp8 linear and experts against torch references -----------------------------------------

def test_activation_quantisation_is_v4s_qat():
    x = torch.randn(9, 384) * torch.logspace(-3, 3, 384)
    assert torch.equal(qdq_act(x), fp8_qat(x, 128))  # e4m3, groups of 128, ue8m0 (pow-2) scales
    q, s = quantize_act(x[:, :300])  # K not a multiple of 128: the last group zero-padded
    assert q.shape == (9, 384) and s.shape == (9, 3)
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    assert torch.equal(dequantize_act(q, s, 300)[:, :256], fp8_qat(x[:, :256], 128))


def test_linear_dispatches_fp8_weights():
    w = Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(200, 300) * 0.05))
    x = torch.randn(5, 300)
    y = ops.linear(x, w)
    ref = qdq_act(x) @ w.dequantize().t()
    assert y.shape == (5, 200) and torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, fp8_linear_reference(ops.pad_rows(x), w)[:5])


def _fp8_experts(cfg, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    mk = lambda o, i: Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(o, i, generator=g) * i ** -0.5))
    return [mk(I, D) for _ in range(E)], [mk(I, D) for _ in range(E)], [mk(D, I) for _ in range(E)]


def test_expert_blocks_follow_the_pairs_an_expert_gets(monkeypatch):
    """The rows per expert block: by pair count by default; with ``EXPERT_BLOCKS`` by pairs per
    local expert (64 from 32 on average, else 16), the grouped rows a whole number of such blocks
    with room for every expert's padding."""
    monkeypatch.setattr(fp8_moe, "EXPERT_BLOCKS", False)
    assert [fp8_moe.block_rows(p, e) for p, e in ((6, 8), (384, 8), (1023, 256), (1024, 256))] == [16, 16, 16, 64]
    monkeypatch.setattr(fp8_moe, "EXPERT_BLOCKS", True)
    # 8 experts at 64 tokens x 6: 48 pairs an expert; 256 experts at 256 tokens: 6; 32 experts: 12 / 48
    assert [fp8_moe.block_rows(p, e) for p, e in ((384, 8), (1536, 256), (384, 32), (1536, 32), (255, 8))] == [
        64, 16, 16, 64, 16]
    for pairs, E in ((384, 8), (1536, 256), (7, 8)):
        A, M = fp8_moe.grouped_rows(pairs, E)
        assert A == fp8_moe.block_rows(pairs, E) and M % A == 0 and M >= pairs + min(pairs, E) * (A - 1)


@pytest.mark.parametrize("expert_blocks", [False, True])
@pytest.mark.parametrize("experts", [range(0, 8), range(4, 8)])
def test_grouped_fp8_experts_equal_the_sorted_loop(experts, expert_blocks, monkeypatch):
    """The grouped layout (sorting, padding, per-block experts, EP shares) with the reference GEMM
    against ``_sorted_experts`` over the same fp8 experts (per-expert ``ops.linear``), with either
    rule for the rows per block (``EXPERT_BLOCKS``: 150 tokens x 2 slots, 64-row blocks)."""
    monkeypatch.setattr(fp8_moe, "EXPERT_BLOCKS", expert_blocks)
    cfg = _micro_cfg()
    w1, w3, w2 = _fp8_experts(cfg, len(experts))
    stack, views = stack_fp8_experts(w1, w3, w2)
    w = {}
    for i, e in enumerate(experts):
        for m, v in zip(("w1", "w3", "w2"), views[i]):
            w[f"ffn.experts.{e}.{m}.weight"] = v
    for (a, b, c), v in zip(zip(w1, w3, w2), views):  # the views are the matrices themselves
        assert all(torch.equal(x.dequantize(), y.dequantize()) for x, y in zip((a, b, c), v))
    g = torch.Generator().manual_seed(3)
    T = 150 if expert_blocks else 37
    x = torch.randn(T, cfg.hidden_size, generator=g)
    chosen = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                          for _ in range(T)])
    gates = torch.rand(T, cfg.num_experts_per_tok, generator=g)
    assert fp8_moe.grouped_rows(chosen.numel(), len(experts))[0] == (64 if expert_blocks else 16)
    grouped = fp8_grouped_experts(x, chosen, gates, stack, experts.start, cfg.swiglu_limit)
    loop = ops._sorted_experts(x, chosen, gates, w, cfg, experts)
    err = (grouped - loop).norm(dim=-1) / loop.norm(dim=-1).clamp_min(1e-30)
    held = ((chosen >= experts.start) & (chosen < experts.stop)).any(1)
    assert err[held].max() < 1e-5, f"max rel err {err[held].max():.3g}"
    assert torch.equal(grouped[~held], torch.zeros_like(grouped[~held]))


@pytest.mark.parametrize("layer", [0, 3])  # micro: layers 0-1 hash-routed, 2-3 routed by score
def test_a_folded_shared_expert_gives_the_moe_of_the_unfolded_layer(micro_dir, layer):
    """The shared expert stacked last with the routed experts (``stack_experts(fold_shared=True)``):
    ``ops.moe`` routes each token one more slot to it, gate 1, through the grouped fp8 experts
    (the reference GEMM here); the same MoE output as the routed loop plus the dense shared
    expert, and the shared entries become views of the stack (no second copy)."""
    ckpt = load_checkpoint(micro_dir, weight_mode="fp8")
    cfg = ckpt.config
    plain, folded = ops.layer_view(ckpt.tensors, f"layers.{layer}"), ops.layer_view(ckpt.tensors, f"layers.{layer}")
    experts = range(cfg.n_routed_experts)
    ops.stack_experts(plain, experts)
    ops.stack_experts(folded, experts, fold_shared=True)
    assert not plain[ops.FP8_EXPERTS].shared and folded[ops.FP8_EXPERTS].shared
    assert folded[ops.FP8_EXPERTS].num_experts == cfg.n_routed_experts + 1
    stack = folded[ops.FP8_EXPERTS]
    for m in ("w1", "w2"):
        view = folded[f"{ops.SHARED_EXPERT}.{m}.weight"]
        assert torch.equal(view.dequantize(), plain[f"{ops.SHARED_EXPERT}.{m}.weight"].dequantize())
        base = (stack.w13 if m == "w1" else stack.w2).q
        assert view.q.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(5)
    T = 29
    x = torch.randn(T, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    hashed = layer < cfg.num_hash_layers
    want = ops.moe(x, ids, plain, cfg, hashed)   # the CPU: the sorted loop + the dense shared expert
    got = ops.moe(x, ids, folded, cfg, hashed)   # one grouped pass, k + 1 slots
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 1e-5, f"max rel err {err.max():.3g}"


def test_a_model_with_folded_shared_experts_gives_the_unfolded_logits(micro_dir, monkeypatch):
    """``fp8_moe.FOLD_SHARED`` through ``V4Model._stack_experts`` (which a GPU model runs at
    construction; called here on the CPU): every layer's stack takes its shared expert, the
    model's shared entries are views of it, and the logits are the unfolded model's (the fp8
    reference GEMMs: summation order apart)."""
    from sglang_dsv4.kernels import fp8_moe

    ckpt = load_checkpoint(micro_dir, weight_mode="fp8")
    cfg = ckpt.config
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    out = {}
    for fold in (False, True):
        monkeypatch.setattr(fp8_moe, "FOLD_SHARED", fold)
        model = V4Model(cfg, dict(ckpt.tensors))
        model._stack_experts()
        for i in range(cfg.num_hidden_layers):
            assert model.layers[i][ops.FP8_EXPERTS].shared == fold
            view = model.w[f"layers.{i}.{ops.SHARED_EXPERT}.w2.weight"].q
            stack = model.layers[i][ops.FP8_EXPERTS].w2.q
            assert (view.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()) == fold
        cache = V4Cache(cfg, max_requests=1, max_total_tokens=256)
        req = cache.new_request()
        out[fold] = torch.cat([model.forward(cache, [req], [ids[:20]])[0]] +
                              [model.forward(cache, [req], [ids[t:t + 1]])[0] for t in range(20, 30)])
    err = (out[True] - out[False]).norm(dim=-1) / out[False].norm(dim=-1)
    assert err.max() < 1e-4, err.max()


def test_only_a_shared_expert_of_the_routed_shapes_is_stacked():
    cfg = _micro_cfg()
    w1, w3, w2 = _fp8_experts(cfg, 3)
    narrow = _fp8_experts(_micro_cfg(moe_intermediate_size=16), 1)
    with pytest.raises(ValueError, match="shared expert"):
        stack_fp8_experts(w1, w3, w2, shared=(narrow[0][0], narrow[1][0], narrow[2][0]))


def test_micro_model_runs_in_fp8_mode(micro_dir):
    """The whole model over fp8 weights (CPU: the torch references): close to the dequantised
    model, as the activation quantisation allows."""
    outs = []
    for mode in ("bf16", "fp8"):
        ckpt = load_checkpoint(micro_dir, weight_mode=mode)
        model = V4Model(ckpt.config, ckpt.tensors)
        assert model.weight_mode == mode
        cache = V4Cache(ckpt.config, max_requests=1, max_total_tokens=512)
        req = cache.new_request()
        ids = torch.randint(0, ckpt.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
        out = [model.forward(cache, [req], [ids[:16]])[0]]
        out += [model.forward(cache, [req], [ids[t:t + 1]])[0] for t in range(16, 24)]
        outs.append(torch.cat(out))
    err = (outs[1] - outs[0]).norm(dim=-1) / outs[0].norm(dim=-1)
    assert torch.isfinite(outs[1]).all() and 0 < err.median() < 0.3


# ---- the Triton kernel, interpreted on the CPU ----------------------------------------------------

_INTERPRETED = r"""
import torch
from sglang_dsv4.kernels.fp8_linear import Fp8Weight, fp8_gemm, fp8_gemm_reference, fp8_linear, fp8_linear_reference, quantize_act
from sglang_dsv4.kernels.fp8_moe import fp8_grouped_experts, stack_fp8_experts
from sglang_dsv4.quant import quantize_fp8_blockwise
torch.manual_seed(0)
mk = lambda n, k: Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(n, k) * k ** -0.5))
worst = 0.0
# the last three split K (fp8_linear.split_k: 4, 2 and 4 splits, a ragged last K block in the middle one)
for M, N, K in [(1, 128, 128), (3, 200, 300), (20, 256, 256), (33, 64, 640), (2, 512, 2048), (5, 300, 1000),
                (17, 256, 2048)]:
    w, x = mk(N, K), torch.randn(M, K)
    a, b = fp8_linear(x, w), fp8_linear_reference(x, w)
    worst = max(worst, ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item())
E, D, I, T, k = 6, 1024, 160, 19, 3  # D = 8 K blocks: the first GEMM splits K in 2
stack, _ = stack_fp8_experts([mk(I, D) for _ in range(E)], [mk(I, D) for _ in range(E)], [mk(D, I) for _ in range(E)])
x = torch.randn(T, D)
chosen = torch.stack([torch.randperm(8)[:k] for _ in range(T)])
gates = torch.rand(T, k)
import sglang_dsv4.kernels.fp8_linear as fl
for first in (0, 2):
    got = fp8_grouped_experts(x, chosen, gates, stack, first, 10.0)
    fl.INTERPRET = False  # the reference GEMM, same layout
    ref = fp8_grouped_experts(x, chosen, gates, stack, first, 10.0)
    fl.INTERPRET = True
    held = ref.norm(dim=-1) > 0
    worst = max(worst, ((got - ref).norm(dim=-1)[held] / ref.norm(dim=-1)[held]).max().item())
    assert torch.equal(got[~held], ref[~held])
print("WORST", worst)
"""


def test_triton_kernel_interpreted(triton_interpreted):
    worst = triton_interpreted(_INTERPRETED)
    assert worst < 1e-5, worst


_SWIGLU_EPILOGUE = r"""
import torch
from sglang_dsv4.kernels import fp8_moe
from sglang_dsv4.kernels.fp8_linear import Fp8Weight, fp8_gemm, quantize_act
from sglang_dsv4.kernels.fp8_moe import (_gated_swiglu_quantised, _row_layout, fp8_grouped_experts, stack_fp8_experts,
                                         swiglu_epilogue_fits, swiglu_gemm)
from sglang_dsv4.quant import quantize_fp8_blockwise
torch.manual_seed(0)
mk = lambda n, k: Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(n, k) * k ** -0.5))
worst = 0
fp8_moe.SWIGLU_ONE_WAVE = False  # the rule where K stays whole (a few tiles here); the one-wave rule last
# I = 160: w1 | w3 padded to 256 rows each; limit 0: no clamp; 0.5: most values clamped; experts
# 1..E held of 0..E+1 (pairs held elsewhere); 64-row blocks past the last group (-1)
for E, D, I, T, k, limit in [(6, 256, 160, 19, 3, 10.0), (4, 384, 256, 40, 2, 0.0), (5, 256, 128, 7, 2, 0.5)]:
    stack, _ = stack_fp8_experts([mk(I, D) for _ in range(E)], [mk(I, D) for _ in range(E)],
                                 [mk(D, I) for _ in range(E)])
    x = torch.randn(T, D) * 3
    chosen = torch.stack([torch.randperm(E + 2)[:k] for _ in range(T)])
    gates = torch.rand(T, k)
    xq, xs = quantize_act(x)
    for A in (16, 64):
        M = -(-(chosen.numel() + min(chosen.numel(), E) * (A - 1)) // A) * A
        assert swiglu_epilogue_fits(M, stack, A, x.device)
        tok, be, _, gr = _row_layout(chosen, gates, 1, E, A, M)
        h = fp8_gemm(xq, xs, stack.w13, torch.float32, rows=tok, block_expert=be, block_m=A)
        two_step = _gated_swiglu_quantised(h, gr, stack.inter, stack.inter_padded, limit)
        fused = swiglu_gemm(xq, xs, stack, tok, be, gr, A, limit)
        worst += int(not torch.equal(two_step[1], fused[1]))  # the scales
        worst += int((two_step[0].view(torch.uint8) != fused[0].view(torch.uint8)).sum())  # the e4m3 bytes
    outs = []
    for on in (False, True):
        fp8_moe.FUSED_SWIGLU = on
        outs.append(fp8_grouped_experts(x, chosen, gates, stack, 1, limit))
    worst += int(not torch.equal(*outs))
# K of 8 blocks over few tiles splits (fp8_linear.split_k): the epilogue does not fit there
stack, _ = stack_fp8_experts([mk(128, 1024)], [mk(128, 1024)], [mk(1024, 128)])
worst += int(swiglu_epilogue_fits(32, stack, 16, torch.device("cpu")))
# 140 tiles (one wave of the interpreter's 132 SMs, short of two): K splits, unless SWIGLU_ONE_WAVE
worst += int(swiglu_epilogue_fits(16 * 140, stack, 16, torch.device("cpu")))
fp8_moe.SWIGLU_ONE_WAVE = True
worst += int(not swiglu_epilogue_fits(16 * 140, stack, 16, torch.device("cpu")))
worst += int(swiglu_epilogue_fits(16 * 131, stack, 16, torch.device("cpu")))
print("WORST", worst)
"""


def test_the_swiglu_epilogue_gives_the_two_step_bytes(triton_interpreted):
    """GEMM 1 with V4's gated SwiGLU and quantisation as its epilogue (``fp8_moe.swiglu_gemm``),
    interpreted, against the GEMM kernel followed by ``_gated_swiglu_quantised`` in torch: the same
    scales and e4m3 bytes (clamped and unclamped, padded w1 | w3, padding rows and blocks, pairs
    held elsewhere), so the routed experts' output with ``FUSED_SWIGLU`` is the same tensor; and
    where K would be split the epilogue is not taken (with ``SWIGLU_ONE_WAVE``: where the grid
    fills the SMs once, split or not)."""
    assert triton_interpreted(_SWIGLU_EPILOGUE) == 0


_TRACED = r"""
import torch
from sglang_dsv4.kernels.fp8_linear import Fp8Weight, fp8_gemm_op, fp8_linear, quantize_act
from sglang_dsv4.quant import quantize_fp8_blockwise
torch.manual_seed(0)
mk = lambda n, k: Fp8Weight.from_checkpoint(*quantize_fp8_blockwise(torch.randn(n, k) * k ** -0.5))
worst = 0
# 1 split, then 4, 2 and 4 splits (fp8_linear.split_k): the traced GEMM returns the partials
for M, N, K in [(1, 128, 128), (2, 512, 2048), (5, 300, 1000), (17, 256, 2048)]:
    w = mk(N, K)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(M, K).to(dtype)
        f = lambda x: fp8_linear(x * 2, w) + 1
        torch._dynamo.reset()
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)  # fullgraph: no graph break
        want = f(x)  # eager: the kernel's own split-K sum
        if dtype == torch.float32:
            worst += int(not torch.equal(got, want))
        else:  # the interpreter truncates a bf16 store (the GPU rounds: test_fp8_gpu): an ulp or two
            worst += int(not ((got.float() - want.float()).abs() <= (want.float().abs() + 1) * 2 ** -6).all())
        q, s = quantize_act(x)
        for sum_splits in (True, False):  # the op's shape function against its launch
            torch.library.opcheck(fp8_gemm_op, (q, s, w.q, w.scale, dtype), dict(sum_splits=sum_splits),
                                  test_utils=("test_faketensor",))
print("WORST", worst)
"""


def test_a_traced_fp8_linear_runs_the_kernel_without_a_graph_break(triton_interpreted):
    """Traced (``core.compiled``'s regions), ``fp8_linear`` reaches the kernel through the
    ``sglang_dsv4::fp8_gemm`` op: one graph around it, the eager result's bits (the region adds
    the split-K partials in the sum kernel's order), and the op's shape function gives the
    launch's output for split and unsplit GEMMs."""
    assert triton_interpreted(_TRACED) == 0


def test_fp8_needs_tp_cuts_on_scale_blocks():
    """TP cuts wq_b by heads and wo_b by output groups: where a rank's share is not a multiple of
    128 (micro at TP 2: 160 rows), fp8 is refused by name and auto takes bf16; V4-Flash splits."""
    micro = _micro_cfg()
    assert weight_mode.fp8_tp_problem(micro, 1) is None
    assert "wq_b" in weight_mode.fp8_tp_problem(micro, 2)
    mode, why = _select_on_gpu("auto", micro, 2)
    assert mode == "bf16" and "scale blocks" in why
    with pytest.raises(WeightModeError, match=r"--dsv4-weights fp8 .*--tp-size 2.*scale blocks"):
        _select_on_gpu("fp8", micro, 2)
    flash = V4Config()
    assert all(weight_mode.fp8_tp_problem(flash, tp) is None for tp in (1, 2, 4, 8))
    assert _select_on_gpu("auto", flash, 8)[0] == "fp8"

