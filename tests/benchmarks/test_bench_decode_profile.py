"""``bench_decode.profile_step``: per-step figures from the torch profiler, and the GPU busy share
of a step taken over the step time measured without the profiler (its host cost stays out)."""

from __future__ import annotations

import torch

from benchmarks import bench_decode


def test_busy_is_kernel_time_over_the_step_it_is_taken_of():
    prof = bench_decode.StepProfile(launches=6, syncs=0, kernel_ms=4.0, wall_ms=8.0)
    assert prof.busy_profiled == 50.0
    assert prof.busy_of(5.0) == 80.0


def test_profile_step_counts_per_step_inside_the_steps():
    class Path:  # CPU work only: no kernel launch, no sync, no GPU time
        steps = 0

        def step(self):
            torch.ones(64, 64) @ torch.ones(64, 64)
            Path.steps += 1

    prof = bench_decode.profile_step(Path(), n=4)
    assert Path.steps == 4
    assert (prof.launches, prof.syncs, prof.kernel_ms) == (0, 0, 0)
    assert prof.wall_ms > 0
