"""Shared pytest set-up: tests marked ``gpu`` are skipped where no CUDA GPU is visible."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory: pytest.TempPathFactory):
    """The micro tiny checkpoint (seed 0), built once per test session."""
    from sglang_dsv4.tiny import build_tiny

    return build_tiny("micro", 0, tmp_path_factory.mktemp("micro") / "ckpt")


@pytest.fixture(scope="session")
def micro(micro_dir):
    """(config, dequantised float32 weights) of the micro checkpoint."""
    from sglang_dsv4.checkpoint import load_checkpoint

    ckpt = load_checkpoint(micro_dir)
    return ckpt.config, ckpt.tensors


@pytest.fixture(scope="session")
def micro64(micro_dir):
    """(config, dequantised float64 weights) of the micro checkpoint: float64 leaves no near-tie
    of a discrete choice (indexer top-k, routing) to fp32 round-off, so model and oracle must
    agree to ~1e-12 everywhere."""
    import torch

    from sglang_dsv4.checkpoint import load_checkpoint

    ckpt = load_checkpoint(micro_dir, dtype=torch.float64)
    return ckpt.config, ckpt.tensors


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny checkpoint's directory (FlashMLA's attention shape, seed 0), weights and config
    only: written once per test session without the tokenizer files, so the GPU image (which
    has no ``tokenizers``) can build it too."""
    from sglang_dsv4.checkpoint.writer import write_checkpoint
    from sglang_dsv4.tiny import preset_config, random_weights

    cfg = preset_config("tiny")
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    write_checkpoint(cfg, random_weights(cfg, 0), path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(config, dequantised float32 weights) of the tiny checkpoint (the GPU tests use it)."""
    from sglang_dsv4.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny_dir)
    return ckpt.config, ckpt.tensors


@pytest.fixture(scope="session")
def tiny_gpu(tiny):
    """(config, tiny's weights on the GPU: bf16 matrices, float32 elsewhere) for the GPU tests."""
    import torch

    from sglang_dsv4.core.model import weight_dtypes

    cfg, w = tiny
    dtype_of = weight_dtypes(torch.bfloat16)
    return cfg, {k: (v.to(dtype_of(k)) if v.is_floating_point() else v).to("cuda") for k, v in w.items()}


class ServingRows:
    """The serving cache (``SglangV4Cache``) driven as SGLang drives it: request rows of a
    ``req_to_token`` table, fresh token slots handed out per position."""

    def __init__(self, cfg, rows: int, token_slots: int = 16384, max_len: int = 1024,
                 device: str = "cuda", backend: str = "flashmla"):
        import torch

        from sglang_dsv4.srt.state import SglangV4Cache

        self.device = device
        self.cache = SglangV4Cache.with_own_table(cfg, rows, token_slots, max_seq_len=max_len, device=device,
                                                  backend=backend)
        self.next = 1

    def slots(self, row: int, start: int, n: int) -> None:
        """Give positions start..start+n-1 of ``row`` fresh token slots."""
        import torch

        self.cache.req_to_token[row, start:start + n] = torch.arange(self.next, self.next + n, dtype=torch.int32,
                                                                     device=self.device)
        self.next += n


@pytest.fixture(scope="session")
def serving_rows():
    """The ``ServingRows`` class (the GPU tests build one per scenario)."""
    return ServingRows


@pytest.fixture
def eager_regions(monkeypatch):
    """The fused regions run as their eager functions (``core.compiled``). With compilation on,
    which compiled variant runs a call depends on the calls before it: Dynamo keeps a static
    entry for a function's first shape beside the dynamic one both match, and tries the most
    recently used first; a replay makes no lookup while the run it is compared with does, so
    the two can pick different kernels of different rounding. Bit-for-bit claims about the
    graph's layout, buffers and inputs therefore hold the kernels fixed."""
    from sglang_dsv4.core import compiled

    monkeypatch.setattr(compiled, "ENABLED", False)


@pytest.fixture(scope="session")
def triton_interpreted():
    """Runs a script under ``TRITON_INTERPRET=1`` (Triton kernels on CPU tensors) in its own
    process (triton reads the variable at import) -> the float it prints after "WORST"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])

    def run(code: str) -> float:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return float(r.stdout.split("WORST")[1])

    return run
