"""The tensor inventory of a V4 checkpoint: every name, logical shape and storage format.

One table serves the tiny-checkpoint writer and the loader, so what we write is what we read and
what a real V4-Flash/Pro checkpoint contains (v4_architecture.md, Appendix A).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from ..config import V4Config
from ..quant import FP4_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK


class Storage(str, Enum):
    FP8 = "fp8"    # float8_e4m3fn [out, in] + float8_e8m0fnu scale [ceil(out/128), ceil(in/128)]
    FP4 = "fp4"    # int8 [out, in/2] (two e2m1 codes) + float8_e8m0fnu scale [out, in/32]
    BF16 = "bf16"
    FP32 = "fp32"
    INT64 = "int64"


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor: its checkpoint name, logical (dequantised) shape and storage format."""

    name: str
    shape: tuple[int, ...]
    storage: Storage

    @property
    def scale_name(self) -> str | None:
        if self.storage in (Storage.FP8, Storage.FP4):
            return self.name.removesuffix(".weight") + ".scale"
        return None

    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint names -> stored shapes (the weight and, for fp8/fp4, its scale)."""
        if self.storage is Storage.FP8:
            out_dim, in_dim = self.shape
            return {self.name: self.shape,
                    self.scale_name: (math.ceil(out_dim / FP8_WEIGHT_BLOCK), math.ceil(in_dim / FP8_WEIGHT_BLOCK))}
        if self.storage is Storage.FP4:
            out_dim, in_dim = self.shape
            return {self.name: (out_dim, in_dim // 2), self.scale_name: (out_dim, in_dim // FP4_WEIGHT_BLOCK)}
        return {self.name: self.shape}


def _block_specs(cfg: V4Config, prefix: str, ratio: int, hash_routed: bool) -> list[TensorSpec]:
    """Tensors of one decoder block (main layer or MTP block) under ``prefix``."""
    D, H, Dh, Q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, R, hc = cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    mix = (2 + hc) * hc
    expert = Storage.FP4 if cfg.expert_dtype == "fp4" else Storage.FP8 if cfg.expert_dtype == "fp8" else Storage.BF16
    s: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], storage: Storage) -> None:
        s.append(TensorSpec(f"{prefix}.{name}", shape, storage))

    add("attn_norm.weight", (D,), Storage.BF16)
    add("ffn_norm.weight", (D,), Storage.BF16)
    for part in ("attn", "ffn"):
        add(f"hc_{part}_fn", (mix, hc * D), Storage.FP32)
        add(f"hc_{part}_base", (mix,), Storage.FP32)
        add(f"hc_{part}_scale", (3,), Storage.FP32)
    add("attn.wq_a.weight", (Q, D), Storage.FP8)
    add("attn.q_norm.weight", (Q,), Storage.BF16)
    add("attn.wq_b.weight", (H * Dh, Q), Storage.FP8)
    add("attn.wkv.weight", (Dh, D), Storage.FP8)
    add("attn.kv_norm.weight", (Dh,), Storage.BF16)
    add("attn.wo_a.weight", (G * R, H * Dh // G), Storage.FP8)
    add("attn.wo_b.weight", (D, G * R), Storage.FP8)
    add("attn.attn_sink", (H,), Storage.FP32)
    if ratio:
        coff = 2 if ratio == 4 else 1
        add("attn.compressor.wkv.weight", (coff * Dh, D), Storage.BF16)
        add("attn.compressor.wgate.weight", (coff * Dh, D), Storage.BF16)
        add("attn.compressor.ape", (ratio, coff * Dh), Storage.FP32)
        add("attn.compressor.norm.weight", (Dh,), Storage.BF16)
    if ratio == 4:
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        add("attn.indexer.wq_b.weight", (Hi * Di, Q), Storage.FP8)
        add("attn.indexer.weights_proj.weight", (Hi, D), Storage.BF16)
        add("attn.indexer.compressor.wkv.weight", (2 * Di, D), Storage.BF16)
        add("attn.indexer.compressor.wgate.weight", (2 * Di, D), Storage.BF16)
        add("attn.indexer.compressor.ape", (4, 2 * Di), Storage.FP32)
        add("attn.indexer.compressor.norm.weight", (Di,), Storage.BF16)
    add("ffn.gate.weight", (E, D), Storage.BF16)
    if hash_routed:
        add("ffn.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), Storage.INT64)
    else:
        add("ffn.gate.bias", (E,), Storage.FP32)
    for e in range(E):
        add(f"ffn.experts.{e}.w1.weight", (I, D), expert)
        add(f"ffn.experts.{e}.w3.weight", (I, D), expert)
        add(f"ffn.experts.{e}.w2.weight", (D, I), expert)
    if cfg.n_shared_experts:
        add("ffn.shared_experts.w1.weight", (I, D), Storage.FP8)
        add("ffn.shared_experts.w3.weight", (I, D), Storage.FP8)
        add("ffn.shared_experts.w2.weight", (D, I), Storage.FP8)
    return s


def checkpoint_tensors(cfg: V4Config) -> list[TensorSpec]:
    """Every logical tensor of a V4 checkpoint for ``cfg``, in a stable order."""
    D, V, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    specs = [
        TensorSpec("embed.weight", (V, D), Storage.BF16),
        TensorSpec("head.weight", (V, D), Storage.BF16),
        TensorSpec("norm.weight", (D,), Storage.BF16),
        TensorSpec("hc_head_fn", (hc, hc * D), Storage.FP32),
        TensorSpec("hc_head_base", (hc,), Storage.FP32),
        TensorSpec("hc_head_scale", (1,), Storage.FP32),
    ]
    for layer, ratio in enumerate(cfg.layer_ratios):
        specs += _block_specs(cfg, f"layers.{layer}", ratio, hash_routed=layer < cfg.num_hash_layers)
    for m in range(cfg.num_mtp_layers):
        prefix = f"mtp.{m}"
        specs += _block_specs(cfg, prefix, cfg.compress_ratios[cfg.num_hidden_layers + m], hash_routed=False)
        specs += [
            TensorSpec(f"{prefix}.e_proj.weight", (D, D), Storage.FP8),
            TensorSpec(f"{prefix}.h_proj.weight", (D, D), Storage.FP8),
            TensorSpec(f"{prefix}.enorm.weight", (D,), Storage.BF16),
            TensorSpec(f"{prefix}.hnorm.weight", (D,), Storage.BF16),
            TensorSpec(f"{prefix}.norm.weight", (D,), Storage.BF16),
            TensorSpec(f"{prefix}.hc_head_fn", (hc, hc * D), Storage.FP32),
            TensorSpec(f"{prefix}.hc_head_base", (hc,), Storage.FP32),
            TensorSpec(f"{prefix}.hc_head_scale", (1,), Storage.FP32),
        ]
    return specs
