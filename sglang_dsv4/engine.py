"""The offline ``sgl.Engine`` for a V4 model, on GPU or on a CPU-only machine.

    from sglang_dsv4.engine import make_engine
    engine = make_engine("micro")          # builds the tiny model on first use
    out = engine.generate(input_ids=[0, 5, 6], sampling_params={"max_new_tokens": 8})

Call it before anything imports ``sglang``: on CPU it sets the environment the launcher sets
(``SGLANG_USE_CPU_ENGINE``, the ``sgl_kernel`` stand-in first on the import path) and the same
default arguments; keyword arguments override them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .launch_server import CPU_DEFAULTS, SHIM_DIR, TINY_PRESETS, cache_dir, cpu_environment


def make_engine(model_path: str = "micro", **kwargs: Any):
    """An ``sglang.Engine`` serving ``model_path`` (``micro``, ``tiny`` or a checkpoint dir)."""
    import torch

    if model_path in TINY_PRESETS:
        from .tiny import ensure_tiny

        model_path = str(ensure_tiny(model_path, 0, cache_dir()))
    if not torch.cuda.is_available():
        if "sglang" in sys.modules and str(SHIM_DIR) not in sys.path:
            raise RuntimeError("make_engine must run before sglang is imported (CPU set-up)")
        os.environ.update(cpu_environment(dict(os.environ)))
        sys.path.insert(0, str(SHIM_DIR))
        kwargs = {**CPU_DEFAULTS, **kwargs}
    import sglang as sgl

    return sgl.Engine(model_path=model_path, **kwargs)
