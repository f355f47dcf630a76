"""Where this package's own Triton kernels run: on CUDA tensors, and on any tensor under Triton's
interpreter (``TRITON_INTERPRET=1``, read by triton at import: the CPU tests run the kernels so).
Each kernel module is imported on first use (the core imports no triton until a kernel runs)."""

from __future__ import annotations

import functools
import importlib
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# programmatic dependent launch for the kernels here (pdl_triton.py): opt-in (session 32, H100:
# the same bits, no faster at batch 1 or 256 inside the graphs); read per launch (pdl_options)
PDL = os.environ.get("SGLANG_DSV4_PDL", "0") == "1"


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


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9 and importable("pdl_triton") and \
        importlib.import_module(f"{__package__}.pdl_triton").AVAILABLE


def pdl_options(t: torch.Tensor) -> dict[str, bool]:
    """The PDL arguments of a launch of one of this package's kernels on ``t``'s device: with
    ``PDL`` on, on a CUDA GPU of compute capability 9 or more whose triton has the intrinsics,
    the kernel's ``PDL`` flag (it waits for its predecessor first) and the ``launch_pdl`` option;
    else none (the interpreter and older GPUs launch as always)."""
    if not (PDL and t.is_cuda and _pdl_capable(t.device)):
        return {}
    return {"PDL": True, "launch_pdl": True}


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): a block size ``tl.arange`` takes."""
    return 1 << max(n - 1, 0).bit_length()


__all__ = ["INTERPRET", "PDL", "importable", "runs_on", "pdl_options", "pow2"]
