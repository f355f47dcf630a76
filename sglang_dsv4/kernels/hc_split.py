"""The hyper-connection split and Sinkhorn on the GPU through SGLang's Triton kernel.

``ops.hc_pre`` turns each token's 24 mixes into pre / post weights and a 4x4 Sinkhorn-normalised
comb matrix (v4_architecture.md §5.3). Written as torch ops, the 39 normalisations are one
Inductor kernel each (~80 launches per layer and step, a quarter of a decode step's kernels at
V4-Flash dimensions); SGLang 0.5.23 ships the whole split as one Triton program per token
(``sglang.kernels.ops.layernorm.mhc._hc_split_sinkhorn_triton``, the port of DeepSeek's
``hc_split_sinkhorn`` kernel, the same math in the same order). Where SGLang is importable (the
server) ``hc_split_sinkhorn`` launches it; elsewhere (the standalone core, a CPU) it returns None
and ``ops.hc_pre`` keeps its torch ops (``ops.hc_split_torch``). Its public wrapper ``hc_split_sinkhorn`` is not called:
on Hopper it takes a TileLang kernel, which the serving image does not have.

``hc_pre_split`` (on by default since session 32, ``SGLANG_DSV4_HC_FUSED_PRE=0`` off; 1.04-1.46x
faster per call on an H100, ``benchmarks/bench_hc_pre.py``) goes one step further with SGLang's
``hc_mix_stats_sinkhorn``: the mixes' GEMM and the streams' sum of squares as one split-K Triton
kernel, then the RMS scale, split and Sinkhorn as a second, two launches for what is a cuBLAS sgemm,
its split-K reduction, ~3 Inductor kernels and the split kernel by default (the session-27 census:
~5 launches per ``hc_pre``, 16 calls a flash8 step). Its K slicing depends on K alone, so a row's
mixes are the same bits alone or in any batch; its dot products are "tf32x3" (fp32 to rounding,
another summation order than cuBLAS's).

Importing SGLang's module loads ``sglang.srt`` (a few seconds, once); under ``TRITON_INTERPRET=1``
the kernels also run on CPU tensors (the tests).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch

from ..config import V4Config
from .triton_support import INTERPRET  # a module attribute here: tests switch it off

logger = logging.getLogger(__name__)
Tensor = torch.Tensor
FUSED_PRE = os.environ.get("SGLANG_DSV4_HC_FUSED_PRE", "1") == "1"
MIX_BLOCK_K = 64  # the K tile of SGLang's mixes GEMM (``_HC_MIX_BLOCK_K``): hc * D must be a multiple of it


@functools.lru_cache(maxsize=None)
def sglang_kernel() -> Callable | None:
    """SGLang's Triton split + Sinkhorn launcher, or None (with the reason logged once) where
    SGLang or Triton does not import."""
    try:
        from sglang.kernels.ops.layernorm.mhc import _hc_split_sinkhorn_triton
    except Exception as e:  # ImportError; or sglang.srt failing to initialise without its runtime
        logger.info("hyper-connection Sinkhorn: the torch path (SGLang's Triton kernel does not import: %s: %s)",
                    type(e).__name__, e)
        return None
    logger.info("hyper-connection Sinkhorn: SGLang's Triton kernel (_hc_split_sinkhorn_triton)")
    return _hc_split_sinkhorn_triton


@functools.lru_cache(maxsize=None)
def sglang_fused_pre() -> Callable | None:
    """SGLang's mixes + split + Sinkhorn launcher (``hc_mix_stats_sinkhorn``), or None where it
    does not import (logged once)."""
    try:
        from sglang.kernels.ops.layernorm.mhc import hc_mix_stats_sinkhorn
    except Exception as e:
        logger.info("hyper-connection mixes: the default path (SGLang's hc_mix_stats_sinkhorn does not import: "
                    "%s: %s)", type(e).__name__, e)
        return None
    logger.info("hyper-connection mixes, split and Sinkhorn: SGLang's hc_mix_stats_sinkhorn (two launches)")
    return hc_mix_stats_sinkhorn


@torch.compiler.disable
def hc_pre_split(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, cfg: V4Config,
                 enabled: bool | None = None) -> tuple[Tensor, Tensor, Tensor] | None:
    """h [T, hc, D] (float32) -> (pre [T, hc], post [T, hc], comb [T, hc, hc]) of ``ops.hc_pre``
    from SGLang's two fused kernels (module docstring); None where they do not run here: not
    enabled (``enabled`` None: ``SGLANG_DSV4_HC_FUSED_PRE``), a CPU tensor outside the
    interpreter, no SGLang, no tokens, hc * D not a multiple of ``MIX_BLOCK_K``."""
    if not (FUSED_PRE if enabled is None else enabled):
        return None
    flat = h.flatten(1)
    if (flat.shape[0] == 0 or flat.dtype != torch.float32 or fn.dtype != torch.float32
            or flat.shape[1] % MIX_BLOCK_K or not (flat.is_cuda or INTERPRET)):
        return None
    kernel = sglang_fused_pre()
    if kernel is None:
        return None
    return kernel(flat.contiguous(), fn.contiguous(), scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters,
                  cfg.rms_norm_eps, cfg.hc_eps)


@torch.compiler.disable  # a kernel launch, not something to trace
def hc_split_sinkhorn(mixes: Tensor, scale: Tensor, base: Tensor, cfg: V4Config) -> tuple[Tensor, Tensor, Tensor] | None:
    """mixes [T, (2 + hc) * hc] (float32) -> (pre [T, hc], post [T, hc], comb [T, hc, hc]) from
    SGLang's kernel; None where it cannot run here (a CPU tensor outside the interpreter, no
    SGLang, no tokens: its grid would be empty)."""
    if mixes.shape[0] == 0 or mixes.dtype != torch.float32 or not (mixes.is_cuda or INTERPRET):
        return None
    kernel = sglang_kernel()
    if kernel is None:
        return None
    pre, post, comb = kernel(mixes.unsqueeze(0), scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    return pre[0], post[0], comb[0]


__all__ = ["hc_pre_split", "hc_split_sinkhorn", "sglang_fused_pre", "sglang_kernel"]
