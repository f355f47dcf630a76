"""Round trip of the checkpoint writer and loader on the micro preset, and the loader's errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang_dsv4.checkpoint import CheckpointError, load_checkpoint, write_checkpoint
from sglang_dsv4.checkpoint.schema import Storage, checkpoint_tensors
from sglang_dsv4.checkpoint.writer import random_stored, write_random_checkpoint
from sglang_dsv4.config import ConfigError
from sglang_dsv4.quant import (dequantize_fp4_packed, dequantize_fp8_blockwise, quantize_fp4_packed,
                               quantize_fp8_blockwise)
from sglang_dsv4.tiny import preset_config, random_weights

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    cfg = preset_config("micro")
    weights = random_weights(cfg, seed=0)
    out = write_checkpoint(cfg, weights, tmp_path_factory.mktemp("ckpt") / "micro")
    return out, weights


@pytest.fixture()
def broken(micro: tuple[Path, dict], tmp_path: Path) -> Path:
    """A private copy of the micro checkpoint that a test may damage."""
    return Path(shutil.copytree(micro[0], tmp_path / "copy"))


def _weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / INDEX).read_text())["weight_map"]


def _rewrite_shard(ckpt: Path, tensor: str, edit) -> None:
    shard = ckpt / _weight_map(ckpt)[tensor]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_round_trip_matches_quantise_dequantise(micro: tuple[Path, dict]) -> None:
    path, weights = micro
    ckpt = load_checkpoint(path)
    cfg = preset_config("micro")
    assert ckpt.config == cfg
    specs = checkpoint_tensors(cfg)
    assert set(ckpt.tensors) == {s.name for s in specs}
    for spec in specs:
        w, got = weights[spec.name], ckpt.tensors[spec.name]
        if spec.storage is Storage.FP8:
            want = dequantize_fp8_blockwise(*quantize_fp8_blockwise(w))
        elif spec.storage is Storage.FP4:
            want = dequantize_fp4_packed(*quantize_fp4_packed(w))
        elif spec.storage is Storage.BF16:
            want = w.to(torch.bfloat16).float()
        elif spec.storage is Storage.INT64:
            want = w
        else:
            want = w.float()
        assert got.dtype == (torch.int64 if spec.storage is Storage.INT64 else torch.float32), spec.name
        assert tuple(got.shape) == spec.shape, spec.name
        assert torch.equal(got, want), spec.name


def test_load_dtype_and_subset(micro: tuple[Path, dict]) -> None:
    names = ["embed.weight", "layers.1.attn.wq_a.weight", "layers.0.ffn.gate.tid2eid"]
    ckpt = load_checkpoint(micro[0], dtype=torch.bfloat16, names=names)
    assert set(ckpt.tensors) == set(names)
    assert ckpt.tensors["embed.weight"].dtype == torch.bfloat16
    assert ckpt.tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    with pytest.raises(CheckpointError, match="layers.9.attn.wq_a.weight"):
        load_checkpoint(micro[0], names=["layers.9.attn.wq_a.weight"])


def test_stored_dtypes_are_the_real_ones(micro: tuple[Path, dict]) -> None:
    path, _ = micro
    wm = _weight_map(path)
    raw: dict[str, tuple[str, list[int]]] = {}
    for shard in sorted(set(wm.values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for k in f.keys():
                view = f.get_slice(k)
                raw[k] = (view.get_dtype(), view.get_shape())
    assert raw["layers.1.attn.wq_a.weight"] == ("F8_E4M3", [32, 64])
    assert raw["layers.1.attn.wq_a.scale"] == ("F8_E8M0", [1, 1])
    assert raw["layers.1.attn.wq_b.weight"] == ("F8_E4M3", [320, 32])
    assert raw["layers.1.attn.wq_b.scale"] == ("F8_E8M0", [3, 1])
    # FP4 routed experts: packed int8 [out, in/2], e8m0 scales [out, in/32]
    assert raw["layers.2.ffn.experts.3.w1.weight"] == ("I8", [32, 32])
    assert raw["layers.2.ffn.experts.3.w1.scale"] == ("F8_E8M0", [32, 2])
    assert raw["layers.2.ffn.experts.3.w2.weight"] == ("I8", [64, 16])
    assert raw["layers.2.ffn.experts.3.w2.scale"] == ("F8_E8M0", [64, 1])
    assert raw["layers.0.ffn.gate.tid2eid"] == ("I64", [129280, 2])
    assert raw["layers.3.ffn.gate.bias"] == ("F32", [8])
    assert raw["embed.weight"] == ("BF16", [129280, 64])
    assert raw["layers.1.attn.compressor.wkv.weight"] == ("BF16", [160, 64])
    assert raw["layers.1.attn.compressor.ape"] == ("F32", [4, 160])
    assert raw["layers.2.attn.compressor.ape"] == ("F32", [128, 80])
    assert raw["mtp.0.hc_head_fn"] == ("F32", [4, 256])
    assert "layers.0.ffn.gate.bias" not in raw and "layers.2.ffn.gate.tid2eid" not in raw


def test_index_covers_every_stored_tensor(micro: tuple[Path, dict]) -> None:
    path, _ = micro
    index = json.loads((path / INDEX).read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    assert len(shards) >= 2
    assert shards == sorted(p.name for p in path.glob("model-*.safetensors"))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    stored: dict[str, str] = {}
    total = 0
    for shard in shards:
        for k, t in load_file(str(path / shard)).items():
            stored[k] = shard
            total += t.numel() * t.element_size()
    assert stored == wm
    expected = {n for s in checkpoint_tensors(preset_config("micro")) for n in s.stored_shapes()}
    assert set(wm) == expected
    assert index["metadata"]["total_size"] == total
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                          "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["compress_ratios"] == [0, 4, 128, 4, 0]


def test_single_file_layout(micro: tuple[Path, dict], tmp_path: Path) -> None:
    src, _ = micro
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_weight_map(src).values())):
        merged.update(load_file(str(src / shard)))
    merged["some.extra.tensor"] = torch.zeros(3)  # not in the schema: ignored
    save_file(merged, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    single = load_checkpoint(tmp_path, names=["layers.2.ffn.experts.0.w2.weight", "mtp.0.e_proj.weight"])
    full = load_checkpoint(src, names=["layers.2.ffn.experts.0.w2.weight", "mtp.0.e_proj.weight"])
    for k, v in full.tensors.items():
        assert torch.equal(single.tensors[k], v)


def test_random_checkpoint_streams_random_stored_into_a_valid_checkpoint(tmp_path: Path) -> None:
    """The flash presets' writer: random_stored's tensors, shard by shard, a checkpoint the loader
    validates in full; the bytes are random_stored's own."""
    cfg = preset_config("micro")
    out = write_random_checkpoint(cfg, tmp_path / "random", seed=3)
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == cfg.num_hidden_layers
    loaded = load_checkpoint(out)  # every tensor: names, shapes, stored dtypes
    assert set(loaded.tensors) == {s.name for s in checkpoint_tensors(cfg)}
    stored = dict(random_stored(cfg, "cpu", seed=3))
    on_disk = {}
    for shard in sorted(set(_weight_map(out).values())):
        on_disk.update(load_file(str(out / shard)))
    assert set(on_disk) == set(stored)
    for name in ("layers.1.ffn.experts.0.w1.weight", "layers.1.ffn.experts.0.w1.scale", "embed.weight"):
        assert torch.equal(on_disk[name].view(torch.uint8), stored[name].view(torch.uint8)), name
    with pytest.raises(CheckpointError, match="already holds checkpoint files"):
        write_random_checkpoint(cfg, out)


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    cfg = preset_config("micro")
    weights = random_weights(cfg, seed=1)
    bad = dict(weights)
    del bad["layers.0.attn.wkv.weight"]
    with pytest.raises(CheckpointError, match="layers.0.attn.wkv.weight"):
        write_checkpoint(cfg, bad, tmp_path / "a")
    bad = dict(weights, **{"layers.0.attn.wkv.weight": torch.zeros(3, 3)})
    with pytest.raises(CheckpointError, match=r"layers.0.attn.wkv.weight: expected logical shape \[80, 64\]"):
        write_checkpoint(cfg, bad, tmp_path / "b")
    write_checkpoint(cfg, weights, tmp_path / "c", max_shard_bytes=10**12)
    assert [p.name for p in (tmp_path / "c").glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    with pytest.raises(CheckpointError, match="already holds checkpoint files"):
        write_checkpoint(cfg, weights, tmp_path / "c")


# ---- loader errors ---------------------------------------------------------------------------

def test_missing_config(broken: Path) -> None:
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_checkpoint(broken)


def test_missing_index(broken: Path) -> None:
    (broken / INDEX).unlink()
    with pytest.raises(CheckpointError, match=r"missing model\.safetensors\.index\.json"):
        load_checkpoint(broken)


def test_missing_shard_file(broken: Path) -> None:
    shard = _weight_map(broken)["layers.1.attn.wq_a.weight"]
    (broken / shard).unlink()
    with pytest.raises(CheckpointError, match=f"names shard file {shard}.*does not exist"):
        load_checkpoint(broken)


def test_truncated_shard(broken: Path) -> None:
    shard = broken / _weight_map(broken)["layers.1.attn.wq_a.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a valid safetensors file"):
        load_checkpoint(broken)
    shard.write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointError, match=f"{shard.name} is not a valid safetensors file"):
        load_checkpoint(broken)


