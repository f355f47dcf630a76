"""The offline sgl.Engine on CPU agrees with the core model and hits the cache on the next turn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from sglang_dsv4.checkpoint import load_checkpoint
from sglang_dsv4.core.cache import V4Cache
from sglang_dsv4.core.model import V4Model
from sglang_dsv4.launch_server import cache_dir
from sglang_dsv4.tiny import ensure_tiny

IDS = [0, 4411, 271, 8822, 1933, 77, 5120, 306, 12000, 42, 9, 1500] * 4


def _core_greedy(ids: list[int], n: int) -> list[int]:
    ckpt = load_checkpoint(ensure_tiny("micro", 0, cache_dir()))
    model, cache = V4Model(ckpt.config, ckpt.tensors), V4Cache(ckpt.config, max_requests=1, max_total_tokens=1024)
    req, out = cache.new_request(), []
    logits = model.forward(cache, [req], [torch.tensor(ids)])[0][-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(cache, [req], [torch.tensor(out[-1:])])[0][-1]
    return out


def test_offline_engine_matches_core_model_and_caches_the_next_turn():
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_script.py")), json.dumps(IDS)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    first, second, cached = json.loads(line[len("RESULT "):])
    assert first == _core_greedy(IDS, 8)  # SGLang's sampling and batching change nothing
    assert cached == len(IDS) + len(first) - 1
    assert len(second) == 8
