"""Cache byte accounting against v4_architecture.md §9 (V4-Flash table, V4-Pro line) and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dsv4.config import V4Config
from sglang_dsv4.memory import LAYOUTS, cache_bytes, main, row_bytes

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
    assert set(out) == set(LAYOUTS) >= {"bf16", "fp8", "fp32"}
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
