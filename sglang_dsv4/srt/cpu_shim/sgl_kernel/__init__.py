"""Pure-torch stand-in for the CUDA-only ``sgl_kernel`` module, for SGLang on a CPU-only machine.

SGLang's scheduler imports ``sgl_kernel`` at module import time when it runs on CPU (before any
plugin can act), and the PyPI ``sglang-kernel`` wheel fails to load without ``libcuda.so.1``.
``sglang_dsv4.launch_server`` puts this directory first on ``PYTHONPATH`` only when CUDA is absent.
It implements the CPU helpers SGLang 0.5.23 calls on that path; any other name imports but raises
when called. ``scripts/gpu_server_check.sh`` uses it on the GPU machine too (which cannot install the
sglang-kernel wheel): SGLang's CUDA path also imports from the submodules ``quantization``,
``kvcacheio`` and ``utils``, which resolve names the same way.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, max_context_len: int) -> None:
    """req_to_token[req, start:end] = the next (end - start) entries of out_cache_loc, per request."""
    pos = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def __getattr__(name: str):
    """Other CPU kernels (speculative trees, KV row moves, ...) are imported by SGLang modules on
    this path but never called by a V4 server on CPU; calling one says so plainly."""
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available on this CPU machine "
                                  "(sglang_dsv4's pure-torch stand-in provides only what V4 serving uses)")

    unavailable.__name__ = name
    return unavailable