def test_deleted_tensor(broken: Path) -> None:
    _rewrite_shard(broken, "layers.1.attn.wq_a.weight", lambda t: t.pop("layers.1.attn.wq_a.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.1\.attn\.wq_a\.weight "
                                              r"\(expected shape \[32, 64\] float8_e4m3fn"):
        load_checkpoint(broken)


def test_tensor_missing_from_index(broken: Path) -> None:
    index = json.loads((broken / INDEX).read_text())
    del index["weight_map"]["layers.3.ffn.experts.7.w2.scale"]
    (broken / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.3\.ffn\.experts\.7\.w2\.scale "
                                              r"\(expected shape \[64, 1\] float8_e8m0fnu"):
        load_checkpoint(broken)


def test_wrong_shape_and_dtype(broken: Path) -> None:
    _rewrite_shard(broken, "layers.1.attn.wkv.weight", lambda t: t.update(
        {"layers.1.attn.wkv.weight": torch.zeros(81, 64, dtype=torch.float8_e4m3fn)}))
    _rewrite_shard(broken, "layers.0.ffn.gate.weight", lambda t: t.update(
        {"layers.0.ffn.gate.weight": torch.zeros(8, 64, dtype=torch.float32)}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(broken)
    msg = str(info.value)
    assert "2 problems" in msg
    assert "tensor layers.1.attn.wkv.weight" in msg
    assert "expected shape [80, 64] float8_e4m3fn, got [81, 64] float8_e4m3fn" in msg
    assert "tensor layers.0.ffn.gate.weight" in msg
    assert "expected shape [8, 64] bfloat16, got [8, 64] float32" in msg


def test_invalid_config(broken: Path) -> None:
    raw = json.loads((broken / "config.json").read_text())
    raw["num_hidden_layers"] = 3  # 5 compress_ratios for 3 + 1 layers
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="compress_ratios"):
        load_checkpoint(broken)


def test_streamed_weights_as_sglang_passes_them(micro: tuple[Path, dict]) -> None:
    """The SGLang model's load_weights path: stored tensors by name -> the same logical tensors,
    and a missing or misshapen stored tensor is named."""
    from sglang_dsv4.checkpoint.loader import logical_from_stored
    from sglang_dsv4.config import V4Config

    ckpt, _ = micro
    stored = {}
    for fname in sorted(set(_weight_map(ckpt).values())):
        stored.update(load_file(str(ckpt / fname)))
    cfg = V4Config.from_json(ckpt)
    logical = logical_from_stored(cfg, stored)
    loaded = load_checkpoint(ckpt).tensors
    assert logical.keys() == loaded.keys()
    assert all(torch.equal(logical[k], loaded[k]) for k in loaded)
    broken = dict(stored)
    del broken["layers.1.attn.wq_a.weight"]
    broken["layers.2.attn.wkv.scale"] = broken["layers.2.attn.wkv.scale"][:0]
    with pytest.raises(CheckpointError) as e:
        logical_from_stored(cfg, broken)
    assert "missing tensor layers.1.attn.wq_a.weight (expected shape [32, 64] float8_e4m3fn" in str(e.value)
    assert "tensor layers.2.attn.wkv.scale: expected shape [1, 1] float8_e8m0fnu, got [0, 1]" in str(e.value)


def test_streamed_weights_are_sharded_one_tensor_at_a_time(micro: tuple[Path, dict]) -> None:
    """A rank of TP=2 x EP=2 streaming the stored tensors in any order (scales before weights
    here) gets exactly ``shard_weights`` of the whole model; other ranks' experts never load."""
    from sglang_dsv4.checkpoint.loader import logical_from_stored
    from sglang_dsv4.config import V4Config
    from sglang_dsv4.core.parallel import TensorSharder, shard_weights

    ckpt, _ = micro
    stored = {}
    for fname in sorted(set(_weight_map(ckpt).values())):
        stored.update(load_file(str(ckpt / fname)))
    cfg = V4Config.from_json(ckpt)
    sharder = TensorSharder(cfg, tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    streamed = logical_from_stored(cfg, reversed(list(stored.items())), shard=sharder)
    expected = shard_weights(cfg, load_checkpoint(ckpt).tensors, 1, 2, 1, 2)
    assert streamed.keys() == expected.keys()
    assert all(torch.equal(streamed[k], expected[k]) for k in expected)
    assert not any(k.startswith("layers.0.ffn.experts.0.") for k in streamed)
