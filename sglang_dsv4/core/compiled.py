"""Fused GPU kernels for the per-token math: ``torch.compile`` of ``ops`` functions on CUDA.

A V4 layer written as plain torch ops is ~700 kernels per decode step (the 20 Sinkhorn iterations
of each hyper-connection alone are ~80), each a few microseconds even for a handful of tokens;
inside a CUDA graph the launches are cheap but the kernels still run one after another. Inductor
fuses each decorated function's elementwise chains and reductions into a few Triton kernels
(GEMMs stay cuBLAS), which roughly halves a decode step of V4-Flash dimensions on an H200
(``benchmarks/profile_decode.py``). The CPU path is untouched: the oracle tests and CPU chunk
invariance see the eager functions.

``SGLANG_DSV4_COMPILE=0`` turns it off (eager everywhere). Compiled code is specialised on the
arguments' non-tensor values (config, strings, flags) and on shapes with automatic dynamic
shapes, so a function compiles a few times (prefill, decode) and not per batch size.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, TypeVar

import torch

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

ENABLED = os.environ.get("SGLANG_DSV4_COMPILE", "1") not in ("0", "false", "False", "")
# every decorated function is traced once per (config, string/flag arguments) variant and shape
# family: the default limit (8) would drop the later layers' variants back to eager
RECOMPILE_LIMIT = 64


def on_gpu(fn: F) -> F:
    """``fn`` compiled with ``torch.compile`` when its first argument is a CUDA tensor (and
    compilation is on); the eager ``fn`` otherwise, and when called from inside a traced one."""
    compiled = None

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        nonlocal compiled
        if not (ENABLED and args[0].is_cuda) or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            dyn = torch._dynamo.config
            dyn.recompile_limit = max(dyn.recompile_limit, RECOMPILE_LIMIT)
            dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 16 * RECOMPILE_LIMIT)
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    dispatch.eager = fn  # type: ignore[attr-defined]
    return dispatch  # type: ignore[return-value]
