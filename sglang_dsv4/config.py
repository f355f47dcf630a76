"""Typed DeepSeek-V4 configuration, parsed from a Hugging Face ``config.json``.

Field names are the real ones of ``DeepseekV4ForCausalLM`` checkpoints so that a V4-Flash or
V4-Pro ``config.json`` loads unchanged. ``validate()`` rejects configurations that the model math
or the kernels cannot take, naming the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_RATIOS = (0, 4, 128)
# FP8 QAT of the window / compressed KV works on blocks of 64 nope values (v4_architecture.md §6.5).
FP8_QAT_BLOCK = 64
# FP4 QAT of the indexer works on blocks of 32 values.
FP4_QAT_BLOCK = 32


class ConfigError(ValueError):
    """A config.json that the V4 model cannot run, with the offending field named."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters, applied only in layers with a compress ratio > 0."""

    type: str = "yarn"
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class V4Config:
    """The fields of a V4 ``config.json`` that the model reads (names as in the checkpoint)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = tuple([0, 0] + [4, 128] * 20 + [4, 0])
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    expert_dtype: str = "fp4"
    torch_dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None
    architectures: tuple[str, ...] = ("DeepseekV4ForCausalLM",)
    model_type: str = "deepseek_v4"

    # ---- derived -------------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio of each main layer (without the trailing MTP entries)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def c4_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.layer_ratios) if r == 4)

    @property
    def c128_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.layer_ratios) if r == 128)

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    # ---- parsing ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], tp_size: int = 1) -> "V4Config":
        """Build and validate a config from a parsed ``config.json``; unknown keys are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        raw = _from_rope_parameters(raw)
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in known:
                continue
            if key == "rope_scaling" and value is not None:
                value = _parse_rope_scaling(value)
            elif key in ("compress_ratios", "architectures"):
                if not isinstance(value, (list, tuple)):
                    raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
                value = tuple(value)
            kwargs[key] = value
        cfg = cls(**kwargs)
        cfg.validate(tp_size=tp_size)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path, tp_size: int = 1) -> "V4Config":
        """Read ``config.json`` (or a checkpoint directory containing it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config.json not found at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, tp_size=tp_size)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["architectures"] = list(self.architectures)
        return d

    # ---- validation ------------------------------------------------------------------------
    def validate(self, tp_size: int = 1) -> None:
        """Raise ConfigError naming the first field the model cannot run with."""
        _positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                  "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "max_position_embeddings")
        if self.num_key_value_heads != 1:
            raise ConfigError(f"num_key_value_heads: V4 has one shared KV head, got {self.num_key_value_heads}")
        expected_ratios = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != expected_ratios:
            raise ConfigError(
                f"compress_ratios: has {len(self.compress_ratios)} entries, expected "
                f"num_hidden_layers + num_nextn_predict_layers = {expected_ratios}")
        for i, r in enumerate(self.compress_ratios):
            if r not in SUPPORTED_RATIOS:
                raise ConfigError(f"compress_ratios[{i}]: unknown compress ratio {r} (supported: 0, 4, 128)")
        for i in range(self.num_hidden_layers, expected_ratios):
            if self.compress_ratios[i] != 0:
                raise ConfigError(f"compress_ratios[{i}]: the MTP layer must have ratio 0, got {self.compress_ratios[i]}")
        rd = self.qk_rope_head_dim
        if rd <= 0 or rd % 2:
            raise ConfigError(f"qk_rope_head_dim: must be a positive even number, got {rd}")
        if self.nope_head_dim <= 0 or self.nope_head_dim % FP8_QAT_BLOCK:
            raise ConfigError(
                f"head_dim: head_dim - qk_rope_head_dim = {self.nope_head_dim} must be a positive "
                f"multiple of {FP8_QAT_BLOCK} (the FP8 KV block)")
        if self.c4_layers:
            di = self.index_head_dim
            if di < FP4_QAT_BLOCK or di & (di - 1):
                raise ConfigError(f"index_head_dim: must be a power of two >= {FP4_QAT_BLOCK} (Hadamard, FP4 blocks), got {di}")
            if di < rd:
                raise ConfigError(f"index_head_dim: {di} is smaller than qk_rope_head_dim {rd}")
            _positive(self, "index_n_heads", "index_topk")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"o_groups: {self.o_groups} does not divide num_attention_heads * head_dim")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"o_groups: {self.o_groups} does not divide num_attention_heads {self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok: {self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        if not 0 <= self.num_hash_layers <= self.num_hidden_layers:
            raise ConfigError(f"num_hash_layers: {self.num_hash_layers} not in [0, num_hidden_layers]")
        if self.n_shared_experts not in (0, 1):
            raise ConfigError(f"n_shared_experts: V4 has at most one shared expert, got {self.n_shared_experts}")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func: only 'sqrtsoftplus' is supported, got {self.scoring_func!r}")
        if self.expert_dtype not in ("fp4", "fp8", "bf16"):
            raise ConfigError(f"expert_dtype: unknown expert dtype {self.expert_dtype!r}")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if rs.type != "yarn":
                raise ConfigError(f"rope_scaling.type: only 'yarn' is supported, got {rs.type!r}")
            if rs.factor < 1 or rs.original_max_position_embeddings <= 0:
                raise ConfigError("rope_scaling: factor must be >= 1 and original_max_position_embeddings > 0")
        self.validate_tp(tp_size)

    def validate_tp(self, tp_size: int) -> None:
        """Check that attention heads, output groups and experts split evenly over tp_size ranks."""
        if tp_size < 1:
            raise ConfigError(f"tp_size: must be >= 1, got {tp_size}")
        if self.num_attention_heads % tp_size:
            raise ConfigError(f"num_attention_heads: {self.num_attention_heads} is not divisible by tensor-parallel size {tp_size}")
        if self.o_groups % tp_size:
            raise ConfigError(f"o_groups: {self.o_groups} is not divisible by tensor-parallel size {tp_size}")
        if self.n_routed_experts % tp_size:
            raise ConfigError(f"n_routed_experts: {self.n_routed_experts} is not divisible by parallel size {tp_size}")

    def validate_parallel(self, tp_size: int = 1, ep_size: int = 1) -> None:
        """Check a tensor-parallel x expert-parallel split of the core (``core.parallel``).

        TP splits the query heads and, with them, the groups of the grouped output projection (a
        group's heads must stay on one rank); EP splits the routed experts. The one KV head, the
        compressors and the indexer are replicated, so they set no constraint.
        """
        for name, size in (("tp_size", tp_size), ("ep_size", ep_size)):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {size!r}")
        if self.num_attention_heads % tp_size:
            raise ConfigError(f"num_attention_heads: {self.num_attention_heads} query heads do not split "
                              f"evenly over tensor-parallel size {tp_size}")
        if self.o_groups % tp_size:
            raise ConfigError(f"o_groups: {self.o_groups} output-projection groups do not split evenly "
                              f"over tensor-parallel size {tp_size}")
        if self.n_routed_experts % ep_size:
            raise ConfigError(f"n_routed_experts: {self.n_routed_experts} routed experts do not split "
                              f"evenly over expert-parallel size {ep_size}")

    def check_flashmla(self) -> None:
        """Raise ConfigError if FlashMLA's sparse kernels cannot run this attention shape."""
        if self.head_dim != 512 or self.qk_rope_head_dim != 64:
            raise ConfigError(f"head_dim/qk_rope_head_dim: FlashMLA needs 512/64, got {self.head_dim}/{self.qk_rope_head_dim}")
        if self.num_attention_heads not in (64, 128):
            raise ConfigError(f"num_attention_heads: FlashMLA needs 64 or 128 query heads, got {self.num_attention_heads}")


def _positive(cfg: V4Config, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name}: must be a positive integer, got {value!r}")


def _from_rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers v5 moves ``rope_scaling`` (and ``rope_theta``) into ``rope_parameters``; a
    config that went through it (e.g. SGLang's config loader) must mean the same model."""
    params = raw.get("rope_parameters")
    if not isinstance(params, dict) or "rope_scaling" in raw:
        return raw
    raw = dict(raw)
    if "rope_theta" not in raw and "rope_theta" in params:
        raw["rope_theta"] = params["rope_theta"]
    kind = params.get("rope_type", params.get("type"))
    raw["rope_scaling"] = None if kind in (None, "default") else {
        k: v for k, v in params.items() if k != "rope_theta"}
    return raw


def _parse_rope_scaling(raw: Any) -> RopeScaling:
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {type(raw).__name__}")
    raw = dict(raw)
    if "rope_type" in raw and "type" not in raw:
        raw["type"] = raw.pop("rope_type")
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    return RopeScaling(**{k: v for k, v in raw.items() if k in known})


def yarn_ramp_bounds(rope_dim: int, base: float, scaling: RopeScaling) -> tuple[int, int]:
    """(low, high) frequency indices of the YaRN blend (v4_architecture.md §1.3)."""

    def correction_dim(num_rotations: float) -> float:
        orig = scaling.original_max_position_embeddings
        return rope_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(correction_dim(scaling.beta_fast))
    high = math.ceil(correction_dim(scaling.beta_slow))
    return max(low, 0), min(high, rope_dim - 1)
