"""`python -m sglang_dsv4.logits`: incremental vs oracle files, golden fingerprint, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_dsv4.logits import main

GOLDEN = Path(__file__).parent / "golden" / "micro_seed0_logits.json"
GOLDEN_IDS = [0, 128803, 9600, 14, 3000, 77, 128804, 5, 100000, 42, 1, 7] * 3  # 36 tokens


def run(tmp_path: Path, *args: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.safetensors"
    assert main([*args, "--out", str(out)]) == 0
    return load_file(str(out))


def test_incremental_and_oracle_files_agree(micro_dir, tmp_path):
    ids = ",".join(str(i) for i in GOLDEN_IDS)
    inc = run(tmp_path, "--model-path", str(micro_dir), "--prompt-ids", ids, "--chunk-sizes", "5,3,1,17",
              "--no-quant-sim")
    ref = run(tmp_path, "--model-path", str(micro_dir), "--prompt-ids", ids, "--oracle", "--no-quant-sim")
    assert inc["logits"].shape == (len(GOLDEN_IDS), 129280) and inc["logits"].dtype == torch.float32
    assert inc["input_ids"].tolist() == GOLDEN_IDS
    err = (inc["logits"] - ref["logits"]).norm(dim=-1) / ref["logits"].norm(dim=-1)
    assert err.max() < 1e-5


def test_text_prompt_is_tokenized_after_bos(micro_dir, tmp_path):
    out = run(tmp_path, "--model-path", str(micro_dir), "--prompt", "Hello <think>")
    assert out["input_ids"][0] == 0 and 128821 in out["input_ids"].tolist()
    assert out["logits"].shape[0] == out["input_ids"].numel()


def test_golden_fingerprint(micro_dir, tmp_path):
    """Top-5 logits of every position of a fixed prompt on the micro model (seed 0), as committed.

    Catches numerical drift between versions of the model math, the tiny builder or the loader.
    Regenerate deliberately with `python tests/test_logits_cli.py DIR` after an intended change.
    """
    ids = ",".join(str(i) for i in GOLDEN_IDS)
    logits = run(tmp_path, "--model-path", str(micro_dir), "--prompt-ids", ids)["logits"]
    golden = json.loads(GOLDEN.read_text())
    top = torch.topk(logits, 5, dim=-1)
    assert top.indices.tolist() == golden["top5_ids"]
    torch.testing.assert_close(top.values, torch.tensor(golden["top5_values"]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x"], "--prompt-ids: expected comma-separated integers"),
    (["--prompt-ids", "1,200000"], "token id 200000 outside the vocabulary"),
    (["--prompt-ids", "1,2", "--chunk-sizes", "0"], "sizes must be positive"),
])
def test_bad_input_exits_2_with_message(micro_dir, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["--model-path", str(micro_dir), *args, "--out", str(tmp_path / "x.safetensors")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_checkpoint_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model-path", str(tmp_path / "nope"), "--prompt-ids", "1", "--out", str(tmp_path / "x.safetensors")])
    assert e.value.code == 2
    assert "does not exist" in capsys.readouterr().err


if __name__ == "__main__":  # regenerate the golden file
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "g.safetensors"
        main(["--model-path", sys.argv[1], "--prompt-ids", ",".join(map(str, GOLDEN_IDS)), "--out", str(out)])
        top = torch.topk(load_file(str(out))["logits"], 5, dim=-1)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"model": "micro seed 0", "ids": GOLDEN_IDS, "top5_ids": top.indices.tolist(),
                                  "top5_values": [[round(v, 6) for v in row] for row in top.values.tolist()]}) + "\n")
    print(f"wrote {GOLDEN}")
