"""Which precision the checkpoint's matrices keep on the device (``--dsv4-weights``).

- ``bf16``: every fp8 / fp4 matrix dequantised to the matmul dtype (bf16 on a GPU, the CPU's
  float32): the oracle-checked path.
- ``fp8``: matrices stored fp8 e4m3 + 128x128 e8m0 scales stay so (``kernels.fp8_linear``), with
  ``attn.wo_a`` the exception (dequantised to bf16, as DeepSeek's ``convert.py`` and upstream
  SGLang without DeepGEMM do: it runs as a grouped einsum, not a linear; ``SGLANG_DSV4_WO_A_FP8=1``
  keeps it fp8 for a weight-only kernel with the einsum's bf16 products,
  ``fp8_weight_only.grouped_weight_only_linear``); routed fp4 experts are
  converted at load to fp8 block-128, exactly (``quant.fp4_to_fp8_blockwise``), and run through
  the grouped fp8 GEMMs (``kernels.fp8_moe``). Activations are quantised before each fp8 GEMM as
  V4's QAT does (e4m3, groups of 128, power-of-two scales).
- ``auto``: ``fp8`` where it can run (a CUDA GPU of SM90+, Triton, a checkpoint whose experts are
  fp4/fp8), ``bf16`` elsewhere. Verified on an H200 (``tests/kernels/test_fp8_gpu.py``: kernels
  against torch, weight bytes within 1% of the checkpoint's with the experts counted twice,
  logits against the bf16 path, graph replay, no host sync) and timed against bf16
  (``benchmarks/results/decode_h200.md``): V4-Flash dimensions, 8 layers, 16K context, graphs:
  batch 64 13.3 ms vs 16.7 ms, batch 1 8.4 ms vs 7.8 ms, with 61% of bf16's weight bytes. It
  is the checkpoint's precision and what lets V4-Flash fit on four H200s.

Not offered: ``w4a16`` (fp4 experts kept as e2m1 and multiplied by bf16 activations). Its
kernels are Marlin (in ``sgl_kernel``) and FlashInfer's, and neither is in the GPU image this
project runs on (``sgl_kernel`` is the pure-torch stand-in there, FlashInfer is absent).
"""

from __future__ import annotations

import torch

from ..config import V4Config
from ..quant import FP8_WEIGHT_BLOCK

WEIGHTS_KEY = "dsv4_weights"  # the model override key (--json-model-override-args)
WEIGHTS_FLAG = "--dsv4-weights"
WEIGHT_MODES = ("auto", "bf16", "fp8")
RESOLVED_MODES = ("bf16", "fp8")
UNAVAILABLE_MODES = {
    "w4a16": "W4A16 needs Marlin (sgl_kernel) or FlashInfer's W4A16 MoE, and neither is importable in the "
             "GPU image sglang_dsv4 targets (sgl_kernel is a pure-torch stand-in there, FlashInfer is "
             "absent); fp8 keeps the experts in 1 byte per weight (the fp4 codes converted exactly)",
}
FP8_MIN_SM = 9


class WeightModeError(ValueError):
    """A weight mode that cannot run here or that the checkpoint cannot give."""


