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
def tiny(tmp_path_factory):
    """(config, dequantised float32 weights) of the tiny checkpoint (FlashMLA's attention shape,
    seed 0), written once per test session (the GPU tests use it)."""
    from sglang_dsv4.checkpoint import load_checkpoint
    from sglang_dsv4.checkpoint.writer import write_checkpoint
    from sglang_dsv4.tiny import preset_config, random_weights

    cfg = preset_config("tiny")
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    write_checkpoint(cfg, random_weights(cfg, 0), path)
    ckpt = load_checkpoint(path)
    return ckpt.config, ckpt.tensors
