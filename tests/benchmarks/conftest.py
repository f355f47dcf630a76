"""The benchmarks' tests share one process with the kernels' tests: ``bench_decode.switched`` sets
the GPU kernels' module switches for the path it makes and leaves them so (as a benchmark run
wants); here each test's switches are put back as they were before it."""

from __future__ import annotations

import pytest

from benchmarks import bench_decode


@pytest.fixture(autouse=True)
def _switches_restored():
    modules = bench_decode._switch_modules()
    before = {name: getattr(mod, attr) for name, (mod, attr) in modules.items()}
    yield
    for name, (mod, attr) in modules.items():
        setattr(mod, attr, before[name])