def fp8_missing(device: torch.device | str) -> str | None:
    """What the fp8 weight mode lacks on ``device`` (None: nothing)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the fp8 block GEMMs are Triton kernels for CUDA GPUs (SM{FP8_MIN_SM}0+), the device is {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < FP8_MIN_SM:
        return f"fp8 e4m3 GEMMs need SM{FP8_MIN_SM}0 or newer, this GPU is SM{major}{minor}"
    from .fp8_linear import triton_missing

    return triton_missing()


def _experts_quantised(cfg: V4Config | None) -> bool:
    return cfg is None or cfg.expert_dtype in ("fp4", "fp8")


def fp8_tp_problem(cfg: V4Config | None, tp_size: int) -> str | None:
    """Why tensor parallelism over ``tp_size`` ranks cannot cut the fp8 matrices on their 128x128
    scale blocks (None: it can). TP cuts ``wq_b``'s rows by heads and ``wo_b``'s columns by output
    groups (``core.parallel.TensorSharder``); ``wo_a``'s rows by the same groups (held fp8 only
    where a group is whole 128-row blocks, ``fp8_linear.groups_fit``)."""
    if cfg is None or tp_size <= 1:
        return None
    B = FP8_WEIGHT_BLOCK
    rows = cfg.num_attention_heads // tp_size * cfg.head_dim
    cols = cfg.o_groups // tp_size * cfg.o_lora_rank
    if rows % B or cols % B:
        return (f"at --tp-size {tp_size} a rank's share of wq_b ({rows} rows) or wo_b ({cols} columns) "
                f"does not fall on {B}x{B} scale blocks")
    return None


def select_weight_mode(requested: str | None, device: torch.device | str,
                       cfg: V4Config | None = None, tp_size: int = 1) -> tuple[str, str]:
    """-> (``bf16`` or ``fp8``, why, for the startup log). ``requested`` None means ``auto``.
    Raises WeightModeError for an unknown or unavailable mode, and for ``fp8`` where its kernels
    are missing, the checkpoint's experts are bf16 or ``tp_size`` cuts a matrix off its scale
    blocks (the message names the flag); ``auto`` falls back to bf16 in those cases."""
    mode = requested or "auto"
    if mode in UNAVAILABLE_MODES:
        raise WeightModeError(f"{WEIGHTS_FLAG} {mode} ({WEIGHTS_KEY}): not available: {UNAVAILABLE_MODES[mode]}")
    if mode not in WEIGHT_MODES:
        raise WeightModeError(f"{WEIGHTS_FLAG} ({WEIGHTS_KEY}): unknown weight mode {mode!r} "
                              f"(known: {', '.join(WEIGHT_MODES)})")
    if mode == "bf16":
        return "bf16", f"{WEIGHTS_FLAG} bf16: matrices dequantised"
    missing = fp8_missing(device)
    experts_ok = _experts_quantised(cfg)
    tp_problem = fp8_tp_problem(cfg, tp_size)
    if mode == "fp8":
        if tp_problem:
            raise WeightModeError(f"{WEIGHTS_FLAG} fp8 ({WEIGHTS_KEY}): {tp_problem}; use {WEIGHTS_FLAG} bf16")
        if missing:
            raise WeightModeError(f"{WEIGHTS_FLAG} fp8 ({WEIGHTS_KEY}): cannot run here: {missing}; "
                                  f"use {WEIGHTS_FLAG} bf16 or auto")
        if not experts_ok:
            raise WeightModeError(f"{WEIGHTS_FLAG} fp8 ({WEIGHTS_KEY}): the checkpoint stores its routed experts "
                                  f"in {cfg.expert_dtype} (expert_dtype), not fp4/fp8; use {WEIGHTS_FLAG} bf16")
        return "fp8", f"{WEIGHTS_FLAG} fp8: fp8 block-128 matrices, fp4 experts converted to fp8"
    if missing:
        return "bf16", f"{WEIGHTS_FLAG} auto -> bf16: fp8 unavailable ({missing})"
    if not experts_ok:
        return "bf16", f"{WEIGHTS_FLAG} auto -> bf16: the checkpoint's experts are {cfg.expert_dtype}"
    if tp_problem:
        return "bf16", f"{WEIGHTS_FLAG} auto -> bf16: {tp_problem}"
    return "fp8", f"{WEIGHTS_FLAG} auto -> fp8: fp8 block-128 matrices, fp4 experts converted to fp8 (Triton, SM90+)"


__all__ = ["WEIGHTS_KEY", "WEIGHTS_FLAG", "WEIGHT_MODES", "RESOLVED_MODES", "UNAVAILABLE_MODES",
           "WeightModeError", "fp8_missing", "fp8_tp_problem", "select_weight_mode"]
