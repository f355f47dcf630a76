"""V4Config parsing and validation: every rejection names the offending field."""

from __future__ import annotations

import json

import pytest

from sglang_dsv4.config import ConfigError, V4Config

# A V4-Flash config.json as the HF checkpoint has it (field names of DeepseekV4ForCausalLM).
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "scale_fmt": "ue8m0", "activation_scheme": "dynamic"},
    "some_unknown_key": 123,
}


def flash(**overrides):
    d = dict(FLASH)
    d.update(overrides)
    return d


def rejects(field: str, raw: dict, tp_size: int = 1) -> str:
    """from_dict must raise ConfigError whose message names ``field``; returns the message."""
    with pytest.raises(ConfigError) as ei:
        V4Config.from_dict(raw, tp_size=tp_size)
    msg = str(ei.value)
    assert field in msg, f"{field!r} not named in {msg!r}"
    return msg


def test_defaults_validate():
    cfg = V4Config()
    cfg.validate()
    assert cfg.num_hidden_layers == 43 and len(cfg.compress_ratios) == 44
    assert len(cfg.c4_layers) == 21 and len(cfg.c128_layers) == 20
    assert cfg.nope_head_dim == 448


def test_from_dict_flash():
    cfg = V4Config.from_dict(FLASH)
    assert cfg.compress_ratios == tuple(FLASH["compress_ratios"])
    assert cfg.layer_ratios == cfg.compress_ratios[:43]
    assert cfg.c4_layers == tuple(range(2, 43, 2))
    assert cfg.c128_layers == tuple(range(3, 42, 2))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 16
    assert cfg.quantization_config["fmt"] == "e4m3"
    assert cfg.architectures == ("DeepseekV4ForCausalLM",)
    # Same values as the defaults (which are V4-Flash).
    assert cfg == V4Config(quantization_config=FLASH["quantization_config"])
    cfg.check_flashmla()


def test_from_dict_rope_type_alias():
    cfg = V4Config.from_dict(flash(rope_scaling={"rope_type": "yarn", "factor": 16}))
    assert cfg.rope_scaling.type == "yarn"


def test_from_json_file_and_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH))
    assert V4Config.from_json(tmp_path) == V4Config.from_json(tmp_path / "config.json")


def test_to_dict_round_trip():
    cfg = V4Config.from_dict(FLASH)
    assert V4Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_unknown_compress_ratio():
    ratios = list(FLASH["compress_ratios"])
    ratios[5] = 16
    msg = rejects("compress_ratios", flash(compress_ratios=ratios))
    assert "compress_ratios[5]" in msg and "16" in msg


def test_compress_ratios_length():
    rejects("compress_ratios", flash(compress_ratios=FLASH["compress_ratios"][:-1]))  # MTP entry missing
    rejects("compress_ratios", flash(compress_ratios=FLASH["compress_ratios"] + [0]))
    rejects("compress_ratios", flash(num_hidden_layers=42))
    rejects("compress_ratios", flash(num_nextn_predict_layers=2))


def test_compress_ratios_not_a_list():
    rejects("compress_ratios", flash(compress_ratios=4))


def test_mtp_entry_nonzero():
    msg = rejects("compress_ratios", flash(compress_ratios=FLASH["compress_ratios"][:-1] + [4]))
    assert "compress_ratios[43]" in msg and "MTP" in msg


def test_nope_not_multiple_of_64():
    rejects("head_dim", flash(head_dim=500))
    rejects("head_dim", flash(head_dim=64, qk_rope_head_dim=64))  # nope 0


def test_odd_rope_dim():
    rejects("qk_rope_head_dim", flash(qk_rope_head_dim=63))
    rejects("qk_rope_head_dim", flash(qk_rope_head_dim=0))


@pytest.mark.parametrize("di", [96, 100, 16])
def test_index_head_dim_power_of_two(di):
    rejects("index_head_dim", flash(index_head_dim=di))


def test_index_head_dim_below_rope():
    rejects("index_head_dim", flash(index_head_dim=32))


def test_o_groups_not_dividing_heads():
    rejects("o_groups", flash(o_groups=3))
    rejects("o_groups", flash(o_groups=48))  # divides heads*head_dim but not heads


def test_tp_size_not_dividing_heads():
    msg = rejects("num_attention_heads", FLASH, tp_size=3)
    assert "3" in msg
    V4Config.from_dict(FLASH, tp_size=8)
    rejects("o_groups", FLASH, tp_size=16)  # 64 heads split 16 ways, but 8 output groups do not
    rejects("tp_size", FLASH, tp_size=0)


def test_num_key_value_heads():
    rejects("num_key_value_heads", flash(num_key_value_heads=8))


@pytest.mark.parametrize("name", ["hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                                  "sliding_window", "vocab_size", "q_lora_rank", "moe_intermediate_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_ints(name, value):
    rejects(name, flash(**{name: value}))


def test_non_integer_field():
    rejects("sliding_window", flash(sliding_window=128.0))
    rejects("hidden_size", flash(hidden_size="4096"))


def test_other_fields_named():
    rejects("num_experts_per_tok", flash(num_experts_per_tok=300))
    rejects("num_hash_layers", flash(num_hash_layers=44))
    rejects("scoring_func", flash(scoring_func="softmax"))
    rejects("expert_dtype", flash(expert_dtype="int4"))
    rejects("rope_scaling", flash(rope_scaling={"type": "linear", "factor": 2}))
    rejects("rope_scaling", flash(rope_scaling=[16]))


def test_bad_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4096,')
    with pytest.raises(ConfigError) as ei:
        V4Config.from_json(path)
    assert "not valid JSON" in str(ei.value) and str(path) in str(ei.value)


def test_json_not_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[]")
    with pytest.raises(ConfigError, match="JSON object"):
        V4Config.from_json(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        V4Config.from_json(tmp_path / "absent.json")
    assert "not found" in str(ei.value) and "absent.json" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        V4Config.from_json(tmp_path)  # a directory without config.json
    assert "config.json" in str(ei.value)


def test_check_flashmla():
    cfg = V4Config.from_dict(flash(head_dim=128))  # a valid model, but not a FlashMLA shape
    with pytest.raises(ConfigError) as ei:
        cfg.check_flashmla()
    assert "head_dim" in str(ei.value) and "128" in str(ei.value)
    cfg = V4Config.from_dict(flash(num_attention_heads=32, o_groups=8))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        cfg.check_flashmla()
    V4Config().check_flashmla()


def test_transformers_v5_rope_parameters_mean_the_same_model():
    """SGLang's config loader (transformers v5) moves rope_scaling and rope_theta into
    rope_parameters; parsing must give the same config as the checkpoint's own config.json."""
    scaling = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
               "beta_fast": 32, "beta_slow": 1}
    plain = V4Config.from_dict({"rope_theta": 5000.0, "rope_scaling": scaling})
    moved = V4Config.from_dict({"rope_parameters": {**scaling, "rope_theta": 5000.0, "rope_type": "yarn"}})
    assert moved == plain
    assert moved.rope_scaling.original_max_position_embeddings == 256 and moved.rope_theta == 5000.0
