"""Where this package's own Triton kernels run: on CUDA tensors, and on any tensor under Triton's
interpreter (``TRITON_INTERPRET=1``, read by triton at import: the CPU tests run the kernels so).
Each kernel module is imported on first use (the core imports no triton until a kernel runs)."""

from __future__ import annotations

import importlib
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


_IMPORTABLE: dict[str, bool] = {}


# a constant of the process: a traced region (core.compiled) takes the answer as a constant rather
# than tracing into importlib, which Dynamo skips with a graph break (count_step_ops --regions)
@torch.compiler.assume_constant_result
def importable(module: str) -> bool:
    """Whether the kernel module ``sglang_dsv4.kernels.<module>`` imports here (triton present and
    initialising); tried once a process."""
    if module not in _IMPORTABLE:
        try:
            importlib.import_module(f"{__package__}.{module}")
            _IMPORTABLE[module] = True
        except Exception:  # ImportError, or triton failing to initialise
            _IMPORTABLE[module] = False
    return _IMPORTABLE[module]


def runs_on(t: torch.Tensor, module: str) -> bool:
    """Whether the kernels of ``module`` can take ``t``: a CUDA tensor (or the interpreter) and
    the module importable."""
    return (t.is_cuda or INTERPRET) and importable(module)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): a block size ``tl.arange`` takes."""
    return 1 << max(n - 1, 0).bit_length()


__all__ = ["INTERPRET", "importable", "runs_on", "pow2"]
