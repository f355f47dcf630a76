"""Cache byte accounting against v4_architecture.md §9 (V4-Flash table, V4-Pro line) and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dsv4.config import V4Config
from sglang_dsv4.checkpoint.schema import Storage, checkpoint_tensors
from sglang_dsv4.memory import LAYOUTS, cache_bytes, main, row_bytes
from sglang_dsv4.tiny import PRESETS
from sglang_dsv4.weight_bytes import MODES, checkpoint_bytes, lm_head_rows, tensor_bytes, weight_bytes

KIB = 1024
MIB = 1024 * 1024
REPO = Path(__file__).resolve().parents[1]

PRO = dict(
    hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
    o_lora_rank=1024, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0], n_routed_experts=384,
    index_topk=1024, moe_intermediate_size=3072, routed_scaling_factor=2.5,
)


@pytest.fixture(scope="module")
def flash() -> V4Config:
    cfg = V4Config()
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def pro() -> V4Config:
    return V4Config.from_dict(PRO)


def test_flash_fp8_rows(flash):
    assert row_bytes(flash, "fp8") == (448 + 64 * 2 + 7 + 1, 128 + 4) == (584, 132)
    assert row_bytes(flash, "bf16") == (1024, 256)
    assert row_bytes(flash, "fp32") == (2048, 512)


def test_flash_fp8_table(flash):
    b = cache_bytes(flash, "fp8")
    assert (b.num_c4_layers, b.num_c128_layers, b.num_window_layers) == (21, 20, 44)
    assert b.c4_main_bytes_per_token == 21 * 146 == 3066
    assert b.c4_indexer_bytes_per_token == 693
    assert b.c128_main_bytes_per_token == 91.25
    assert b.compressed_bytes_per_token == 3850.25
    # 43 main layers x 128 x 584 = 3,214,336 B, + 73 KiB for the MTP layer.
    assert b.window_bytes_per_layer == 128 * 584 == 73 * KIB
    assert b.window_bytes_per_request == 44 * 128 * 584 == 3_289_088
    assert b.window_bytes_per_request - b.window_bytes_per_layer == 3_214_336
    assert round(b.window_bytes_per_request / MIB, 2) == 3.14
    # C4: 64 KiB main + 16 KiB indexer per layer; online C128: 6 KiB per layer (fp32 in every layout).
    assert b.c4_main_state_bytes_per_layer == 64 * KIB
    assert b.c4_indexer_state_bytes_per_layer == 16 * KIB
    assert b.c128_state_bytes_per_layer == 6 * KIB
    assert b.compressor_state_bytes_per_request == 21 * 80 * KIB + 20 * 6 * KIB
    assert round(b.compressor_state_bytes_per_request / MIB, 2) == 1.76
    assert b.snapshot_bytes == b.window_bytes_per_request + b.compressor_state_bytes_per_request


def test_flash_bf16_table(flash):
    b = cache_bytes(flash, "bf16")
    assert b.c4_main_bytes_per_token == 5376
    assert b.c4_indexer_bytes_per_token == 1344
    assert b.c128_main_bytes_per_token == 160
    assert b.compressed_bytes_per_token == 6880
    # 43 x 128 x 1024 = 5.375 MiB, + 128 KiB MTP = 5.5 MiB per request.
    assert b.window_bytes_per_request == 44 * 128 * 1024 == int(5.5 * MIB)
    assert b.compressor_state_bytes_per_request == cache_bytes(flash, "fp8").compressor_state_bytes_per_request


def test_flash_fp32(flash):
    b = cache_bytes(flash, "fp32")
    assert b.compressed_bytes_per_token == 2 * 6880
    assert b.window_bytes_per_request == 44 * 128 * 2048


def test_pro(pro):
    assert (len(pro.c4_layers), len(pro.c128_layers)) == (30, 31)
    fp8, bf16 = cache_bytes(pro, "fp8"), cache_bytes(pro, "bf16")
    assert fp8.compressed_bytes_per_token == 30 * 146 + 30 * 33 + 31 * 4.5625 == 5511.4375
    assert round(fp8.compressed_bytes_per_token, 2) == 5511.44
    assert bf16.compressed_bytes_per_token == 9848
    assert fp8.window_bytes_per_request == 62 * 128 * 584
    assert bf16.window_bytes_per_request == 62 * 128 * 1024
    assert fp8.compressor_state_bytes_per_request == 30 * 80 * KIB + 31 * 6 * KIB


def test_fp8_row_scale_padding():
    # nope 64 -> one scale byte, padded to 8.
    cfg = V4Config(head_dim=128, qk_rope_head_dim=64)
    assert row_bytes(cfg, "fp8")[0] == 64 + 128 + 8


def test_unknown_layout(flash):
    with pytest.raises(ValueError, match="layout"):
        cache_bytes(flash, "int4")


def test_to_dict_round_trips(flash):
    d = cache_bytes(flash, "fp8").to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["compressed_bytes_per_token"] == 3850.25


REQUIRED = ("compressed_bytes_per_token", "window_bytes_per_request",
            "compressor_state_bytes_per_request", "snapshot_bytes")


def _check_cli_json(text: str) -> dict:
    out = json.loads(text)
    assert set(out) == set(LAYOUTS) | {"weights", "pool_plan"} and set(LAYOUTS) >= {"bf16", "fp8", "fp32"}
    assert set(out["weights"]) == set(out["pool_plan"]) == set(MODES)
    for layout in LAYOUTS:
        for key in REQUIRED:
            assert key in out[layout], (layout, key)
    return out


def test_cli_json_config_file_and_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(V4Config().to_dict()))
    for path in (tmp_path / "config.json", tmp_path):
        assert main(["--config", str(path)]) == 0
        out = _check_cli_json(capsys.readouterr().out)
        assert out["fp8"]["compressed_bytes_per_token"] == 3850.25
        assert out["bf16"]["compressed_bytes_per_token"] == 6880
        assert out["fp8"]["window_bytes_per_request"] == 3_289_088


def test_cli_subprocess(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRO))
    r = subprocess.run([sys.executable, "-m", "sglang_dsv4.memory", "--config", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    out = _check_cli_json(r.stdout)
    assert out["bf16"]["compressed_bytes_per_token"] == 9848


def test_cli_missing_path(tmp_path):
    missing = tmp_path / "nope"
    r = subprocess.run([sys.executable, "-m", "sglang_dsv4.memory", "--config", str(missing)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode != 0
    assert "config.json not found" in r.stderr and str(missing) in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"compress_ratios": [0, 0, 3]}), "compress_ratios"),
])
def test_cli_bad_config(tmp_path, capsys, content, needle):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert main(["--config", str(path)]) != 0
    captured = capsys.readouterr()
    assert needle in captured.err and "error" in captured.err
    assert captured.out == ""


# ---- weight bytes per rank (issue 12) -----------------------------------------------------------

@pytest.fixture(scope="module")
def micro() -> V4Config:
    return V4Config.from_dict(PRESETS["micro"])


def test_micro_experts_hand_count(micro):
    # 4 main layers + 1 MTP block, 8 experts each, w1/w3 [32, 64] and w2 [64, 32]
    n = 5 * 8 * 3
    counts = {m: weight_bytes(micro, m).experts for m in MODES}
    assert counts["bf16"] == n * 2048 * 2
    assert counts["fp8"] == n * (2048 + 1)  # one 128x128 block -> one e8m0 byte
    assert counts["w4a16"] == n * (1024 + 64)  # 2048 / 2 + one byte per 32 inputs: 32*2 or 64*1
    for m in MODES:  # EP2: each rank holds half the experts
        assert weight_bytes(micro, m, tp_size=2, ep_size=2, tp_rank=1, ep_rank=1).experts == counts[m] // 2


def test_micro_dense_hand_count(micro):
    # per block (fp8 + one scale byte per block): wq_a [32,64], wq_b [320,32] (3 row blocks),
    # wkv [80,64], wo_b [64,32], shared expert 3 x 2048; wo_a [32,160] bf16 in every mode
    base = 2049 + 10243 + 5121 + 32 * 160 * 2 + 2049 + 3 * 2049
    # ratio-4 layers (1, 3): compressor wkv/wgate [160,64] bf16; indexer wq_b [256,32] fp8,
    # weights_proj [8,64] bf16, indexer compressor wkv/wgate [64,64] bf16
    c4 = 2 * 160 * 64 * 2 + (8192 + 2) + 8 * 64 * 2 + 2 * 64 * 64 * 2
    c128 = 2 * 80 * 64 * 2  # layer 2: compressor wkv/wgate [80,64] bf16
    mtp = 2 * (4096 + 1)  # e_proj, h_proj [64,64] fp8
    assert weight_bytes(micro, "fp8").dense == 5 * base + 2 * c4 + c128 + mtp == 341043
    assert weight_bytes(micro, "w4a16").dense == 341043
    bf16_c4 = 2 * 160 * 64 * 2 + 256 * 32 * 2 + 8 * 64 * 2 + 2 * 64 * 64 * 2
    assert weight_bytes(micro, "bf16").dense == 5 * 30720 * 2 + 2 * bf16_c4 + c128 + 2 * 4096 * 2 == 493568
    # TP2: wq_b [160,32] (2 row blocks), wo_a [16,160] bf16, wo_b [64,16]; the rest replicated
    base_tp2 = 2049 + (5120 + 2) + 5121 + 16 * 160 * 2 + (1024 + 1) + 3 * 2049
    assert weight_bytes(micro, "fp8", 2, 2).dense == 5 * base_tp2 + 2 * c4 + c128 + mtp == 284718


def test_micro_embed_head_and_rest(micro):
    V, D = micro.vocab_size, micro.hidden_size
    for m in MODES:
        assert weight_bytes(micro, m).embed_head == 2 * V * D * 2  # bf16 embed + head, one copy each
        # TP2: the core drops its full head; SGLang's lm_head holds half the padded vocab
        assert weight_bytes(micro, m, 2, 2).embed_head == V * D * 2 + lm_head_rows(V, 2) * D * 2
    assert lm_head_rows(129280, 8) == 16160 and lm_head_rows(100, 3) == 64  # 100 -> 192 = 3 x 64
    # norms, router, hc mixers, ape, sink, bias in fp32 whatever the mode; tid2eid int64
    other = {m: weight_bytes(micro, m).other for m in MODES}
    assert other["bf16"] == other["fp8"] == other["w4a16"]
    tid2eid = 2 * V * 2 * 8  # 2 hash layers x [V, k=2] int64
    assert other["bf16"] > tid2eid


def test_bad_mode_and_split(micro):
    with pytest.raises(ValueError, match="mode"):
        weight_bytes(micro, "int4")
    with pytest.raises(ValueError, match="num_attention_heads"):
        weight_bytes(micro, "fp8", tp_size=3)
    with pytest.raises(ValueError, match="n_routed_experts"):
        weight_bytes(micro, "fp8", ep_size=3)


_SPLIT = (".attn.wq_b.weight", ".attn.wo_a.weight", ".attn.wo_b.weight", ".attn.attn_sink")


@pytest.mark.parametrize("mode", ["fp8", "w4a16"])
def test_flash_ranks_sum_to_the_whole_plus_replicas(flash, mode):
    # parallel.py: heads' tensors split over TP, routed experts over EP, the rest on every rank;
    # Flash's splits are 128-aligned, so the shards' scale blocks add up to the whole's
    n = 4
    full = {s.name: tensor_bytes(s, s.shape, mode, flash) for s in checkpoint_tensors(flash)}
    split = sum(b for name, b in full.items() if name.endswith(_SPLIT) or ".ffn.experts." in name)
    replicated = sum(full.values()) - split - full["head.weight"]  # the full head: one rank only
    lm_head = lm_head_rows(flash.vocab_size, n) * flash.hidden_size * 2
    ranks = [weight_bytes(flash, mode, n, n, r, r).total for r in range(n)]
    assert len(set(ranks)) == 1
    assert sum(ranks) == split + n * replicated + n * lm_head
    assert weight_bytes(flash, mode).total == sum(full.values())


def test_flash_against_the_checkpoint_size(flash):
    stored = checkpoint_bytes(flash)
    assert 150e9 < stored < 170e9  # the fp8 + fp4 V4-Flash checkpoint, ~160 GB
    # w4a16 keeps the checkpoint's formats; only bf16-stored non-matrices (norms, router) widen to fp32
    widened = sum(2 * s.shape[0] * (s.shape[1] if len(s.shape) > 1 else 1)
                  for s in checkpoint_tensors(flash)
                  if s.storage is Storage.BF16 and (s.name.endswith("norm.weight") or s.name.endswith(".ffn.gate.weight")))
    # attn.wo_a is dequantised to bf16 in every mode: 2 B per value instead of 1 + its scales
    wo_a = sum(tensor_bytes(s, s.shape, "w4a16", flash) - sum(math.prod(t) for t in s.stored_shapes().values())
               for s in checkpoint_tensors(flash) if s.name.endswith("attn.wo_a.weight"))
    assert wo_a == 44 * (8192 * 4096 - 64 * 32)
    assert weight_bytes(flash, "w4a16").total == stored + widened + wo_a
    # fp8: the fp4 experts' values take twice their bytes (scales aside); bf16 ~ 3.6x w4a16
    w4, w8 = weight_bytes(flash, "w4a16").experts, weight_bytes(flash, "fp8").experts
    assert 1.85 < w8 / w4 < 1.9  # (2 x values + 1/16384 scales) / (values + 1/16 scales)


def test_cli_weights_and_pool_plan(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(V4Config().to_dict()))
    assert main(["--config", str(tmp_path), "--tp-size", "4", "--ep-size", "4", "--gpu-gb", "140"]) == 0
    out = _check_cli_json(capsys.readouterr().out)
    flash = V4Config()
    for m in MODES:
        assert out["weights"][m]["total"] == weight_bytes(flash, m, 4, 4).total
    plan = out["pool_plan"]
    assert not plan["bf16"]["fits"] and "does not fit" in plan["bf16"]["reason"]  # 140 GiB of bf16 weights
    for m in ("fp8", "w4a16"):
        p = plan[m]
        assert p["fits"] and p["kv_bytes"] == p["gpu_bytes"] - p["weight_bytes"] - p["reserve_bytes"]
        assert p["rings"] == p["rows"] + 1 and p["token_slots"] > 0
        spent = p["rings"] * p["row_bytes"] + p["snapshot_budget_bytes"] + p["token_slots"] * p["token_bytes"]
        assert p["kv_bytes"] - p["token_bytes"] < spent <= p["kv_bytes"]
    assert plan["w4a16"]["token_slots"] > plan["fp8"]["token_slots"]


@pytest.mark.parametrize("flags, needle", [
    (["--tp-size", "3"], "--tp-size 3: num_attention_heads"),
    (["--tp-size", "16"], "--tp-size 16: o_groups"),
    (["--ep-size", "7"], "--ep-size 7: n_routed_experts"),
    (["--tp-size", "0"], "--tp-size 0: tp_size"),
])
def test_cli_bad_parallel_flags(tmp_path, capsys, flags, needle):
    (tmp_path / "config.json").write_text(json.dumps(V4Config().to_dict()))
    assert main(["--config", str(tmp_path), *flags]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.out == ""
