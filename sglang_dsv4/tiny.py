"""Tiny random-weight V4 checkpoints, generated deterministically from a seed.

``python -m sglang_dsv4.tiny --preset micro --seed 0 --out DIR`` writes a complete checkpoint
directory (config.json, safetensors shards + index, the real V4 tokenizer files).

Random init, so that a random model gives non-degenerate, non-exploding activations (``std`` is a
standard deviation): linear weights [out, in] (head, gate.weight and ``hc_*_fn`` included) normal
with std ``in**-0.5``, i.e. variance 1/in; embed std 1; norm weights 1 + normal(std 0.1);
``hc_*_base`` std 0.5; ``hc_*_scale`` uniform in [0.5, 1.5); attn_sink std 1; compressor ape std
0.5; gate.bias std 0.1; ``tid2eid`` num_experts_per_tok distinct experts per token id.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .checkpoint.schema import Storage, TensorSpec, checkpoint_tensors
from .checkpoint.writer import V4_QUANTIZATION_CONFIG, write_checkpoint, write_random_checkpoint
from .config import V4Config
from .tokenizer_files import write_tokenizer_files

# Bump when the generated files change, so that ensure_tiny caches are not reused across versions.
FORMAT_VERSION = 1

_COMMON: dict[str, Any] = {
    "num_hidden_layers": 4,
    "compress_ratios": [0, 4, 128, 4, 0],
    "sliding_window": 128,
    "num_experts_per_tok": 2,
    "num_hash_layers": 2,
    "num_nextn_predict_layers": 1,
    "quantization_config": dict(V4_QUANTIZATION_CONFIG),
}

PRESETS: dict[str, dict[str, Any]] = {
    "micro": {
        **_COMMON,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 80,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 8,
        "n_routed_experts": 8,
        "moe_intermediate_size": 32,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096,
    },
    # FlashMLA-shaped attention: head_dim 512 / rope 64 / 64 query heads.
    "tiny": {
        **_COMMON,
        "hidden_size": 256,
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 256,
        "o_groups": 8,
        "o_lora_rank": 128,
        "index_n_heads": 16,
        "index_head_dim": 128,
        "index_topk": 128,
        "n_routed_experts": 16,
        "moe_intermediate_size": 256,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 65536,
    },
}
# V4-Flash dimensions (the V4Config defaults: 4096 hidden, 64 heads of 512, 256-wide experts of
# 2048, top-6), cut in depth and routed experts to fit one GPU: the decode benchmarks' models and
# the GPU server sweep's. Written by ``write_random_checkpoint`` (made on the GPU when there is
# one; another device gives other random weights for the same seed).
FLASH_PRESETS: dict[str, dict[str, Any]] = {
    "flash8": dict(num_hidden_layers=8, compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128, 0], n_routed_experts=32,
                   num_nextn_predict_layers=1),
    "flash43": dict(num_hidden_layers=43, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], n_routed_experts=8,
                    num_nextn_predict_layers=1),
}
PRESETS.update(FLASH_PRESETS)


def preset_config(preset: str) -> V4Config:
    """The validated V4Config of a preset (fields not in PRESETS keep the V4-Flash defaults)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    return V4Config.from_dict(PRESETS[preset])


def _init_tensor(spec: TensorSpec, cfg: V4Config, g: torch.Generator) -> torch.Tensor:
    name, shape = spec.name, spec.shape
    leaf = name.rsplit(".", 1)[-1]

    def randn(std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    if spec.storage is Storage.INT64:  # ffn.gate.tid2eid [V, k]: k distinct experts per token
        vocab, k = shape
        return torch.rand(vocab, cfg.n_routed_experts, generator=g).argsort(dim=1)[:, :k].contiguous()
    if name == "embed.weight":
        return randn()
    if name.endswith("norm.weight"):
        return 1.0 + randn(0.1)
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return randn(0.5)
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if leaf == "attn_sink":
        return randn()
    if leaf == "ape":
        return randn(0.5)
    if name.endswith("gate.bias"):
        return randn(0.1)
    if len(shape) == 2:  # linear [out, in] (head, gate.weight, hc_*_fn included): unit gain
        return randn(shape[1] ** -0.5)
    raise ValueError(f"no init rule for tensor {name} {list(shape)}")


def random_weights(cfg: V4Config, seed: int) -> dict[str, torch.Tensor]:
    """Logical (dequantised-shape) random weights for every schema tensor, from ``seed`` (CPU)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {spec.name: _init_tensor(spec, cfg, g) for spec in checkpoint_tensors(cfg)}


def build_tiny(preset: str, seed: int, out_dir: str | Path) -> Path:
    """Write the ``preset`` checkpoint with weights from ``seed`` (plus tokenizer files) to ``out_dir``."""
    cfg = preset_config(preset)
    out = Path(out_dir)
    if preset in FLASH_PRESETS:  # gigabytes: streamed, made on the GPU when there is one
        write_random_checkpoint(cfg, out, "cuda" if torch.cuda.is_available() else "cpu", seed)
    else:
        write_checkpoint(cfg, random_weights(cfg, seed), out)
    write_tokenizer_files(out)
    return out


def ensure_tiny(preset: str, seed: int, cache_dir: str | Path) -> Path:
    """The cached ``preset``/``seed`` checkpoint under ``cache_dir``, built once.

    Built in a temporary directory and renamed into place, so a crashed build is never reused;
    concurrent builders race on the rename and the loser discards its copy.
    """
    cache = Path(cache_dir)
    target = cache / f"{preset}-seed{seed}-v{FORMAT_VERSION}"
    if target.is_dir():
        return target
    preset_config(preset)  # fail on a bad preset before creating anything
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    try:
        build_tiny(preset, seed, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_dsv4.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output directory (must not hold a checkpoint)")
    args = parser.parse_args(argv)
    out = build_tiny(args.preset, args.seed, args.out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
