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
