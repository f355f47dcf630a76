"""``bench_decode``'s step floor: bytes or FLOPs per GEMM, whichever binds (the timing needs a GPU;
the counting does not)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import bench_decode


@pytest.fixture(scope="module")
def tiny_weights():
    cfg = bench_decode.make_config("tiny", 4096)
    return cfg, bench_decode.bench_weights(cfg, "cpu", "bf16")


def test_with_unbounded_compute_the_floor_is_the_bytes_roofline(tiny_weights):
    cfg, w = tiny_weights
    peaks = {torch.bfloat16: math.inf, torch.float8_e4m3fn: math.inf}
    for batch, ctx in ((1, 1024), (64, 4096), (256, 2048)):
        floor = bench_decode.step_floor(cfg, w, batch, ctx, 3e12, peaks)
        assert floor == pytest.approx(bench_decode.step_bytes(cfg, w, batch, ctx) / 3e12, rel=1e-12)


def test_with_unbounded_bandwidth_the_floor_is_the_flops_and_grows_with_the_batch(tiny_weights):
    cfg, w = tiny_weights
    peaks = {torch.bfloat16: 1e15, torch.float8_e4m3fn: 2e15}
    one = bench_decode.step_floor(cfg, w, 1, 1024, math.inf, peaks)
    assert one > 0
    for batch in (8, 256):  # every FLOP term is B tokens times a per-token count
        assert bench_decode.step_floor(cfg, w, batch, 1024, math.inf, peaks) == pytest.approx(batch * one, rel=1e-9)
    # the head alone: 2 * vocab * hidden FLOPs a token, at bf16's rate, is a lower bound
    assert one >= 2 * cfg.vocab_size * cfg.hidden_size / 1e15


def test_the_floor_is_never_below_either_bound(tiny_weights):
    cfg, w = tiny_weights
    peaks = {torch.bfloat16: 1e14, torch.float8_e4m3fn: 2e14}
    for batch in (1, 16, 256):
        floor = bench_decode.step_floor(cfg, w, batch, 2048, 3e12, peaks)
        assert floor >= bench_decode.step_bytes(cfg, w, batch, 2048) / 3e12 * (1 - 1e-12)
        assert floor >= bench_decode.step_floor(cfg, w, batch, 2048, math.inf, peaks) * (1 - 1e-12)


def test_the_fp8_wo_a_weights_hold_wo_a_fp8_and_count_its_bytes():
    """``--weights fp8+wo_a``: the fp8 mode loaded with ``attn.wo_a`` kept fp8 (a load-time
    choice), the switch as it was afterwards; the roofline counts half wo_a's bf16 bytes."""
    cfg = bench_decode.make_config("tiny", 4096)
    held = bench_decode.fp8_linear.GROUPED_WO_A
    fp8, fp8_wo_a = (bench_decode.bench_weights(cfg, "cpu", m) for m in ("fp8", "fp8+wo_a"))
    assert bench_decode.fp8_linear.GROUPED_WO_A == held
    name = "layers.0.attn.wo_a.weight"
    assert isinstance(fp8_wo_a[name], bench_decode.Fp8Weight) and not isinstance(fp8[name], bench_decode.Fp8Weight)
    saved = bench_decode.step_bytes(cfg, fp8, 1, 1024) - bench_decode.step_bytes(cfg, fp8_wo_a, 1, 1024)
    n = fp8[name].numel()
    assert n * 0.99 < saved / cfg.num_hidden_layers < n * 1.01  # 2 B -> 1 B (+ scales) per value, per layer
