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
shapes, so a function compiles a few times (prefill, decode) and not per batch size: a static
graph for the first token count, one for a count of 1 (Dynamo specialises size-1 dims), then a
dynamic one, about three per function and weight variant (a cold process spends ~90 s compiling
before flash8's first 16K prefill on an H200).

``SGLANG_DSV4_COMPILE=generic`` (opt-in, to be measured against the default on the GPU) marks the
dims each function declares (``on_gpu(rows=..., widths=...)``) before the call: the token /
request / length dims as unbacked (no specialisation, size 1 included), the entry widths as
dynamic. Each function then compiles once per genuinely different graph (``tests/core/test_compiled.py``:
one trace for any token count against three); a one-off CPU reproduction with flash8's layer
layout at micro widths counted 22 compiles in 40 s against 66 in 126 s, the same greedy tokens,
logits within 4e-8 (other kernels). Whether the shape-generic kernels decode as
fast as the size-1 ones and capture in CUDA graphs is what the GPU has to show.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Callable, Mapping, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)

MODE = os.environ.get("SGLANG_DSV4_COMPILE", "1")
ENABLED = MODE not in ("0", "false", "False", "")
GENERIC = MODE == "generic"
# every decorated function is traced once per (config, string/flag arguments) variant and shape
# family: the default limit (8) would drop the later layers' variants back to eager
RECOMPILE_LIMIT = 64
# Inductor's combo kernels (opt-in until timed, SGLANG_DSV4_COMBO_KERNELS=1): the independent
# kernels of one fused region launched as one grid, each part its own code (the same bits), for
# a step whose time is a chain of small kernels. Its sibling for the launches themselves,
# programmatic dependent launch, is torch's own switch: TORCHINDUCTOR_ENABLE_PDL=1.
INDUCTOR_OPTIONS: dict[str, object] = (
    {"combo_kernels": True} if os.environ.get("SGLANG_DSV4_COMBO_KERNELS", "0") == "1" else {})


Dims = Mapping[str, tuple[int, ...]]


def on_gpu(fn: F | None = None, *, rows: Dims | None = None, widths: Dims | None = None):
    """``fn`` compiled with ``torch.compile`` when its first argument is a CUDA tensor (and
    compilation is on); the eager ``fn`` otherwise, and when called from inside a traced one.

    ``rows`` / ``widths``: {argument name: dims} whose sizes follow the step's token, request or
    length counts / the entry-table widths, marked unbacked / dynamic in the generic mode
    (module docstring). A negative dim counts from the end and is skipped on a tensor with fewer
    dims (an argument that is [T, k] in some layers and [E] in others)."""
    if fn is None:
        return lambda f: on_gpu(f, rows=rows, widths=widths)
    names = list(inspect.signature(fn).parameters)
    marks = []
    for spec, unbacked in ((rows or {}, True), (widths or {}, False)):
        for arg, dims in spec.items():
            if arg not in names:
                raise ValueError(f"on_gpu({fn.__name__}): no argument {arg!r} to mark")
            marks += [(names.index(arg), arg, d, unbacked) for d in dims]
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
            compiled = torch.compile(fn, options=dict(INDUCTOR_OPTIONS) or None)
        if GENERIC:
            mark_dims(args, kwargs, marks)
        return compiled(*args, **kwargs)

    dispatch.eager = fn  # type: ignore[attr-defined]
    dispatch.marks = tuple(marks)  # type: ignore[attr-defined]
    return dispatch


def mark_dims(args: tuple, kwargs: dict, marks: Sequence[tuple[int, str, int, bool]]) -> None:
    """Mark the declared dims of a call's tensor arguments (``on_gpu``'s generic mode)."""
    for i, name, d, unbacked in marks:
        arg = args[i] if i < len(args) else kwargs.get(name)
        for t in (arg if isinstance(arg, tuple) else (arg,)):  # a tuple of tensors (ops.Rope): each
            if not isinstance(t, torch.Tensor) or not -t.dim() <= d < t.dim():
                continue
            dt = d % t.dim()
            if unbacked:
                torch._dynamo.decorators.mark_unbacked(t, dt)
            else:
                torch._dynamo.mark_dynamic(t, dt)
