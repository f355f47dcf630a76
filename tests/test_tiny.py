"""The tiny-checkpoint builder: presets, deterministic output, cache, init statistics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sglang_dsv4 import tiny
from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.config import V4Config


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def micro0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_tiny("micro", 0, tmp_path_factory.mktemp("tiny") / "micro0")


def test_presets_are_valid_configs() -> None:
    micro, big = tiny.preset_config("micro"), tiny.preset_config("tiny")
    assert micro.layer_ratios == (0, 4, 128, 4) and micro.num_mtp_layers == 1
    assert micro.vocab_size == 129280 and big.vocab_size == 129280
    big.check_flashmla()
    assert big.rope_scaling is not None and big.rope_scaling.original_max_position_embeddings == 4096
    # fields not in the preset keep the V4-Flash defaults
    assert micro.hc_mult == 4 and micro.routed_scaling_factor == 1.5 and micro.expert_dtype == "fp4"
    with pytest.raises(ValueError, match="unknown preset"):
        tiny.preset_config("huge")
    # V4-Flash dimensions cut in depth and experts (built only where there is room: on the GPU)
    flash8, flash43 = tiny.preset_config("flash8"), tiny.preset_config("flash43")
    assert (flash8.num_hidden_layers, flash8.n_routed_experts, flash8.hidden_size) == (8, 32, 4096)
    assert (flash43.num_hidden_layers, flash43.n_routed_experts) == (43, 8)
    flash8.check_flashmla()


def test_same_seed_same_bytes(micro0: Path, tmp_path: Path) -> None:
    assert tiny.main(["--preset", "micro", "--seed", "0", "--out", str(tmp_path / "again")]) == 0
    first, second = _files(micro0), _files(tmp_path / "again")
    assert sorted(first) == ["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                             "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    assert first == second


def test_different_seed_different_weights(micro0: Path, tmp_path: Path) -> None:
    other = _files(tiny.build_tiny("micro", 1, tmp_path / "seed1"))
    first = _files(micro0)
    assert other["config.json"] == first["config.json"]
    for name in first:
        if name.startswith("model-"):
            assert other[name] != first[name], name


def test_init_statistics(micro0: Path) -> None:
    ckpt = load_checkpoint(micro0)
    t, cfg = ckpt.tensors, ckpt.config
    for layer in range(cfg.num_hash_layers):
        table = t[f"layers.{layer}.ffn.gate.tid2eid"]
        assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
        assert int(table.min()) >= 0 and int(table.max()) < cfg.n_routed_experts
        assert bool((table[:, 0] != table[:, 1]).all())  # distinct experts per token
        assert len(torch.unique(table[:, 0])) == cfg.n_routed_experts
    assert abs(float(t["embed.weight"].std()) - 1.0) < 0.02
    assert abs(float(t["head.weight"].std()) - cfg.hidden_size**-0.5) < 0.01
    assert abs(float(t["layers.1.attn.wq_a.weight"].std()) - cfg.hidden_size**-0.5) < 0.02
    assert abs(float(t["layers.1.hc_attn_fn"].std()) - (cfg.hc_mult * cfg.hidden_size) ** -0.5) < 0.005
    scale = t["layers.2.hc_ffn_scale"]
    assert bool(((scale >= 0.5) & (scale <= 1.5)).all())
    norm = t["layers.2.attn.kv_norm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05 and 0.05 < float(norm.std()) < 0.2
    for name, value in t.items():
        assert bool(torch.isfinite(value.float()).all()), name


def test_ensure_tiny_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_build = tiny.build_tiny

    def crashing_build(preset: str, seed: int, out_dir: Path) -> Path:
        calls.append(out_dir)
        (Path(out_dir) / "config.json").write_text("{}")  # a partial build
        raise RuntimeError("boom")

    monkeypatch.setattr(tiny, "build_tiny", crashing_build)
    with pytest.raises(RuntimeError, match="boom"):
        tiny.ensure_tiny("micro", 3, tmp_path)
    assert os.listdir(tmp_path) == []  # nothing left behind to be reused

    monkeypatch.setattr(tiny, "build_tiny", lambda *a: calls.append(a[2]) or real_build(*a))
    path = tiny.ensure_tiny("micro", 3, tmp_path)
    assert path.parent == tmp_path and (path / "model.safetensors.index.json").is_file()
    assert tiny.ensure_tiny("micro", 3, tmp_path) == path
    assert len(calls) == 2  # the crash and one real build; the second ensure reused it
    assert os.listdir(tmp_path) == [path.name]
    assert V4Config.from_json(path) == tiny.preset_config("micro")


def test_tiny_preset_builds_and_loads(tmp_path: Path) -> None:
    path = tiny.build_tiny("tiny", 0, tmp_path / "tiny")
    ckpt = load_checkpoint(path, names=["layers.1.attn.wq_b.weight", "layers.3.ffn.experts.15.w2.weight"])
    assert ckpt.tensors["layers.1.attn.wq_b.weight"].shape == (64 * 512, 256)
    assert ckpt.tensors["layers.3.ffn.experts.15.w2.weight"].shape == (256, 256)
    assert len(list(path.glob("model-*.safetensors"))) >= 2
